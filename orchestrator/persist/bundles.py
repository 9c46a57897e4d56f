"""Resume bundles: where they live, their manifest, and how a run finds one.

A bundle is version ``v`` (the epoch boundary it was taken at, = epochs done) of a run:

- ``model``: the consensus parameters and buffers, one safetensors blob;
- ``optim``: the saving rank's optimizer state, one safetensors blob (JSON for the rest);
- ``meta``: the coordinator's record (``schema_version``, ``epoch`` to start from,
  ``global_step``, ``rounds``, ``world_size``, ``reason``, El Che state, divergence history,
  coverage of every epoch done, seed, batch size, dataset size, eval history).

Blobs are tensors and JSON only (never pickle). They go to the job's Object Store bucket
``ddpbus_<job>_bundles`` (the store chunks them and checks a SHA-256 digest) or, with
``--bundle-dir``, to a directory (a shared volume): ``<dir>/v<version>/{model,optim}.safetensors``
beside a ``manifest.json``, and ``<dir>/latest.json``. The *manifest* names the blobs with
their sizes and SHA-256 digests plus the meta; it is written last, to the job's KV key
``bundle.latest`` (and ``latest.json``), so it only ever points at complete blobs.

``ddpbus coordinator --resume SOURCE`` resolves SOURCE (a bundle directory, a ``--bundle-dir``
directory, or the name of an earlier job on the same broker), checks it against the run's
settings, and stores it under this job's ``bundle.resume``: every rank admitted without a
bundle of its own loads it before training.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    DigestMismatchError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.object_store import ObjectStore

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.core.bundle_meta import SCHEMA_VERSION, BundleError
from ddpbus.orchestrator.transport import bus

__all__ = ["SCHEMA_VERSION", "BundleError", "Manifest",
           "bucket", "check_fits", "latest", "object_store", "read_blobs", "read_directory",
           "resolve", "write"]

KEEP_VERSIONS: Final = 2  # object-store bundles kept per job (older ones are deleted)
PARTS: Final = ("model", "optim")


def bucket(job: str) -> str:
    return sj.bundles_bucket(job)


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True, slots=True)
class Manifest:
    """Where a bundle's blobs are and what it holds."""

    job: str
    version: int
    store: dict[str, str]  # {"kind": "object", "bucket": B} | {"kind": "dir", "path": P}
    parts: dict[str, dict[str, Any]]  # part -> {"name", "size", "sha256"}
    meta: dict[str, Any]

    def to_json(self) -> bytes:
        return json.dumps({"schema_version": SCHEMA_VERSION, "job": self.job,
                           "version": self.version, "store": self.store, "parts": self.parts,
                           "meta": self.meta}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(raw)
            schema = int(doc["schema_version"])
            store = {str(k): str(v) for k, v in doc["store"].items()}
            parts = {p: dict(doc["parts"][p]) for p in PARTS}
            manifest = cls(job=str(doc["job"]), version=int(doc["version"]), store=store,
                           parts=parts, meta=doc["meta"])
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
                RecursionError) as exc:  # Infinity as an int; arrays nested too deep
            raise BundleError(f"{where}: not a ddpbus bundle manifest ({exc!r})") from None
        if schema > SCHEMA_VERSION:
            raise BundleError(f"{where}: bundle schema {schema} is newer than this ddpbus "
                              f"reads ({SCHEMA_VERSION}); upgrade ddpbus")
        if store.get("kind") not in ("object", "dir"):
            raise BundleError(f"{where}: unknown bundle store {store.get('kind')!r}")
        if not isinstance(manifest.meta, dict):
            raise BundleError(f"{where}: the bundle meta is not a record")
        return manifest

    def describe(self) -> str:
        where = self.store.get("bucket") or self.store.get("path")
        return (f"bundle v{self.version} of job {self.job} ({self.store['kind']} {where}: "
                f"epoch {self.meta.get('epoch')}, global step {self.meta.get('global_step')})")


# ------------------------------------------------------------------ writing


