"""The coordinator core's vocabulary: its events, its commands and its state.

The core (:mod:`.core`) is ``transition(state, event, now) -> (state, commands)``: events are
decoded messages and timer ticks, commands are messages to publish and records of decisions.
The state is plain data owned by the core; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Final

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.config import Schedule
from ddpbus.orchestrator.core.elche import ElChe, GuardVerdict
from ddpbus.orchestrator.core.guard import TrendGuard
from ddpbus.orchestrator.core.meta import MetaController
from ddpbus.orchestrator.core.pools import Assignment, Pool

# ------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Joined:
    """A rank's JoinMsg (join.rank.N)."""

    msg: m.Hello | m.Rejoin
    msg_id: str = ""  # its Nats-Msg-Id when it came from the stream (deduplicated)


@dataclass(frozen=True, slots=True)
class Timing:
    """A rank's TimingMsg (timing.rank.N, or a Heartbeat from live.rank.N)."""

    msg: m.TimingMsg
    msg_id: str = ""  # its Nats-Msg-Id when it came from the stream (deduplicated)


@dataclass(frozen=True, slots=True)
class Metrics:
    msg: m.MetricsMsg
    msg_id: str = ""  # its Nats-Msg-Id when it came from the stream (deduplicated)


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed (the shell ticks every ~100 ms): timeouts are checked here."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The operator asked the coordinator to stop (SIGTERM/SIGINT): drain gracefully."""

    reason: str = "stopped by signal"


@dataclass(frozen=True, slots=True)
class BusRestored:
    """The coordinator's NATS connection is back after ``away_s`` seconds without it (a
    broker restart): nothing could be heard meanwhile, so silence is no evidence of death."""

    away_s: float


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The broker said a client connection closed (its ``$SYS`` DISCONNECT advisory):
    ``connection`` as ranks name their own in their heartbeats (``<server id>/<client
    id>``), with the broker's ``reason`` ("Client Closed", "Read Error", ...)."""

    connection: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reconnected:
    """A connection named as rank ``rank``'s are (``ddpbus-<job>-rank-<N>``:
    :func:`ddpbus.codecs.subjects.rank_connection_name`) opened (the CONNECT advisory): a
    rank whose connection closed is back, or a restarted incarnation is on its way (its
    Rejoin retires the old one). A name proves nothing, so this can only keep a rank
    alive until its heartbeats judge it, never declare one dead."""

    rank: int


@dataclass(frozen=True, slots=True)
class Reduced:
    """The shell's reducer finished broker round ``version``: the consensus is stored
    (``ok``), or it could not be built (``detail`` says why)."""

    version: int
    ok: bool
    detail: str = ""
    digest: str = ""  # the stored consensus object's "SHA-256=" digest (ok only)


Event = (Joined | Timing | Metrics | Tick | Stop | BusRestored | Reduced | Disconnected
         | Reconnected)


def event_of(body: m.Message, msg_id: str = "") -> Event:
    """The event a decoded message read by the coordinator becomes (``msg_id``: its
    Nats-Msg-Id, for a stream message)."""
    if isinstance(body, m.MetricsMsg):
        return Metrics(body, msg_id)
    if isinstance(body, m.Hello | m.Rejoin):
        return Joined(body, msg_id)
    return Timing(body, msg_id)  # type: ignore[arg-type]  # the core refuses a misfiled one

# ----------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class Send:
    """Publish a control message to one rank (``rank``) or to every rank (``None``)."""

    msg: m.ControlMsg
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class Admit:
    """Publish an Accept or Reject on the rank's admit subject."""

    msg: m.Accept | m.Reject


@dataclass(frozen=True, slots=True)
class Record:
    """A decision worth a line in the machine-readable event log."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refuse:
    """An input that changed nothing, with the reason (counted and logged by the shell)."""

    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: the shell publishes nothing more and exits."""

    ok: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Contribution:
    """One rank's stored snapshot for a broker round (from its SnapshotReady)."""

    rank: int
    mass: float
    step: int
    digest: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """Sum exactly these contributions of round ``version``, divide once by their summed
    mass (parameters) and mover count (buffers), store the consensus, then report
    :class:`Reduced`. Done by the shell's reducer, off the decision loop."""

    version: int
    contributions: tuple[Contribution, ...]
    bf16: bool = False


Command = Send | Admit | Record | Refuse | Finish | Reduce

# -------------------------------------------------------------------------- state


class Phase(enum.Enum):
    ADMITTING = "admitting"  # waiting for every rank's Hello
    FORMING = "forming"  # communicator session being minted
    TRAINING = "training"
    FINISHING = "finishing"  # last average / callbacks settling, then Shutdown
    DRAINING = "draining"  # Shutdown(WithSave) sent, waiting for Exiting
    DONE = "done"


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """Where a resumed run starts: the meta record of the bundle it loads (see
    :mod:`ddpbus.orchestrator.core.bundle_meta`)."""

    source: str  # the bundle, as a person would name it
    version: int
    epoch: int  # the first epoch to train (every earlier one is in the parameters)
    global_step: int
    rounds: int
    world_size: int
    dataset_size: int
    elche: dict[str, Any]
    divergence_history: tuple[float, ...]
    coverage: tuple[dict[str, Any], ...]  # the ledger of every epoch before ``epoch``
    eval_history: tuple[tuple[int, float], ...]


