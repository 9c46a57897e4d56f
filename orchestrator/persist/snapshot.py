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
unpickled: the JSON is ``{"classes": [[path, [field, ...]], ...], "root": tree}``, a tagged
tree of plain values, standard containers, enums and ddpbus objects (``{"$o": class index,
"v": [values in the class's field order]}``, rebuilt field by field, never by calling code
named in the data; any other class is refused), with shared objects kept shared (an
assignment sits in a rank's queue, its history and its epoch's pool at once; an object's
id is the order it is first met in). The signature is checked first. One is written before
every batch of commands, so its cost is per rank: the class table keeps field names out of
the per-object nodes (``DDPBUS-SNAP-2`` kept them inline, and is still read).
"""

from __future__ import annotations

import asyncio
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
from ddpbus.orchestrator.core.state import State

MAGIC: Final = b"DDPBUS-SNAP-3\n"
OLDER: Final = (b"DDPBUS-SNAP-2\n",)  # still read: a coordinator upgraded mid-job resumes


class SnapshotError(DdpbusError, ValueError):
    """A snapshot that is not ours, was altered, or does not load."""


@dataclasses.dataclass(slots=True)
class Snapshot:
    state: State
    stream_seq: int  # the last input covered by ``state``
    outbox: list[Outbound]  # commands decided and maybe not yet stored, in order
    coordinator_generation: int
    saved_at: float
    journal: str = ""  # the journal base its segments extend (journal.py); "" for none


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_FIELDS: dict[type, tuple[str, ...]] = {}  # a slotted class's fields, worked out once
_PLAIN: Final = frozenset({int, float, str, bool, type(None)})  # stored as they are


def _fields(obj: object) -> tuple[str, ...]:
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is not None:
        return names
    if dataclasses.is_dataclass(obj):
        found = [f.name for f in dataclasses.fields(obj)]
    else:
        found = list(getattr(obj, "__dict__", {}))
        for klass in cls.__mro__:
            found += [n for n in getattr(klass, "__slots__", ()) if n not in found
                      and not n.startswith("__") and hasattr(obj, n)]
    if not hasattr(obj, "__dict__") and dataclasses.is_dataclass(obj):
        _FIELDS[cls] = tuple(found)  # a slotted dataclass: every instance has these fields
    return tuple(found)


class _Encoder:
    """The state as a tree of JSON values. The hot path (a few dozen nodes per rank, on
    every write-ahead snapshot) dispatches on the exact type and stores plain values inline."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.keep: list[object] = []  # ids stay valid while encoding
        self.classes: dict[type, tuple[int, tuple[str, ...]]] = {}  # fixed-field classes
        self.table: list[list[Any]] = []  # [path, [field, ...]] per class
        self.exact: dict[type, Any] = {  # the containers, by exact type
            list: lambda x: [v if type(v) in _PLAIN else self(v) for v in x],
            dict: lambda x: {"$d": [[self(k), self(v)] for k, v in x.items()]},
            collections.deque: lambda x: {"$q": [self(v) for v in x], "max": x.maxlen},
            collections.Counter: lambda x: {"$C": [[self(k), v] for k, v in x.items()]},
            tuple: lambda x: {"$t": [self(v) for v in x]},
        }

    def __call__(self, x: Any) -> Any:
        t = type(x)
        if t in _PLAIN:
            return x
        exact = self.exact.get(t)
        if exact is not None:
            return exact(x)
        return self._other(x)

    def _other(self, x: Any) -> Any:
        """Enums, bytes, times, sets, subclasses of the containers, and ddpbus objects: the
        first of each type works out its encoder, which the exact table keeps from then on
        (a snapshot meets the same few types thousands of times)."""
        t = type(x)
        how = self._how(t)
        self.exact[t] = how
        return how(x)

    def _how(self, t: type) -> Any:
        if issubclass(t, enum.Enum):
            path = _path(t)
            return lambda x: {"$e": path, "v": x.value}
        if issubclass(t, bool | str | int | float):
            return lambda x: x
        if issubclass(t, bytes):
            return lambda x: {"$b": base64.b64encode(x).decode()}
        if issubclass(t, timedelta):
            return lambda x: {"$td": x.total_seconds()}
        if issubclass(t, set | frozenset):
            # plain members inline, as in a list (a rank's unseen message ids: up to 256
            # a rank, a quarter of a million sets' members at 1,024 ranks)
            return lambda x: {"$s": [v if type(v) in _PLAIN else self(v) for v in x]}
        for klass in t.__mro__[1:]:  # a container subclass: as its base
            base = self.exact.get(klass)
            if base is not None:
                return base
        if not t.__module__.startswith("ddpbus."):
            raise SnapshotError(f"cannot snapshot a {t.__qualname__}")
        return self._object

    def _object(self, x: object) -> Any:
        if id(x) in self.ids:
            return {"$ref": self.ids[id(x)]}
        self.ids[id(x)] = len(self.ids)  # ids follow the order objects are met in
        self.keep.append(x)
        cls = type(x)
        fixed = self.classes.get(cls)  # a slotted dataclass: its index, once per snapshot
        if fixed is not None:
            index, names = fixed
        else:
            names = _fields(x)
            row = [_path(cls), list(names)]
            found = next((i for i, known in enumerate(self.table) if known == row), None)
            if found is None:
                found = len(self.table)
                self.table.append(row)
            index = found
            if cls in _FIELDS:  # every instance has these fields
                self.classes[cls] = (index, names)
        plain = _PLAIN
        return {"$o": index, "v": [v if type(v) in plain else self(v)
                                  for v in map(x.__getattribute__, names)]}

    def document(self, root: Any) -> dict[str, Any]:
        tree = self(root)
        return {"classes": self.table, "root": tree}


class _Decoder:
    def __init__(self, table: Any = None) -> None:
        self.objects: dict[int, object] = {}
        self.table: list[tuple[type, list[str]]] = []
        if table is not None:
            if not isinstance(table, list):
                raise SnapshotError("snapshot class table is not a list")
            for row in table:
                if (not isinstance(row, list) or len(row) != 2 or not isinstance(row[1], list)
                        or not all(isinstance(n, str) for n in row[1])):
                    raise SnapshotError("malformed snapshot class table")
                self.table.append((_class(row[0]), row[1]))
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
            "$s": lambda x: {v if type(v) in _PLAIN else self(v) for v in x["$s"]},
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
        index = x["$o"]
        if isinstance(index, str):  # DDPBUS-SNAP-2: the path and the field names inline
            obj: object = object.__new__(_class(index))  # never runs code the data names
            self.objects[int(x["id"])] = obj
            for name, value in x["f"].items():
                object.__setattr__(obj, name, self(value))
            _fill_defaults(obj, list(x["f"]))
            return obj
        if type(index) is not int or not 0 <= index < len(self.table):
            raise SnapshotError(f"snapshot object of unknown class {index!r}")
        cls, names = self.table[index]
        values = x["v"]
        if not isinstance(values, list) or len(values) != len(names):
            raise SnapshotError(f"snapshot {cls.__qualname__} has {len(values)} values for "
                                f"{len(names)} fields")
        obj = object.__new__(cls)  # fields are set below: no constructor runs
        self.objects[len(self.objects)] = obj
        for name, value in zip(names, values, strict=True):
            object.__setattr__(obj, name, self(value))
        _fill_defaults(obj, names)
        return obj


_MISSING: dict[tuple[type, tuple[str, ...]], list[dataclasses.Field[Any]]] = {}


def _fill_defaults(obj: object, names: list[str]) -> None:
    """A field the snapshot does not name (written by an older ddpbus, before the field
    existed) takes its declared default; a field without one stays a load error."""
    cls = type(obj)
    if not dataclasses.is_dataclass(cls):
        return
    key = (cls, tuple(names))
    missing = _MISSING.get(key)
    if missing is None:
        missing = [f for f in dataclasses.fields(cls) if f.name not in names]
        for f in missing:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SnapshotError(f"snapshot {cls.__qualname__} lacks field {f.name}")
        _MISSING[key] = missing
    for f in missing:
        factory: Any = f.default_factory
        value = f.default if f.default is not dataclasses.MISSING else factory()
        object.__setattr__(obj, f.name, value)


def _enum(x: dict[str, Any]) -> enum.Enum:
    cls = _class(x["$e"])
    if not issubclass(cls, enum.Enum):
        raise SnapshotError(f"{x['$e']} is not an enum")
    return cls(x["v"])


# the modules a snapshot or journal segment written before the layered layout
# (orchestrator/core/, persist/, ...) names for its classes: a coordinator upgraded
# mid-job still resumes from it
MOVED: Final = {
    "ddpbus.orchestrator.aggregate": "ddpbus.orchestrator.core.aggregate",
    "ddpbus.orchestrator.callbacks": "ddpbus.orchestrator.core.duties",
    "ddpbus.orchestrator.collector": "ddpbus.orchestrator.core.gc_policy",
    "ddpbus.orchestrator.config": "ddpbus.orchestrator.core.config",
    "ddpbus.orchestrator.core": "ddpbus.orchestrator.core.transition",
    "ddpbus.orchestrator.elche": "ddpbus.orchestrator.core.elche",
    "ddpbus.orchestrator.guard": "ddpbus.orchestrator.core.guard",
    "ddpbus.orchestrator.membership": "ddpbus.orchestrator.core.membership",
    "ddpbus.orchestrator.pools": "ddpbus.orchestrator.core.pools",
    "ddpbus.orchestrator.recovery": "ddpbus.orchestrator.core.recovery",
    "ddpbus.orchestrator.rounds": "ddpbus.orchestrator.core.rounds",
    "ddpbus.orchestrator.session": "ddpbus.orchestrator.core.session",
    "ddpbus.orchestrator.settle": "ddpbus.orchestrator.core.settle",
    "ddpbus.orchestrator.state": "ddpbus.orchestrator.core.state",
    "ddpbus.orchestrator.window": "ddpbus.orchestrator.core.window",
    "ddpbus.orchestrator.reports": "ddpbus.orchestrator.core.coalesce",
    "ddpbus.orchestrator.resume": "ddpbus.orchestrator.core.bundle_meta",
    "ddpbus.orchestrator.summary": "ddpbus.orchestrator.core.summary",
    "ddpbus.orchestrator.bus": "ddpbus.orchestrator.transport.bus",
    "ddpbus.orchestrator.auth": "ddpbus.orchestrator.transport.auth",
    "ddpbus.orchestrator.snapshot": "ddpbus.orchestrator.persist.snapshot",
    "ddpbus.orchestrator.journal": "ddpbus.orchestrator.persist.journal",
    "ddpbus.orchestrator.lease": "ddpbus.orchestrator.persist.lease",
    "ddpbus.orchestrator.bundles": "ddpbus.orchestrator.persist.bundles",
    "ddpbus.orchestrator.broker": "ddpbus.orchestrator.runtime.nats_server",
    "ddpbus.orchestrator.children": "ddpbus.orchestrator.runtime.children",
    "ddpbus.orchestrator.provision": "ddpbus.orchestrator.runtime.provision",
    "ddpbus.orchestrator.reducer": "ddpbus.orchestrator.runtime.broker_reducer",
    "ddpbus.orchestrator.service": "ddpbus.orchestrator.runtime.coordinator",
    "ddpbus.orchestrator.retention": "ddpbus.orchestrator.runtime.retention",
    "ddpbus.orchestrator.metrics": "ddpbus.orchestrator.runtime.metrics",
    "ddpbus.orchestrator.tasks": "ddpbus.orchestrator.runtime.tasks",
    "ddpbus.orchestrator.report": "ddpbus.orchestrator.runtime.html_report",
    "ddpbus.orchestrator.cli": "ddpbus.orchestrator.tools.cli",
    "ddpbus.orchestrator.commands": "ddpbus.orchestrator.tools.commands",
    "ddpbus.orchestrator.launcher": "ddpbus.orchestrator.tools.local_run",
    "ddpbus.orchestrator.watch": "ddpbus.orchestrator.tools.sub",
    "ddpbus.orchestrator.status": "ddpbus.orchestrator.tools.status",
    "ddpbus.orchestrator.replay": "ddpbus.orchestrator.tools.replay",
    "ddpbus.orchestrator.simulate": "ddpbus.orchestrator.tools.simulate",
    "ddpbus.orchestrator.teardown": "ddpbus.orchestrator.tools.delete_job",
    "ddpbus.orchestrator.progress": "ddpbus.orchestrator.tools.progress",
}


def _class(path: str) -> type:
    module, _, qualname = str(path).partition(":")
    module = MOVED.get(module, module)
    if not module.startswith("ddpbus.") or not qualname:
        raise SnapshotError(f"snapshot refers to {path}, which it may not")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not isinstance(target, type):
        raise SnapshotError(f"snapshot refers to {path}, which is not a ddpbus class")
    return target


def encode(snap: Snapshot, key: bytes) -> bytes:
    return seal(MAGIC, document(snap), key)


async def encode_in_thread(snap: Snapshot, key: bytes) -> bytes:
    """:func:`encode`, its sealing beside the event loop (:func:`seal_in_thread`)."""
    return await seal_in_thread(MAGIC, document(snap), key)


def document(snap: Snapshot) -> bytes:
    """The part of :func:`encode` that reads the state (its JSON text): done while the
    state is the one to record; :func:`seal` (compression and signature, which need no
    interpreter lock) may then run off the event loop (:func:`seal_in_thread`)."""
    return json_text(tree(snap))


def tree(obj: object) -> dict[str, Any]:
    """``obj`` as a JSON-able document of this format (for records that embed a few
    ddpbus objects among plain values, such as a journal segment's rare events)."""
    return _Encoder().document(obj)


def untree(doc: Any, magic: bytes = MAGIC) -> object:
    """What :func:`tree` made (or an older format's tree, by its ``magic``); anything
    else is a :class:`SnapshotError`."""
    try:
        return _load(magic, doc)
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"snapshot does not load: {exc}") from exc


def sign(magic: bytes, doc: Any, key: bytes, *, level: int = 3) -> bytes:
    """``magic | HMAC-SHA256(key, body) | body``, body = zlib(JSON of ``doc``)."""
    return seal(magic, json_text(doc), key, level=level)


def json_text(doc: Any) -> bytes:
    """The compact JSON that snapshots and journal segments seal."""
    return json.dumps(doc, separators=(",", ":")).encode()


def seal(magic: bytes, text: bytes, key: bytes, *, level: int = 3) -> bytes:
    """:func:`sign` of a document already in JSON ``text`` (zlib and the HMAC release the
    interpreter lock: a thread does this beside the event loop)."""
    body = zlib.compress(text, level)
    return magic + hmac.new(key, body, hashlib.sha256).digest() + body


# below this many bytes of JSON, sealing on the loop costs less than the hand-off to a
# thread and back: a window's journal segment (~2 KB) seals in ~60 us, and sealing it
# inline cut the SyncNow's write-ahead time by ~0.2 ms (median 0.92 against 1.13 ms, 4
# interleaved runs each of bench/specs/tiny.py); a full snapshot is far larger
INLINE_SEAL_BYTES: Final = 32 * 1024


async def seal_in_thread(magic: bytes, text: bytes, key: bytes, *, level: int = 3) -> bytes:
    """:func:`seal` beside the event loop: the coordinator's writes do the JSON while the
    state is the deciding one, and this part (zlib and the HMAC) in parallel with it; a
    small document is sealed at once instead (:data:`INLINE_SEAL_BYTES`)."""
    if len(text) < INLINE_SEAL_BYTES:
        return seal(magic, text, key, level=level)
    return await asyncio.to_thread(seal, magic, text, key, level=level)


def verify(magic: bytes, data: bytes, key: bytes, *, what: str = "snapshot") -> Any:
    """The JSON document :func:`sign` stored under ``magic``, signature checked first
    (``what`` names the record in an error)."""
    if not data.startswith(magic):
        raise SnapshotError(f"not a {magic.decode().strip()} record")
    tag, body = data[len(magic):len(magic) + 32], data[len(magic) + 32:]
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        raise SnapshotError(f"{what} signature does not match the job key")
    try:
        return json.loads(zlib.decompress(body))
    except Exception as exc:
        raise SnapshotError(f"{what} does not load: {exc}") from exc


def _load(magic: bytes, doc: Any) -> Any:
    if magic != MAGIC:
        return _Decoder()(doc)  # DDPBUS-SNAP-2: one tree
    if not isinstance(doc, dict) or set(doc) != {"classes", "root"}:
        raise SnapshotError("snapshot document is not {classes, root}")
    return _Decoder(doc["classes"])(doc["root"])


def decode(data: bytes, key: bytes) -> Snapshot:
    """What :func:`encode` stored: the signature is checked first; nothing is
    unpickled."""
    magic = next((x for x in (MAGIC, *OLDER) if data.startswith(x)), None)
    if magic is None:
        raise SnapshotError("not a ddpbus coordinator snapshot (or an older format)")
    snap = untree(verify(magic, data, key), magic)
    if not isinstance(snap, Snapshot):
        raise SnapshotError("snapshot holds something else")
    return snap
