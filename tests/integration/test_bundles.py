"""Resume bundles in a real nats-server's Object Store and KV: written blobs first and the
manifest last, read back digest-checked, old versions pruned, sources resolved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nats.aio.client import Client

from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.runtime.provision import ensure_job

pytestmark = pytest.mark.asyncio


def blobs(version: int) -> dict[str, bytes]:
    # big enough to span several 128 KiB object-store chunks
    return {"model": os.urandom(300_000) + bytes([version]), "optim": os.urandom(1000)}


async def test_object_store_bundles_commit_read_back_and_prune(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_job(js, "old", 2)
    assert await bundles.latest(js, "old") is None
    written = {}
    for version in (1, 2, 3):
        written[version] = blobs(version)
        manifest = await bundles.write(js, "old", version, written[version],
                                       {"epoch": version, "global_step": 10 * version})
    latest = await bundles.latest(js, "old")
    assert latest == manifest
    assert latest.store == {"kind": "object", "bucket": bundles.bucket("old")}
    assert await bundles.read_blobs(js, latest) == written[3]
    # only the last two versions are kept
    store = await js.object_store(bundles.bucket("old"))
    names = sorted(i.name for i in await store.list(ignore_deletes=True))
    assert names == ["v2/model.safetensors", "v2/optim.safetensors",
                     "v3/model.safetensors", "v3/optim.safetensors"]
    # another job on the broker resumes from it by name
    assert await bundles.resolve(js, "old") == latest


async def test_a_missing_or_replaced_object_is_refused(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_job(js, "old", 2)
    manifest = await bundles.write(js, "old", 1, blobs(1), {"epoch": 1})
    store = await js.object_store(bundles.bucket("old"))
    await store.put("v1/optim.safetensors", b"something else")
    with pytest.raises(bundles.BundleError, match="digest"):
        await bundles.read_blobs(js, manifest)
    await store.delete("v1/model.safetensors")
    with pytest.raises(bundles.BundleError, match="gone"):
        await bundles.read_blobs(js, manifest)


async def test_unknown_sources_are_clear_errors(nc: Client, tmp_path: Path) -> None:
    js = nc.jetstream()
    await ensure_job(js, "empty", 2)
    with pytest.raises(bundles.BundleError, match="has no bundle"):
        await bundles.resolve(js, "empty")
    with pytest.raises(bundles.BundleError, match="not a job name"):
        await bundles.resolve(js, "no/such/dir")
    (tmp_path / "file").write_text("x")
    with pytest.raises(bundles.BundleError, match="not a directory"):
        await bundles.resolve(js, str(tmp_path / "file"))
    with pytest.raises(bundles.BundleError, match="holds no bundle"):
        await bundles.resolve(js, str(tmp_path))


async def test_a_directory_bundle_is_found_from_its_manifest_in_kv(nc: Client,
                                                                   tmp_path: Path) -> None:
    js = nc.jetstream()
    await ensure_job(js, "old", 2)
    manifest = await bundles.write(js, "old", 4, blobs(4), {"epoch": 4},
                                   directory=tmp_path / "vol")
    assert await bundles.latest(js, "old") == manifest
    assert await bundles.resolve(js, str(tmp_path / "vol")) == manifest
    assert await bundles.read_blobs(js, manifest) == await bundles.read_blobs(
        js, bundles.read_directory(tmp_path / "vol" / "v4"))


async def test_an_older_bundle_written_late_never_replaces_a_newer_one(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_job(js, "old", 2)
    newer = await bundles.write(js, "old", 5, blobs(5), {"epoch": 5})
    await bundles.write(js, "old", 4, blobs(4), {"epoch": 4})  # a slow writer, late
    assert await bundles.latest(js, "old") == newer


async def test_a_directorys_latest_never_goes_back_to_an_older_bundle(nc: Client,
                                                                      tmp_path: Path) -> None:
    """`--resume DIR` reads only latest.json: the late, older write leaves it (and the KV
    key) at the newer bundle; its own files are complete all the same."""
    js = nc.jetstream()
    await ensure_job(js, "old", 2)
    vol = tmp_path / "vol"
    newer = await bundles.write(js, "old", 6, blobs(6), {"epoch": 6}, directory=vol)
    await bundles.write(js, "old", 5, blobs(5), {"epoch": 5}, directory=vol)  # late
    assert await bundles.latest(js, "old") == newer
    assert bundles.read_directory(vol) == newer
    assert bundles.read_directory(vol / "v5").version == 5
    # the pointer itself never goes back (an older commit whose pointer lands last)
    bundles._point_latest(vol, bundles.read_directory(vol / "v5"))
    assert bundles.read_directory(vol).version == 6
    # but a new job writing into the same directory takes it over from its first bundle
    await ensure_job(js, "new", 2)
    first = await bundles.write(js, "new", 1, blobs(1), {"epoch": 1}, directory=vol)
    assert bundles.read_directory(vol) == first