@dataclass(frozen=True, kw_only=True)
class CoreConfig:
    schedule: Schedule
    world_size: int
    has_eval: bool = False
    has_checkpoint_fn: bool = False
    has_epoch_fn: bool = False
    coordinator_generation: int = 1
    formation_timeout_s: float = 300.0
    exit_timeout_s: float = 30.0
    rendezvous_timeout_s: float = 5.0  # per id-generator candidate (D.3)
    resume: ResumePoint | None = None  # a run continued from a bundle


@dataclass(slots=True)
class RankState:
    rank: int
    hello: m.Hello | None = None
    alive: bool = False  # admitted, not dead, not exited
    exited: bool = False
    dead: bool = False
    death: str = ""  # why it was declared dead
    fresh: bool = False  # rejoined: no work until an average gave it the consensus
    last_heard: float = 0.0
    # its NATS connection as its heartbeats name it, and since when the broker has said
    # that connection closed (None: not closed), with the broker's reason
    connection: str = ""
    unplugged_at: float | None = None
    unplugged_why: str = ""
    step: int = 0  # the rank's last reported local step
    window_start: int = 0  # the rank's local step when the open window began
    lr: float | None = None
    last_loss: float | None = None
    queue: deque[Assignment] = field(default_factory=deque)  # dispatched, in order
    # every assignment not yet wholly in the consensus, in training order; the first one
    # starts at local step ``history_base``. ``sealed``: the local step up to which this
    # rank's batches are in a completed average (what a death cannot take away)
    history: deque[Assignment] = field(default_factory=deque)
    history_base: int = 0
    sealed: int = 0
    batches_total: int = 0
    # the open window
    steps: int = 0
    compute_ms: float = 0.0
    delivered_ms: float = 0.0
    delivered_batches: int = 0
    fill_ms: float | None = None
    # the open window's reports while the last average is not acknowledged: (the local
    # step reported, batch_ms, data_ms). The ack says which of them were trained before
    # the collective (carried back to it), and the window's timing is rebuilt without them
    unacked_reports: list[tuple[int, float, float]] = field(default_factory=list)
    target: int = 0  # steps that satisfy the gate this window
    budget: int = 0  # steps the rank may take this window
    # the last average
    acked: bool = True
    sync_step: int = 0  # last reported step when SyncNow went out
    throttled: bool = False  # told to wait for the next average (broker backend, C.6)
    divergence: float | None = None
    pre_norm: float | None = None
    post_norm: float | None = None
    callback_ms: dict[str, float] = field(default_factory=dict)  # EWMA per callback kind

    def give(self, a: Assignment) -> None:
        self.queue.append(a)
        self.history.append(a)

    def seal(self, step: int) -> None:
        """This rank's batches up to local step ``step`` are in a completed average."""
        self.sealed = max(self.sealed, step)
        while self.history and self.history_base + self.history[0].size <= self.sealed:
            self.history_base += self.history.popleft().size

    def in_flight(self) -> int:
        return sum(a.remaining for a in self.queue)


ID_HOLES: Final = 256  # unseen lower sequences remembered per sender incarnation
ID_LOOKBACK: Final = 16  # ... at first sight: the ones just before may still come


@dataclass(slots=True)
class IdWindow:
    """The stream message ids seen from one sender incarnation (``<sender>.g<generation>.
    <seq>``): the highest sequence and the lower ones not seen yet (at most ``ID_HOLES``,
    the most recent). A sequence at or below ``high`` that is not a hole was seen: a
    duplicate. Its size is bounded however long the sender lives."""

    generation: int
    high: int = 0
    holes: set[int] = field(default_factory=set)

    @classmethod
    def first_seen(cls, generation: int, seq: int) -> IdWindow:
        """The window of an incarnation whose first message seen is ``seq`` (the
        :data:`ID_LOOKBACK` before it may be on their way, re-sent out of order)."""
        return cls(generation=generation, high=seq,
                   holes=set(range(max(1, seq - ID_LOOKBACK), seq)))

    def admit(self, seq: int) -> bool:
        """Whether ``seq`` is new (and remember it); False for one seen before."""
        if seq > self.high:
            self.holes.update(range(max(self.high + 1, seq - ID_HOLES), seq))
            self.high = seq
            while len(self.holes) > ID_HOLES:
                self.holes.remove(min(self.holes))
            return True
        if seq in self.holes:
            self.holes.remove(seq)
            return True
        return False


@dataclass(slots=True)
class Rendezvous:
    """A communicator session being minted (RequestNewNcclId -> NewNcclIdGenerated)."""

    generator: int
    members: tuple[int, ...]
    deadline: float
    tried: set[int] = field(default_factory=set)


