"""Write-ahead snapshots of the coordinator core, so a restarted coordinator resumes.

Rule: before the shell publishes any command, it stores a snapshot of the core's state
*after* the input that produced it, the stream sequence of that input, and every command
not yet stored in the stream (encoded, with its ``Nats-Msg-Id``). A coordinator that takes
over loads the snapshot, re-publishes those commands verbatim (JetStream drops the ones
that had made it, by message id, inside the duplicate window), and replays the stream
after the covered sequence through the same pure core. Inputs after the snapshot that led
to no command are simply decided again; inputs that led to a command are covered by the
snapshot written before it was published.

Format: ``MAGIC | HMAC-SHA256(job key, body) | body``, body = zlib(pickle). The signature is
checked before anything is unpickled, and the unpickler only builds ddpbus classes and a
short list of standard containers, so a snapshot is as trustworthy as the job key.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import zlib
from dataclasses import dataclass
from typing import Any, Final

from ddpbus.codecs import Outbound
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.state import State

SNAPSHOT_KEY: Final = "coordinator.snapshot"
MAGIC: Final = b"DDPBUS-SNAP-1\n"

_ALLOWED: Final = {
    ("collections", "deque"), ("collections", "Counter"), ("collections", "OrderedDict"),
    ("datetime", "timedelta"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("builtins", "complex"), ("copyreg", "_reconstructor"),
    ("builtins", "object"), ("builtins", "getattr"),
}


class SnapshotError(DdpbusError, ValueError):
    """A snapshot that is not ours, was altered, or does not load."""


@dataclass(slots=True)
class Snapshot:
    state: State
    stream_seq: int  # the last input covered by ``state``
    outbox: list[Outbound]  # commands decided and maybe not yet stored, in order
    coordinator_generation: int
    saved_at: float


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("ddpbus.") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise SnapshotError(f"snapshot refers to {module}.{name}, which it may not")


def encode(snap: Snapshot, key: bytes) -> bytes:
    body = zlib.compress(pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL), 3)
    return MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def decode(data: bytes, key: bytes) -> Snapshot:
    if not data.startswith(MAGIC):
        raise SnapshotError("not a ddpbus coordinator snapshot")
    tag, body = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        raise SnapshotError("snapshot signature does not match the job key")
    try:
        snap = _Unpickler(io.BytesIO(zlib.decompress(body))).load()
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"snapshot does not load: {exc}") from exc
    if not isinstance(snap, Snapshot):
        raise SnapshotError("snapshot holds something else")
    return snap