async def write(js: JetStreamContext, job: str, version: int, blobs: Mapping[str, bytes],
                meta: Mapping[str, Any], directory: Path | None = None) -> Manifest:
    """Store the blobs, then the manifest (the commit point) in KV and, for a directory,
    ``latest.json``. Returns the manifest."""
    if directory is None:
        parts: dict[str, dict[str, Any]] = {}
        store = await object_store(js, job, create=True)
        for part in PARTS:
            name = f"v{version}/{part}.safetensors"
            await store.put(name, blobs[part])
            parts[part] = _describe(name, blobs[part])
        manifest = Manifest(job=job, version=version, parts=parts, meta=dict(meta),
                            store={"kind": "object", "bucket": bucket(job)})
    else:
        manifest = await asyncio.to_thread(_write_directory, directory, job, version, blobs,
                                           meta)
    if await _commit(js, job, manifest):
        if directory is None:
            await _prune(js, job, version)
        else:  # the directory's pointer follows the committed one, never back in time
            await asyncio.to_thread(_point_latest, directory, manifest)
    return manifest


async def _commit(js: JetStreamContext, job: str, manifest: Manifest) -> bool:
    """Point ``bundle.latest`` at ``manifest`` unless it already names a newer version (a
    slower write of an older bundle, e.g. by a rank the checkpoint role moved away from,
    must not go back in time): compare-and-set on the key's revision. False if skipped."""
    kv = await js.key_value(sj.kv_bucket(job))
    for _ in range(20):
        try:
            entry = await kv.get(sj.LATEST_BUNDLE_KEY)
        except KeyNotFoundError:
            entry = None
        current = None
        if entry is not None and entry.value:
            with contextlib.suppress(BundleError):
                current = Manifest.from_json(entry.value, sj.LATEST_BUNDLE_KEY)
        if current is not None and current.version >= manifest.version:
            return False
        try:
            if entry is None:
                await kv.create(sj.LATEST_BUNDLE_KEY, manifest.to_json())
            else:
                await kv.update(sj.LATEST_BUNDLE_KEY, manifest.to_json(), last=entry.revision)
        except KeyWrongLastSequenceError:
            continue  # another commit landed in between: look again
        return True
    raise BundleError(f"bundle v{manifest.version}: {sj.LATEST_BUNDLE_KEY} of job {job} kept "
                      "changing under 20 compare-and-set attempts")


def _describe(name: str, blob: bytes) -> dict[str, Any]:
    return {"name": name, "size": len(blob), "sha256": _digest(blob)}


def _write_directory(directory: Path, job: str, version: int, blobs: Mapping[str, bytes],
                     meta: Mapping[str, Any]) -> Manifest:
    parts = {}
    for part in PARTS:
        name = f"v{version}/{part}.safetensors"
        _atomic_write(directory / name, blobs[part])
        parts[part] = _describe(name, blobs[part])
    manifest = Manifest(job=job, version=version, parts=parts, meta=dict(meta),
                        store={"kind": "dir", "path": str(directory.resolve())})
    _atomic_write(directory / f"v{version}" / "manifest.json", manifest.to_json())
    return manifest


def _point_latest(directory: Path, manifest: Manifest) -> None:
    """``latest.json`` names ``manifest`` unless it names a newer version already: a
    slower write of an older bundle that committed first must not land its pointer last
    (``--resume DIR`` reads only this file)."""
    path = directory / "latest.json"
    with contextlib.suppress(OSError, BundleError):
        current = Manifest.from_json(path.read_bytes(), str(path))
        if current.job == manifest.job and current.version >= manifest.version:
            return  # (an earlier job's pointer, e.g. `ddpbus run` into the same --out, goes)
    _atomic_write(path, manifest.to_json())


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BundleError(f"cannot write {path}: {exc}") from exc


async def object_store(js: JetStreamContext, job: str, *, create: bool = False
                       ) -> ObjectStore:
    try:
        return await js.object_store(bucket(job))
    except (BucketNotFoundError, NotFoundError):
        if not create:
            raise BundleError(f"job {job!r} has no bundle bucket {bucket(job)}") from None
        return await js.create_object_store(bucket(job), config=ObjectStoreConfig(
            storage=StorageType.FILE, description=f"ddpbus resume bundles of job {job}"))


async def _prune(js: JetStreamContext, job: str, newest: int) -> None:
    """Delete object-store bundles older than the last ``KEEP_VERSIONS``."""
    store = await object_store(js, job)
    try:
        infos = await store.list(ignore_deletes=True)
    except NotFoundError:
        return
    for info in infos:
        try:
            version = int(info.name.split("/", 1)[0].removeprefix("v"))
        except ValueError:
            continue
        if version <= newest - KEEP_VERSIONS:
            await store.delete(info.name)


# ------------------------------------------------------------------ reading


