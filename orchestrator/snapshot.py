"""Write-ahead snapshots of the coordinator core, so a restarted coordinator resumes.

Rule: before the shell publishes any command, it stores a snapshot of the core's state
*after* the input that produced it, the stream sequence of that input, and every command
not yet stored in the stream (encoded, with its ``Nats-Msg-Id``). A coordinator that takes
over loads the snapshot, re-publishes those commands verbatim (JetStream drops the ones
that had made it, by message id, inside the duplicate window), and replays the stream
after the covered sequence through the same pure core. Inputs after the snapshot that led
to no command are simply decided again; inputs that led to a command are covered by the
snapshot written before it was published.

Format: ``MAGIC | HMAC-SHA256(job key, body) | body``, body = zlib(JSON). Nothing is ever
unpickled: the JSON is a tagged tree of plain values, standard containers, enums and
ddpbus classes (rebuilt field by field, never by calling code named in the data; any
other class is refused), with shared objects kept shared (an assignment sits in a rank's
queue, its history and its epoch's pool at once). The signature is checked first.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import hashlib
import hmac
import importlib
import json
import zlib
from datetime import timedelta
from typing import Any, Final

from ddpbus.codecs import Outbound
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.state import State

SNAPSHOT_KEY: Final = "coordinator.snapshot"
MAGIC: Final = b"DDPBUS-SNAP-2\n"


class SnapshotError(DdpbusError, ValueError):
    """A snapshot that is not ours, was altered, or does not load."""


@dataclasses.dataclass(slots=True)
class Snapshot:
    state: State
    stream_seq: int  # the last input covered by ``state``
    outbox: list[Outbound]  # commands decided and maybe not yet stored, in order
    coordinator_generation: int
    saved_at: float


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _fields(obj: object) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    names = list(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        names += [n for n in getattr(klass, "__slots__", ()) if n not in names
                  and not n.startswith("__") and hasattr(obj, n)]
    return names


class _Encoder:
    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.keep: list[object] = []  # ids stay valid while encoding

    def __call__(self, x: Any) -> Any:
        if x is None or isinstance(x, bool | str) or type(x) in (int, float):
            return x
        if isinstance(x, enum.Enum):
            return {"$e": _path(type(x)), "v": x.value}
        if isinstance(x, bytes):
            return {"$b": base64.b64encode(x).decode()}
        if isinstance(x, timedelta):
            return {"$td": x.total_seconds()}
        if isinstance(x, collections.Counter):
            return {"$C": [[self(k), v] for k, v in x.items()]}
        if isinstance(x, collections.deque):
            return {"$q": [self(v) for v in x], "max": x.maxlen}
        if isinstance(x, dict):
            return {"$d": [[self(k), self(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return [self(v) for v in x]
        if isinstance(x, tuple):
            return {"$t": [self(v) for v in x]}
        if isinstance(x, set | frozenset):
            return {"$s": [self(v) for v in x]}
        return self._object(x)

    def _object(self, x: object) -> Any:
        if not type(x).__module__.startswith("ddpbus."):
            raise SnapshotError(f"cannot snapshot a {type(x).__qualname__}")
        if id(x) in self.ids:
            return {"$ref": self.ids[id(x)]}
        self.ids[id(x)] = ref = len(self.ids)
        self.keep.append(x)
        return {"$o": _path(type(x)), "id": ref,
                "f": {n: self(getattr(x, n)) for n in _fields(x)}}


class _Decoder:
    def __init__(self) -> None:
        self.objects: dict[int, object] = {}
        self.builders: dict[str, Any] = {
            "$o": self._object,
            "$ref": lambda x: self.objects[int(x["$ref"])],
            "$e": _enum,
            "$b": lambda x: base64.b64decode(x["$b"]),
            "$td": lambda x: timedelta(seconds=float(x["$td"])),
            "$C": lambda x: collections.Counter({self(k): v for k, v in x["$C"]}),
            "$q": lambda x: collections.deque((self(v) for v in x["$q"]), maxlen=x["max"]),
            "$d": lambda x: {self(k): self(v) for k, v in x["$d"]},
            "$t": lambda x: tuple(self(v) for v in x["$t"]),
            "$s": lambda x: {self(v) for v in x["$s"]},
        }

    def __call__(self, x: Any) -> Any:
        if isinstance(x, list):
            return [self(v) for v in x]
        if not isinstance(x, dict):
            return x
        for tag, build in self.builders.items():
            if tag in x:
                return build(x)
        raise SnapshotError(f"unknown snapshot node {sorted(x)[:3]}")

    def _object(self, x: dict[str, Any]) -> object:
        cls = _class(x["$o"])
        obj: object = object.__new__(cls)  # never runs code the data names: fields are set below
        self.objects[int(x["id"])] = obj
        for name, value in x["f"].items():
            object.__setattr__(obj, name, self(value))
        return obj


def _enum(x: dict[str, Any]) -> enum.Enum:
    cls = _class(x["$e"])
    if not issubclass(cls, enum.Enum):
        raise SnapshotError(f"{x['$e']} is not an enum")
    return cls(x["v"])


def _class(path: str) -> type:
    module, _, qualname = str(path).partition(":")
    if not module.startswith("ddpbus.") or not qualname:
        raise SnapshotError(f"snapshot refers to {path}, which it may not")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not isinstance(target, type):
        raise SnapshotError(f"snapshot refers to {path}, which is not a ddpbus class")
    return target


def encode(snap: Snapshot, key: bytes) -> bytes:
    text = json.dumps(_Encoder()(snap), separators=(",", ":"))
    body = zlib.compress(text.encode(), 3)
    return MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def decode(data: bytes, key: bytes) -> Snapshot:
    if not data.startswith(MAGIC):
        raise SnapshotError("not a ddpbus coordinator snapshot (or an older format)")
    tag, body = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        raise SnapshotError("snapshot signature does not match the job key")
    try:
        snap = _Decoder()(json.loads(zlib.decompress(body)))
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"snapshot does not load: {exc}") from exc
    if not isinstance(snap, Snapshot):
        raise SnapshotError("snapshot holds something else")
    return snap
