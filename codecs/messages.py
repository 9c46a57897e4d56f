"""Domain messages: the frozen, slotted dataclasses the rest of ddpbus passes around.

Nothing here knows a wire format; :mod:`ddpbus.codecs.convert` maps each class to and from
its protobuf twin. Field meanings follow flodl's cluster DDP.
Integers that are unsigned on the wire (ranks, steps, offsets) must be in ``[0, 2**64)``;
the converter refuses anything else with :class:`~ddpbus.codecs.errors.EncodeError`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

_C = TypeVar("_C")

U64_MAX = 2**64 - 1
"""Reserved ``target_rank`` (controller-as-checkpointer/evaluator); refused on the wire."""

NCCL_ID_BYTES = 128
"""Length of a communicator session id (NCCL's unique id size)."""

MODEL_SIGNATURE_BYTES = 32


def _fast_init(cls: type[_C]) -> type[_C]:
    """Give a frozen, slotted dataclass an ``__init__`` that writes its slots directly.

    The generated frozen ``__init__`` goes through ``object.__setattr__`` once per field;
    calling each slot descriptor's ``__set__`` instead builds the same object in about half
    the time (0.71 vs 1.34 us for a 7-field message here), which matters for the messages
    decoded once per training batch. Signature, defaults and default factories are the
    dataclass's own; the instance is exactly what the dataclass ``__init__`` would build.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if not fields:
        return cls
    params: list[str] = []
    body: list[str] = []
    env: dict[str, Any] = {"_MISSING": dataclasses.MISSING}
    for f in fields:
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is not dataclasses.MISSING:
            env[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
            body.append(f"    _set_{f.name}(self, {f.name})")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f"    _set_{f.name}(self, _factory_{f.name}() if {f.name} is _MISSING "
                        f"else {f.name})")
        else:
            params.append(f.name)
            body.append(f"    _set_{f.name}(self, {f.name})")
    source = f"def __init__(self, *, {', '.join(params)}):\n" + "\n".join(body)
    namespace: dict[str, Any] = {}
    exec(source, env, namespace)  # noqa: S102 - source built above from field names only
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def positional_maker(cls: type[_C]) -> Callable[..., _C]:
    """A constructor taking every field positionally, in declaration order, no defaults.

    For decoders on the hottest paths only: it skips ``type.__call__`` and keyword matching
    (0.43 vs 0.75 us for ``Batch``) and builds exactly what ``cls(**fields)`` builds.
    """
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    env: dict[str, Any] = {f"_set_{n}": cls.__dict__[n].__set__ for n in names}
    env |= {"_new": object.__new__, "_cls": cls}
    source = (f"def make({', '.join(names)}):\n    self = _new(_cls)\n"
              + "".join(f"    _set_{n}(self, {n})\n" for n in names) + "    return self\n")
    namespace: dict[str, Any] = {}
    exec(source, env, namespace)  # noqa: S102 - source built above from field names only
    maker: Callable[..., _C] = namespace["make"]
    return maker



class SaveReason(enum.IntEnum):
    """Why ranks save and exit (flodl's wire byte values)."""

    GRACEFUL_SHUTDOWN = 0
    MAX_FAILURE_EXCEEDED = 1
    SINGLE_SURVIVOR = 2
    ALL_RANKS_LOST = 3
    REDUCE_STALL = 4
    CHECKPOINT = 5


class IntentKind(enum.Enum):
    EVAL_NOW = "eval_now"
    CHECKPOINT_NOW = "checkpoint_now"


class Policy(enum.Enum):
    """When a reduce fires: every step, on El Che's window, or on the window
    with bounded lookahead."""

    SYNC = "sync"
    CADENCE = "cadence"
    ASYNC = "async"


class Backend(enum.Enum):
    """How parameters are averaged. ``AUTO`` is resolved by each rank: NCCL with CUDA, else
    gloo."""

    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"
    BROKER = "broker"  # snapshots reduced off the training path, through the NATS broker


# --------------------------------------------------------------------- structures


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochPlan:
    """The slice ``[partition_offset, partition_offset + partition_size)`` of an epoch."""

    epoch: int
    partition_offset: int
    partition_size: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """Rank ``rank``'s plan inside a broadcast: as a StartEpoch{plan} of its own."""

    rank: int
    plan: EpochPlan


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ScalarSum:
    sum: float
    count: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceSample:
    cpu_percent: float
    ram_used_bytes: int
    ram_total_bytes: int
    gpu_util_percent: float | None = None
    vram_total_bytes: int | None = None
    vram_allocated_bytes: int | None = None


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsMsg:
    """One executed plan/chunk's metrics, rank -> coordinator."""

    rank: int
    epoch: int
    avg_loss: float
    batches_processed: int
    epoch_ms: float
    samples_processed: int
    share_complete_ms: float = 0.0
    compute_only_ms: float = 0.0
    data_starve_ms: float = 0.0
    scalars: Mapping[str, ScalarSum] = field(default_factory=dict)
    resources: ResourceSample | None = None


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochMetrics:
    """The coordinator's aggregate of one epoch (per-rank tuples indexed by rank)."""

    epoch: int
    avg_loss: float
    epoch_ms: float
    scalars: Mapping[str, float] = field(default_factory=dict)
    per_rank: tuple[Mapping[str, float], ...] = ()
    per_rank_throughput: tuple[float, ...] = ()
    per_rank_batch_share: tuple[float, ...] = ()
    per_rank_share_complete_ms: tuple[float, ...] = ()
    per_rank_compute_only_ms: tuple[float, ...] = ()
    per_rank_data_starve_ms: tuple[float, ...] = ()
    device_indices: tuple[int, ...] = ()  # CUDA index per rank, -1 for CPU
    per_rank_loss: tuple[float, ...] = ()  # empty when unknown
    per_rank_samples: tuple[int, ...] = ()


# ------------------------------------------------------------ timing: rank -> coord


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    rank: int
    batch_ms: float
    data_ms: float
    step_count: int
    param_norm: float | None = None
    batch_loss: float | None = None
    sync_divergence: float | None = None


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SyncAck:
    rank: int
    step_count: int
    divergence: float
    post_norm: float | None = None
    pre_norm: float | None = None
    failed: bool = False  # the collective failed: parameters stayed this rank's own
    # telemetry: the rank's wall clock when its agent took SyncNow in (Unix s), and its
    # milliseconds in the whole average and in the collective call alone
    received_at: float | None = None
    average_ms: float | None = None
    collective_ms: float | None = None


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Exiting:
    rank: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class LrUpdate:
    rank: int
    lr: float


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    rank: int
    step_count: int
    # what this incarnation refused so far, by reason: every refusal reaches the metrics
    rejections: Mapping[str, int] = field(default_factory=dict)
    # the rank's NATS connection, "<server id>/<client id>" as the broker's advisories name
    # it (see :data:`ddpbus.codecs.convert.CONNECTION`); "" where not known
    connection: str = ""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Intent:
    rank: int
    kind: IntentKind


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotReady:
    """Broker path: round ``version``'s contribution of ``rank`` is stored (mass 0: declared,
    nothing stored)."""

    rank: int
    version: int = 0
    mass: float = 0.0  # n^gamma, the factor the stored tensors were multiplied by
    step_count: int = 0  # the rank's local step at the snapshot
    digest: str = ""  # "SHA-256=<base64>" of the stored object
    nbytes: int = 0


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class NewNcclIdGenerated:
    rank: int
    uid_bytes: bytes  # NCCL_ID_BYTES long


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult:
    rank: int
    schedule_id: int
    epoch: int
    metric: float
    elapsed_ms: float
    error: str | None = None


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointResult:
    rank: int
    version: int
    elapsed_ms: float
    error: str | None = None


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochFnElapsed:
    rank: int
    epoch: int
    elapsed_ms: float


MAX_REPORT_ITEMS: Final = 256
"""A Reports carries at most this many items (a rank flushes at this count)."""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Reports:
    """Several consecutive per-batch reports of ``rank`` in one message, in the order the
    rank made them: what a rank sends instead of the single Batch / LrUpdate messages when
    its batches come faster than the run's report interval."""

    rank: int
    items: tuple[Batch | LrUpdate, ...]


def batches(msg: Message) -> tuple[Batch, ...]:
    """The Batch reports a message carries: itself, a Reports' Batch items, or none."""
    if isinstance(msg, Batch):
        return (msg,)
    if isinstance(msg, Reports):
        return tuple(x for x in msg.items if isinstance(x, Batch))
    return ()


TimingMsg = (
    Batch
    | SyncAck
    | Exiting
    | LrUpdate
    | Heartbeat
    | Intent
    | SnapshotReady
    | NewNcclIdGenerated
    | EvalResult
    | CheckpointResult
    | EpochFnElapsed
    | Reports
)


# ----------------------------------------------------------- control: coord -> rank


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RequestParams:
    """Broker-path reduce trigger: snapshot parameters for round ``version`` and ship them."""

    version: int = 0


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Update:
    """Broker-path average complete (tensors arrive on the data subjects)."""

    version: int
    next_plan: EpochPlan | None = None
    realized: bool = True  # False: nothing was averaged (no mass, or no snapshot arrived)
    accepted: tuple[int, ...] = ()  # ranks whose contribution is in the consensus
    digest: str = ""  # "SHA-256=<base64>" of the stored consensus (realized rounds only)


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SyncNow:
    """NCCL/gloo reduce trigger: average in place now, then SyncAck."""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StartEpoch:
    plan: EpochPlan


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ExtendPartition:
    partition_offset: int
    partition_size: int
    epoch: int = 0  # whose permutation the slice indexes


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareDead:
    rank: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class NewNcclSession:
    uid_bytes: bytes  # NCCL_ID_BYTES long
    new_rank: int
    new_world_size: int
    initial: bool = False  # the run's first session: start from new rank 0's parameters


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RequestNewNcclId:
    """Sent to the one survivor elected to mint a new communicator session id."""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    offset: int
    size: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    epoch: int
    spans: tuple[Span, ...] = ()


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StageAdvisory:
    counts: tuple[int, ...] = ()
    segments: tuple[Segment, ...] = ()


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Throttle:
    """Broker path: stop training until SyncNow, Update or Shutdown arrives."""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SetGlobalStep:
    """After every average (and when training starts): the LR schedule's global step, and
    the window it opens: ``step_budget[r]`` optimizer steps for rank r before the next
    SyncNow (empty: no limit), and the window's plans for every rank (each rank takes its
    own, in order, as if each were a StartEpoch of its own: one broadcast, not one
    message per rank)."""

    global_step: int
    step_budget: tuple[int, ...] = ()
    plans: tuple[RankPlan, ...] = ()


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    version: int
    target_rank: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ExecuteEvalCallback:
    schedule_id: int
    epoch: int
    target_rank: int
    adopt_consensus: bool = False


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SetEpochCallbackRole:
    rank: int


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown:
    """Leave the training loop; the last average has settled everywhere."""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ShutdownWithSave:
    reason: SaveReason


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochAggregated:
    metrics: EpochMetrics


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EvalBroadcast:
    epoch: int
    metric: float


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SaveConsensusModel:
    """Save the consensus model; with ``version`` > 0 also write resume bundle ``version``
    (parameters + optimizer) described by ``bundle_meta`` (the coordinator's meta, JSON)."""

    target_rank: int
    version: int = 0
    bundle_meta: str = ""


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class CoordHeartbeat:
    """Coordinator liveness beacon; resets the worker's coordinator deadline."""


ControlMsg = (
    RequestParams
    | Update
    | SyncNow
    | StartEpoch
    | ExtendPartition
    | DeclareDead
    | NewNcclSession
    | RequestNewNcclId
    | StageAdvisory
    | Throttle
    | SetGlobalStep
    | Checkpoint
    | ExecuteEvalCallback
    | SetEpochCallbackRole
    | Shutdown
    | ShutdownWithSave
    | EpochAggregated
    | EvalBroadcast
    | SaveConsensusModel
    | CoordHeartbeat
)


# -------------------------------------------------------------------- membership


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """A rank's first announcement: who it is and what it runs."""

    rank: int
    generation: int
    host: str
    device: str
    model_signature: bytes  # MODEL_SIGNATURE_BYTES long
    world_size: int
    pid: int = 0
    backend: str = ""
    torch_version: str = ""
    dataset_size: int = 0


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Rejoin:
    """A restarted rank resuming from the stream (generation above its old incarnation's)."""

    hello: Hello
    resume_stream_seq: int
    checkpoint_version: int = 0


JoinMsg = Hello | Rejoin


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """The coordinator's resolved run settings; every rank adopts them on Accept."""

    policy: Policy
    backend: Backend
    batch_size: int
    epochs: int
    seed: int
    gamma: float
    lr_scale_ratio: float
    dataset_size: int
    param_norm_every: int = 10
    coordinator_timeout_s: float = 30.0
    progressive: bool = False
    collective_timeout_s: float = 0.0  # 0: torch.distributed's default
    easgd_alpha: float = 1.0  # broker backend: W += alpha * (consensus - snapshot)
    bf16_wire: bool = False  # broker backend: tensors travel as bfloat16
    report_interval_ms: float = 0.0  # coalesce Batch/LrUpdate reports (0: each alone)


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Accept:
    rank: int
    generation: int
    world_size: int
    coordinator_generation: int
    run: RunConfig


@_fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Reject:
    rank: int
    generation: int
    reason: str


AdmitMsg = Accept | Reject

Message = TimingMsg | ControlMsg | MetricsMsg | JoinMsg | AdmitMsg
"""Everything that travels as one envelope on a ddpbus subject (tensor frames aside)."""