async def latest(js: JetStreamContext, job: str, key: str = sj.LATEST_BUNDLE_KEY
                 ) -> Manifest | None:
    """The manifest under ``key`` in ``job``'s KV, None if there is none."""
    try:
        kv = await js.key_value(sj.kv_bucket(job))
        entry = await kv.get(key)
    except (BucketNotFoundError, KeyNotFoundError, NotFoundError):
        return None
    if not entry.value:
        return None
    return Manifest.from_json(entry.value, f"{key} of job {job}")


async def read_blobs(js: JetStreamContext, manifest: Manifest) -> dict[str, bytes]:
    """Every blob of ``manifest``, its size and SHA-256 digest checked."""
    blobs: dict[str, bytes] = {}
    for part in PARTS:
        info = manifest.parts[part]
        name = str(info["name"])
        if manifest.store["kind"] == "dir":
            path = Path(manifest.store["path"]) / name
            try:
                blob = await asyncio.to_thread(path.read_bytes)
            except OSError as exc:
                raise BundleError(f"{manifest.describe()}: cannot read {path}: {exc}") from exc
        else:
            store = await _object_store_named(js, manifest.store["bucket"])
            try:
                blob, _ = await bus.read_object(store, name)
            except NotFoundError:
                raise BundleError(f"{manifest.describe()}: object {name} is gone") from None
            except DigestMismatchError:
                raise BundleError(f"{manifest.describe()}: object {name} fails the "
                                  "store's digest") from None
        if len(blob) != int(info["size"]) or _digest(blob) != info["sha256"]:
            raise BundleError(f"{manifest.describe()}: {name} does not match its digest "
                              "(altered or truncated)")
        blobs[part] = blob
    return blobs


async def _object_store_named(js: JetStreamContext, name: str) -> ObjectStore:
    try:
        return await js.object_store(name)
    except (BucketNotFoundError, NotFoundError):
        raise BundleError(f"bundle bucket {name} does not exist on this broker") from None


def read_directory(path: Path) -> Manifest:
    """A bundle directory (``…/v<N>``, holding ``manifest.json``) or a ``--bundle-dir``
    (holding ``latest.json``)."""
    for candidate in (path / "manifest.json", path / "latest.json",
                      path / "bundles" / "latest.json"):
        if candidate.is_file():
            try:
                raw = candidate.read_bytes()
            except OSError as exc:
                raise BundleError(f"cannot read {candidate}: {exc}") from exc
            return Manifest.from_json(raw, str(candidate))
    raise BundleError(f"{path} holds no bundle (no manifest.json, latest.json or "
                      "bundles/latest.json)")


def _local_source(source: str) -> Manifest | None:
    path = Path(source)
    if not path.exists():
        return None
    if not path.is_dir():
        raise BundleError(f"--resume {source}: not a directory")
    return read_directory(path)


async def resolve(js: JetStreamContext, source: str) -> Manifest:
    """``--resume SOURCE``: a directory on this host, else an earlier job's name."""
    local = await asyncio.to_thread(_local_source, source)
    if local is not None:
        return local
    try:
        sj.check_job(source)
    except DdpbusError:
        raise BundleError(f"--resume {source}: no such directory, and not a job name"
                          ) from None
    found = await latest(js, source)
    if found is None:
        raise BundleError(f"--resume {source}: job {source!r} has no bundle on this broker "
                          f"(no {sj.LATEST_BUNDLE_KEY} in {sj.kv_bucket(source)})")
    return found


def check_fits(manifest: Manifest, *, seed: int, batch_size: int, epochs: int) -> None:
    """Refuse a bundle that this run's settings cannot continue exactly."""
    meta = manifest.meta
    try:
        their_seed, their_batch, their_epoch = (int(meta.get("seed", seed)), int(meta.get(
            "batch_size", batch_size)), int(meta.get("epoch", 0)))
    except (ValueError, TypeError, OverflowError) as exc:
        raise BundleError(f"{manifest.describe()}: malformed bundle meta ({exc!r})") from None
    problems = []
    if their_seed != seed:
        problems.append(f"seed {meta.get('seed')} (this run: {seed}; the epochs' "
                        "permutations would differ)")
    if their_batch != batch_size:
        problems.append(f"batch_size {meta.get('batch_size')} (this run: {batch_size})")
    if their_epoch >= epochs:
        problems.append(f"it is at epoch {meta.get('epoch')} and this run has only "
                        f"{epochs} epochs (raise --epochs to train on)")
    if problems:
        raise BundleError(f"{manifest.describe()} cannot resume this run: "
                          + "; ".join(problems))