@dataclass(slots=True)
class BrokerRound:
    """A broker-path average in flight: RequestParams went out;
    snapshots arrive (``ready``) until every alive member's is in or the deadline passes;
    then the reducer runs (``reducing``: no more snapshots are taken) over the ``ready``
    ones, which are the round's accepted contributions; its Reduced becomes
    the Update, whose SyncAcks settle the round like any other."""

    version: int
    members: tuple[int, ...]
    deadline: float
    ready: dict[int, Contribution] = field(default_factory=dict)
    reducing: bool = False
    plans: dict[int, m.EpochPlan] = field(default_factory=dict)  # folded into the Update


@dataclass(slots=True)
class Roles:
    epoch_fn: int = 0
    eval: int = 0
    checkpoint: int = 0
    by_speed: bool = False  # elected from measured speeds (sticky from then on)
    announced: int | None = None  # epoch_fn role the ranks were last told


@dataclass(slots=True)
class PendingCheckpoint:
    version: int
    target: int
    tried: set[int] = field(default_factory=set)


@dataclass(slots=True)
class State:
    config: CoreConfig
    ranks: list[RankState]
    elche: ElChe
    guard: TrendGuard
    created_at: float
    phase: Phase = Phase.ADMITTING
    model_signature: bytes | None = None
    dataset_size: int = 0
    total_batches: int = 0
    backend: m.Backend | None = None
    run: m.RunConfig | None = None
    rendezvous: Rendezvous | None = None
    sessions: int = 0
    deaths: int = 0
    rejoins: int = 0
    orphans: list[RankState] = field(default_factory=list)  # dead ranks whose lost work awaits
    # the settling of the round they may have been part of
    round_members: tuple[int, ...] = ()  # ranks in the latest SyncNow
    round_ok: bool | None = None  # None: no ack yet; True: some rank completed it
    round_moved: bool = False  # the latest round had mass (it realised a consensus)
    resync: bool = False  # a collective failed: average again even if nobody moved
    training_started_at: float | None = None
    first_batch_at: float | None = None
    settled_at: float | None = None  # when the latest average was acknowledged by all
    settled_round: int = 0
    finished_at: float | None = None
    pools: dict[int, Pool] = field(default_factory=dict)
    epoch: int = 0  # the epoch being dispatched
    next_aggregate: int = 0
    # every aggregated epoch, in order; only the latest keeps its per-rank columns (the
    # run's per-rank totals are summed below), so a long run at scale stays small
    aggregated: list[m.EpochMetrics] = field(default_factory=list)
    rank_compute_ms: list[float] = field(default_factory=list)  # summed over aggregated
    rank_busy_ms: list[float] = field(default_factory=list)  # epochs, per rank
    global_step: int = 0
    rounds: int = 0
    sync_sent_at: float | None = None
    reduce_ms: float = 0.0
    pending_verdict: GuardVerdict | None = None
    roles: Roles = field(default_factory=Roles)
    evals: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (epoch, rank)
    # epochs whose eval died with its rank mid-window: sent again right after the next
    # average (the heir's own parameters have moved on since the boundary's consensus)
    evals_due: list[int] = field(default_factory=list)
    next_schedule_id: int = 1
    checkpoints: dict[int, PendingCheckpoint] = field(default_factory=dict)
    intents: set[m.IntentKind] = field(default_factory=set)
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    drain_started_at: float | None = None
    outcome: tuple[bool, str] | None = None  # (ok, reason) once the end is decided
    refusals: Counter[str] = field(default_factory=Counter)
    seen_ids: dict[int, IdWindow] = field(default_factory=dict)  # rank -> its ids so far
    last_bundle: int = 0  # the latest resume bundle version asked for
    broker_round: BrokerRound | None = None  # the broker backend's average in flight
    snapshot_aborts: int = 0  # ranks whose snapshot missed a round's deadline
    gate_hint: int = 0  # the rank that last held the averaging gate shut (a search hint)
    meta: MetaController = field(default_factory=MetaController)  # may shrink the window
    advised_epoch: int = -1  # the latest epoch whose StageAdvisory went out
    ack_hint: int = 0  # the rank that last had not acknowledged an average (the same)

    @property
    def schedule(self) -> Schedule:
        return self.config.schedule

    @property
    def broker(self) -> bool:
        """Averaging through the broker (snapshots and a reducer), not collectives."""
        return self.backend is m.Backend.BROKER

    @property
    def alive(self) -> list[RankState]:
        return [r for r in self.ranks if r.alive]

    @property
    def members(self) -> set[int]:
        """Ranks that said Hello and are neither dead nor exited: admitted or being
        admitted. What they have not read of ``control.all`` stays (retention.py)."""
        return {r.rank for r in self.ranks if r.hello is not None and not r.dead
                and not r.exited}

    def rank(self, index: int) -> RankState | None:
        return self.ranks[index] if 0 <= index < len(self.ranks) else None
