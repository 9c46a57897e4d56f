"""One home for every domain <-> wire conversion.

The domain messages (:mod:`ddpbus.codecs.messages`) travel inside processes; their protobuf
twins (``ddpbus.v1`` in ``proto/``) travel on NATS. Every variant has exactly one
``_x_to_wire`` and one ``_x_from_wire`` below and one row in :data:`VARIANTS`, so this file
is the one place to read the protocol and the one place to edit when a message changes.

Protocol rules kept from flodl:

- a ``target_rank`` of ``2**64 - 1`` is reserved (controller-as-checkpointer/evaluator) and
  refused loudly in both directions, never silently treated as "no rank";
- an unknown :class:`SaveReason` decodes as ``GRACEFUL_SHUTDOWN`` (the save still happens);
- ``Update`` and ``CoordHeartbeat`` are informational for the training loop:
  :func:`inner_dispatch` returns ``None`` for them (the param bridge and the liveness
  watchdog consume them before the loop).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf.message import Message as PbMessage

from ddpbus.codecs import messages as m
from ddpbus.codecs._pb import ddpbus_pb2 as pb
from ddpbus.codecs.errors import EncodeError, InvalidField, MalformedPayload

_T = pb.TimingMsg
_C = pb.ControlMsg
_J = pb.JoinMsg
_A = pb.AdmitMsg


def _opt(wire: Any, name: str) -> Any:
    return getattr(wire, name) if wire.HasField(name) else None


def _check_target(type_name: str, target_rank: int, *, encoding: bool) -> None:
    if target_rank == m.U64_MAX:
        text = (
            f"{type_name}: target_rank=2**64-1 is reserved for a controller-side executor "
            "that ddpbus v1 does not have; dispatch to a worker rank id"
        )
        raise EncodeError(text) if encoding else InvalidField(text, msg_type=type_name)


def _check_len(type_name: str, name: str, value: bytes, size: int, *, encoding: bool) -> None:
    if len(value) != size:
        text = f"{type_name}.{name} must be {size} bytes, got {len(value)}"
        raise EncodeError(text) if encoding else InvalidField(text, msg_type=type_name)


# ------------------------------------------------------------------ shared structures


def plan_to_wire(plan: m.EpochPlan) -> pb.EpochPlan:
    wire = pb.EpochPlan()
    fill_plan(wire, plan)
    return wire


def fill_plan(wire: pb.EpochPlan, plan: m.EpochPlan) -> None:
    """Set ``plan``'s fields on a wire plan that already exists (one inside a repeated
    field: building a message to copy in costs more, ~1 ms for a window's 1,024 plans)."""
    wire.epoch = plan.epoch
    wire.partition_offset = plan.partition_offset
    wire.partition_size = plan.partition_size
    wire.SetInParent()  # (present even when every field is at its default)


def plan_from_wire(w: pb.EpochPlan) -> m.EpochPlan:
    return m.EpochPlan(
        epoch=w.epoch, partition_offset=w.partition_offset, partition_size=w.partition_size
    )


def _resources_to_wire(r: m.ResourceSample) -> pb.ResourceSample:
    return pb.ResourceSample(
        cpu_percent=r.cpu_percent,
        ram_used_bytes=r.ram_used_bytes,
        ram_total_bytes=r.ram_total_bytes,
        gpu_util_percent=r.gpu_util_percent,
        vram_total_bytes=r.vram_total_bytes,
        vram_allocated_bytes=r.vram_allocated_bytes,
    )


def _resources_from_wire(w: pb.ResourceSample) -> m.ResourceSample:
    return m.ResourceSample(
        cpu_percent=w.cpu_percent,
        ram_used_bytes=w.ram_used_bytes,
        ram_total_bytes=w.ram_total_bytes,
        gpu_util_percent=_opt(w, "gpu_util_percent"),
        vram_total_bytes=_opt(w, "vram_total_bytes"),
        vram_allocated_bytes=_opt(w, "vram_allocated_bytes"),
    )


def metrics_to_wire(msg: m.MetricsMsg) -> pb.MetricsMsg:
    return pb.MetricsMsg(
        rank=msg.rank,
        epoch=msg.epoch,
        avg_loss=msg.avg_loss,
        batches_processed=msg.batches_processed,
        epoch_ms=msg.epoch_ms,
        samples_processed=msg.samples_processed,
        share_complete_ms=msg.share_complete_ms,
        compute_only_ms=msg.compute_only_ms,
        data_starve_ms=msg.data_starve_ms,
        scalars={k: pb.ScalarSum(sum=v.sum, count=v.count) for k, v in msg.scalars.items()},
        resources=None if msg.resources is None else _resources_to_wire(msg.resources),
    )


def metrics_from_wire(w: pb.MetricsMsg) -> m.MetricsMsg:
    return m.MetricsMsg(
        rank=w.rank,
        epoch=w.epoch,
        avg_loss=w.avg_loss,
        batches_processed=w.batches_processed,
        epoch_ms=w.epoch_ms,
        samples_processed=w.samples_processed,
        share_complete_ms=w.share_complete_ms,
        compute_only_ms=w.compute_only_ms,
        data_starve_ms=w.data_starve_ms,
        scalars={k: m.ScalarSum(sum=v.sum, count=v.count) for k, v in w.scalars.items()},
        resources=_resources_from_wire(w.resources) if w.HasField("resources") else None,
    )


def epoch_metrics_to_wire(e: m.EpochMetrics) -> pb.EpochMetrics:
    return pb.EpochMetrics(
        epoch=e.epoch,
        scalars=dict(e.scalars),
        per_rank=[pb.ScalarMap(values=dict(r)) for r in e.per_rank],
        avg_loss=e.avg_loss,
        epoch_ms=e.epoch_ms,
        per_rank_throughput=e.per_rank_throughput,
        per_rank_batch_share=e.per_rank_batch_share,
        per_rank_share_complete_ms=e.per_rank_share_complete_ms,
        per_rank_compute_only_ms=e.per_rank_compute_only_ms,
        per_rank_data_starve_ms=e.per_rank_data_starve_ms,
        device_indices=e.device_indices,
        per_rank_loss=e.per_rank_loss,
        per_rank_samples=e.per_rank_samples,
    )


def epoch_metrics_from_wire(w: pb.EpochMetrics) -> m.EpochMetrics:
    return m.EpochMetrics(
        epoch=w.epoch,
        scalars=dict(w.scalars),
        per_rank=tuple(dict(r.values) for r in w.per_rank),
        avg_loss=w.avg_loss,
        epoch_ms=w.epoch_ms,
        per_rank_throughput=tuple(w.per_rank_throughput),
        per_rank_batch_share=tuple(w.per_rank_batch_share),
        per_rank_share_complete_ms=tuple(w.per_rank_share_complete_ms),
        per_rank_compute_only_ms=tuple(w.per_rank_compute_only_ms),
        per_rank_data_starve_ms=tuple(w.per_rank_data_starve_ms),
        device_indices=tuple(w.device_indices),
        per_rank_loss=tuple(w.per_rank_loss),
        per_rank_samples=tuple(w.per_rank_samples),
    )


# --------------------------------------------------------------------------- timing


def _batch_to_wire(x: m.Batch) -> pb.TimingMsg:
    # The hottest message (one per training batch per rank): filled in place, which is
    # twice as fast as building the sub-message and copying it into the oneof.
    wire = _T()
    b = wire.batch
    b.SetInParent()  # selects the variant even when every field is a default
    b.rank = x.rank
    b.batch_ms = x.batch_ms
    b.data_ms = x.data_ms
    b.step_count = x.step_count
    if x.param_norm is not None:
        b.param_norm = x.param_norm
    if x.batch_loss is not None:
        b.batch_loss = x.batch_loss
    if x.sync_divergence is not None:
        b.sync_divergence = x.sync_divergence
    return wire


_make_batch = m.positional_maker(m.Batch)


def _batch_from_wire(w: Any) -> m.Batch:
    # positional, in Batch's field order: rank, batch_ms, data_ms, step_count, param_norm,
    # batch_loss, sync_divergence (one per training batch per rank: the hot path)
    has = w.HasField
    return _make_batch(
        w.rank,
        w.batch_ms,
        w.data_ms,
        w.step_count,
        w.param_norm if has("param_norm") else None,
        w.batch_loss if has("batch_loss") else None,
        w.sync_divergence if has("sync_divergence") else None,
    )


def _sync_ack_to_wire(x: m.SyncAck) -> pb.TimingMsg:
    return _T(
        sync_ack=_T.SyncAck(
            rank=x.rank,
            step_count=x.step_count,
            divergence=x.divergence,
            post_norm=x.post_norm,
            pre_norm=x.pre_norm,
            failed=x.failed,
            received_at=x.received_at,
            average_ms=x.average_ms,
            collective_ms=x.collective_ms,
        )
    )


_ACK_TIMES = ("received_at", "average_ms", "collective_ms")


def _sync_ack_from_wire(w: Any) -> m.SyncAck:
    times = [_opt(w, name) for name in _ACK_TIMES]
    for name, value in zip(_ACK_TIMES, times, strict=True):
        if value is not None and not 0.0 <= value < float("inf"):
            raise InvalidField(f"SyncAck.{name}={value}: must be finite and >= 0",
                               msg_type="SyncAck")
    received_at, average_ms, collective_ms = times
    return m.SyncAck(
        rank=w.rank,
        step_count=w.step_count,
        divergence=w.divergence,
        post_norm=_opt(w, "post_norm"),
        pre_norm=_opt(w, "pre_norm"),
        failed=w.failed,
        received_at=received_at,
        average_ms=average_ms,
        collective_ms=collective_ms,
    )


def _exiting_to_wire(x: m.Exiting) -> pb.TimingMsg:
    return _T(exiting=_T.Exiting(rank=x.rank))


def _exiting_from_wire(w: Any) -> m.Exiting:
    return m.Exiting(rank=w.rank)


def _lr_update_to_wire(x: m.LrUpdate) -> pb.TimingMsg:
    return _T(lr_update=_T.LrUpdate(rank=x.rank, lr=x.lr))


def _lr_update_from_wire(w: Any) -> m.LrUpdate:
    return m.LrUpdate(rank=w.rank, lr=w.lr)


def _reports_to_wire(x: m.Reports) -> pb.TimingMsg:
    _check_reports(x.rank, x.items, encoding=True)
    wire = _T()
    r = wire.reports
    r.rank = x.rank
    for item in x.items:
        slot = r.items.add()
        if isinstance(item, m.Batch):
            slot.batch.CopyFrom(_batch_to_wire(item).batch)
        else:
            slot.lr_update.rank, slot.lr_update.lr = item.rank, item.lr
    return wire


def _reports_from_wire(w: Any) -> m.Reports:
    items: list[m.Batch | m.LrUpdate] = []
    for slot in w.items:
        kind = slot.WhichOneof("variant")
        if kind == "batch":
            items.append(_batch_from_wire(slot.batch))
        elif kind == "lr_update":
            items.append(_lr_update_from_wire(slot.lr_update))
        else:
            raise InvalidField("Reports: an item holds no Batch or LrUpdate",
                               msg_type="TimingMsg.Reports")
    _check_reports(w.rank, items, encoding=False)
    return m.Reports(rank=w.rank, items=tuple(items))


def _check_reports(rank: int, items: Sequence[m.Batch | m.LrUpdate], *,
                   encoding: bool) -> None:
    """1..MAX_REPORT_ITEMS items, every one ``rank``'s, Batch step counts strictly rising."""
    problem = ""
    if not 1 <= len(items) <= m.MAX_REPORT_ITEMS:
        problem = f"{len(items)} items, expected 1 to {m.MAX_REPORT_ITEMS}"
    elif any(x.rank != rank for x in items):
        problem = f"an item of another rank than {rank}"
    else:
        steps = [x.step_count for x in items if isinstance(x, m.Batch)]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            problem = "Batch step counts do not strictly rise"
    if problem:
        text = f"TimingMsg.Reports: {problem}"
        raise EncodeError(text) if encoding else InvalidField(text, msg_type="TimingMsg.Reports")


MAX_REJECTION_REASONS = 64
_REASON = re.compile(r"[a-z][a-z0-9-]{0,39}")


#: A connection as the broker names it: its server's id (56 base32 characters in
#: nats-server 2.x) and the client id that server gave it.
CONNECTION: Final = re.compile(r"[A-Z0-9]{1,64}/[0-9]{1,20}")


def _heartbeat_to_wire(x: m.Heartbeat) -> pb.TimingMsg:
    return _T(heartbeat=_T.Heartbeat(rank=x.rank, step_count=x.step_count,
                                     rejections=dict(x.rejections), connection=x.connection))


def _heartbeat_from_wire(w: Any) -> m.Heartbeat:
    reasons = dict(w.rejections)
    if len(reasons) > MAX_REJECTION_REASONS or not all(map(_REASON.fullmatch, reasons)):
        raise InvalidField(f"Heartbeat.rejections: at most {MAX_REJECTION_REASONS} reasons, "
                           "each lower-case letters, digits and dashes",
                           msg_type="TimingMsg.Heartbeat")
    if w.connection and not CONNECTION.fullmatch(w.connection):
        raise InvalidField("Heartbeat.connection: '<server id>/<client id>' (upper-case "
                           "letters and digits, a slash, digits) or empty",
                           msg_type="TimingMsg.Heartbeat")
    return m.Heartbeat(rank=w.rank, step_count=w.step_count, rejections=reasons,
                       connection=w.connection)


_INTENT_TO_WIRE: Final = {
    m.IntentKind.EVAL_NOW: pb.INTENT_KIND_EVAL_NOW,
    m.IntentKind.CHECKPOINT_NOW: pb.INTENT_KIND_CHECKPOINT_NOW,
}
_INTENT_FROM_WIRE: Final = {v: k for k, v in _INTENT_TO_WIRE.items()}


def _intent_to_wire(x: m.Intent) -> pb.TimingMsg:
    return _T(intent=_T.Intent(rank=x.rank, kind=_INTENT_TO_WIRE[x.kind]))


def _intent_from_wire(w: Any) -> m.Intent:
    kind = _INTENT_FROM_WIRE.get(w.kind)
    if kind is None:
        raise InvalidField(f"Intent.kind={w.kind} is not a known intent", msg_type="Intent")
    return m.Intent(rank=w.rank, kind=kind)


def _snapshot_ready_to_wire(x: m.SnapshotReady) -> pb.TimingMsg:
    return _T(snapshot_ready=_T.SnapshotReady(
        rank=x.rank, version=x.version, mass=x.mass, step_count=x.step_count,
        digest=x.digest, nbytes=x.nbytes))


def _snapshot_ready_from_wire(w: Any) -> m.SnapshotReady:
    if not (0.0 <= w.mass < float("inf")) or (w.mass > 0) != bool(w.digest):
        raise InvalidField(f"SnapshotReady mass={w.mass} with digest={w.digest!r}: a positive "
                           "finite mass needs a stored object, mass 0 has none",
                           msg_type="SnapshotReady")
    return m.SnapshotReady(rank=w.rank, version=w.version, mass=w.mass,
                           step_count=w.step_count, digest=w.digest, nbytes=w.nbytes)


def _nccl_id_to_wire(x: m.NewNcclIdGenerated) -> pb.TimingMsg:
    _check_len("NewNcclIdGenerated", "uid_bytes", x.uid_bytes, m.NCCL_ID_BYTES, encoding=True)
    return _T(new_nccl_id_generated=_T.NewNcclIdGenerated(rank=x.rank, uid_bytes=x.uid_bytes))


def _nccl_id_from_wire(w: Any) -> m.NewNcclIdGenerated:
    _check_len("NewNcclIdGenerated", "uid_bytes", w.uid_bytes, m.NCCL_ID_BYTES, encoding=False)
    return m.NewNcclIdGenerated(rank=w.rank, uid_bytes=w.uid_bytes)


def _eval_result_to_wire(x: m.EvalResult) -> pb.TimingMsg:
    return _T(
        eval_result=_T.EvalResult(
            rank=x.rank,
            schedule_id=x.schedule_id,
            epoch=x.epoch,
            metric=x.metric,
            elapsed_ms=x.elapsed_ms,
            error=x.error,
        )
    )


def _eval_result_from_wire(w: Any) -> m.EvalResult:
    return m.EvalResult(
        rank=w.rank,
        schedule_id=w.schedule_id,
        epoch=w.epoch,
        metric=w.metric,
        elapsed_ms=w.elapsed_ms,
        error=_opt(w, "error"),
    )


def _checkpoint_result_to_wire(x: m.CheckpointResult) -> pb.TimingMsg:
    return _T(
        checkpoint_result=_T.CheckpointResult(
            rank=x.rank, version=x.version, elapsed_ms=x.elapsed_ms, error=x.error
        )
    )


def _checkpoint_result_from_wire(w: Any) -> m.CheckpointResult:
    return m.CheckpointResult(
        rank=w.rank, version=w.version, elapsed_ms=w.elapsed_ms, error=_opt(w, "error")
    )


def _epoch_fn_to_wire(x: m.EpochFnElapsed) -> pb.TimingMsg:
    return _T(
        epoch_fn_elapsed=_T.EpochFnElapsed(rank=x.rank, epoch=x.epoch, elapsed_ms=x.elapsed_ms)
    )


def _epoch_fn_from_wire(w: Any) -> m.EpochFnElapsed:
    return m.EpochFnElapsed(rank=w.rank, epoch=w.epoch, elapsed_ms=w.elapsed_ms)


# -------------------------------------------------------------------------- control


def _request_params_to_wire(x: m.RequestParams) -> pb.ControlMsg:
    return _C(request_params=_C.RequestParams(version=x.version))


def _request_params_from_wire(w: Any) -> m.RequestParams:
    return m.RequestParams(version=w.version)


def _update_to_wire(x: m.Update) -> pb.ControlMsg:
    plan = None if x.next_plan is None else plan_to_wire(x.next_plan)
    return _C(update=_C.Update(version=x.version, next_plan=plan, realized=x.realized,
                               accepted=x.accepted, digest=x.digest))


def _update_from_wire(w: Any) -> m.Update:
    plan = plan_from_wire(w.next_plan) if w.HasField("next_plan") else None
    if not w.realized and w.accepted:
        raise InvalidField("Update accepts contributions of a round it says was not realized",
                           msg_type="Update")
    if w.realized != bool(w.digest):
        raise InvalidField(f"Update realized={w.realized} with digest={w.digest!r}: a realized "
                           "round names its consensus object's digest, another none",
                           msg_type="Update")
    return m.Update(version=w.version, next_plan=plan, realized=w.realized,
                    accepted=tuple(w.accepted), digest=w.digest)


def _sync_now_to_wire(_: m.SyncNow) -> pb.ControlMsg:
    return _C(sync_now=_C.SyncNow())


def _sync_now_from_wire(_: Any) -> m.SyncNow:
    return m.SyncNow()


def _start_epoch_to_wire(x: m.StartEpoch) -> pb.ControlMsg:
    return _C(start_epoch=_C.StartEpoch(plan=plan_to_wire(x.plan)))


def _start_epoch_from_wire(w: Any) -> m.StartEpoch:
    if not w.HasField("plan"):
        raise InvalidField("StartEpoch.plan is required", msg_type="StartEpoch")
    return m.StartEpoch(plan=plan_from_wire(w.plan))


def _extend_to_wire(x: m.ExtendPartition) -> pb.ControlMsg:
    return _C(
        extend_partition=_C.ExtendPartition(
            partition_offset=x.partition_offset, partition_size=x.partition_size,
            epoch=x.epoch,
        )
    )


def _extend_from_wire(w: Any) -> m.ExtendPartition:
    return m.ExtendPartition(partition_offset=w.partition_offset,
                             partition_size=w.partition_size, epoch=w.epoch)


def _declare_dead_to_wire(x: m.DeclareDead) -> pb.ControlMsg:
    return _C(declare_dead=_C.DeclareDead(rank=x.rank))


def _declare_dead_from_wire(w: Any) -> m.DeclareDead:
    return m.DeclareDead(rank=w.rank)


def _new_session_to_wire(x: m.NewNcclSession) -> pb.ControlMsg:
    _check_len("NewNcclSession", "uid_bytes", x.uid_bytes, m.NCCL_ID_BYTES, encoding=True)
    return _C(
        new_nccl_session=_C.NewNcclSession(
            uid_bytes=x.uid_bytes, new_rank=x.new_rank, new_world_size=x.new_world_size,
            initial=x.initial,
        )
    )


def _new_session_from_wire(w: Any) -> m.NewNcclSession:
    _check_len("NewNcclSession", "uid_bytes", w.uid_bytes, m.NCCL_ID_BYTES, encoding=False)
    if w.new_rank >= w.new_world_size:
        raise InvalidField(
            f"NewNcclSession.new_rank={w.new_rank} is not below new_world_size="
            f"{w.new_world_size}",
            msg_type="NewNcclSession",
        )
    return m.NewNcclSession(
        uid_bytes=w.uid_bytes, new_rank=w.new_rank, new_world_size=w.new_world_size,
        initial=w.initial,
    )


def _request_id_to_wire(_: m.RequestNewNcclId) -> pb.ControlMsg:
    return _C(request_new_nccl_id=_C.RequestNewNcclId())


def _request_id_from_wire(_: Any) -> m.RequestNewNcclId:
    return m.RequestNewNcclId()


def _advisory_to_wire(x: m.StageAdvisory) -> pb.ControlMsg:
    segments = [
        _C.Segment(epoch=s.epoch, spans=[_C.Span(offset=p.offset, size=p.size) for p in s.spans])
        for s in x.segments
    ]
    return _C(stage_advisory=_C.StageAdvisory(counts=x.counts, segments=segments))


def _advisory_from_wire(w: Any) -> m.StageAdvisory:
    return m.StageAdvisory(
        counts=tuple(w.counts),
        segments=tuple(
            m.Segment(epoch=s.epoch, spans=tuple(m.Span(offset=p.offset, size=p.size)
                                                 for p in s.spans))
            for s in w.segments
        ),
    )


def _throttle_to_wire(_: m.Throttle) -> pb.ControlMsg:
    return _C(throttle=_C.Throttle())


def _throttle_from_wire(_: Any) -> m.Throttle:
    return m.Throttle()


def _global_step_to_wire(x: m.SetGlobalStep) -> pb.ControlMsg:
    wire = _C()
    body = wire.set_global_step
    body.SetInParent()  # (present even when every field is at its default)
    body.global_step = x.global_step
    body.step_budget.extend(x.step_budget)
    add = body.plans.add
    for p in x.plans:  # filled in place: a window's broadcast carries a plan per rank
        fill_plan(add(rank=p.rank).plan, p.plan)
    return wire


def _global_step_from_wire(w: Any) -> m.SetGlobalStep:
    plans = []
    for p in w.plans:
        if not p.HasField("plan"):
            raise InvalidField(f"SetGlobalStep.plans: rank {p.rank}'s entry has no plan",
                               msg_type="SetGlobalStep")
        plans.append(m.RankPlan(rank=p.rank, plan=plan_from_wire(p.plan)))
    return m.SetGlobalStep(global_step=w.global_step, step_budget=tuple(w.step_budget),
                           plans=tuple(plans))


def _checkpoint_to_wire(x: m.Checkpoint) -> pb.ControlMsg:
    _check_target("Checkpoint", x.target_rank, encoding=True)
    return _C(checkpoint=_C.Checkpoint(version=x.version, target_rank=x.target_rank))


def _checkpoint_from_wire(w: Any) -> m.Checkpoint:
    _check_target("Checkpoint", w.target_rank, encoding=False)
    return m.Checkpoint(version=w.version, target_rank=w.target_rank)


def _eval_cb_to_wire(x: m.ExecuteEvalCallback) -> pb.ControlMsg:
    _check_target("ExecuteEvalCallback", x.target_rank, encoding=True)
    return _C(
        execute_eval_callback=_C.ExecuteEvalCallback(
            schedule_id=x.schedule_id,
            epoch=x.epoch,
            target_rank=x.target_rank,
            adopt_consensus=x.adopt_consensus,
        )
    )


def _eval_cb_from_wire(w: Any) -> m.ExecuteEvalCallback:
    _check_target("ExecuteEvalCallback", w.target_rank, encoding=False)
    return m.ExecuteEvalCallback(
        schedule_id=w.schedule_id,
        epoch=w.epoch,
        target_rank=w.target_rank,
        adopt_consensus=w.adopt_consensus,
    )


def _role_to_wire(x: m.SetEpochCallbackRole) -> pb.ControlMsg:
    return _C(set_epoch_callback_role=_C.SetEpochCallbackRole(rank=x.rank))


def _role_from_wire(w: Any) -> m.SetEpochCallbackRole:
    return m.SetEpochCallbackRole(rank=w.rank)


def _shutdown_to_wire(_: m.Shutdown) -> pb.ControlMsg:
    return _C(shutdown=_C.Shutdown())


def _shutdown_from_wire(_: Any) -> m.Shutdown:
    return m.Shutdown()


def _save_shutdown_to_wire(x: m.ShutdownWithSave) -> pb.ControlMsg:
    # the domain enum's values are the wire numbers (flodl's reason byte)
    return _C(shutdown_with_save=_C.ShutdownWithSave(
        reason=pb.SaveReason.ValueType(int(x.reason))))


def save_reason_from_wire(value: int) -> m.SaveReason:
    """Forward compatibility: a reason this build does not know is a graceful shutdown."""
    try:
        return m.SaveReason(value)
    except ValueError:
        return m.SaveReason.GRACEFUL_SHUTDOWN


def _save_shutdown_from_wire(w: Any) -> m.ShutdownWithSave:
    return m.ShutdownWithSave(reason=save_reason_from_wire(w.reason))


def _aggregated_to_wire(x: m.EpochAggregated) -> pb.ControlMsg:
    return _C(epoch_aggregated=_C.EpochAggregated(metrics=epoch_metrics_to_wire(x.metrics)))


def _aggregated_from_wire(w: Any) -> m.EpochAggregated:
    if not w.HasField("metrics"):
        raise InvalidField("EpochAggregated.metrics is required", msg_type="EpochAggregated")
    return m.EpochAggregated(metrics=epoch_metrics_from_wire(w.metrics))


def _eval_bcast_to_wire(x: m.EvalBroadcast) -> pb.ControlMsg:
    return _C(eval_broadcast=_C.EvalBroadcast(epoch=x.epoch, metric=x.metric))


def _eval_bcast_from_wire(w: Any) -> m.EvalBroadcast:
    return m.EvalBroadcast(epoch=w.epoch, metric=w.metric)


def _save_consensus_to_wire(x: m.SaveConsensusModel) -> pb.ControlMsg:
    _check_target("SaveConsensusModel", x.target_rank, encoding=True)
    return _C(save_consensus_model=_C.SaveConsensusModel(
        target_rank=x.target_rank, version=x.version, bundle_meta=x.bundle_meta))


def _save_consensus_from_wire(w: Any) -> m.SaveConsensusModel:
    _check_target("SaveConsensusModel", w.target_rank, encoding=False)
    return m.SaveConsensusModel(target_rank=w.target_rank, version=w.version,
                                bundle_meta=w.bundle_meta)


def _coord_hb_to_wire(_: m.CoordHeartbeat) -> pb.ControlMsg:
    return _C(coord_heartbeat=_C.CoordHeartbeat())


def _coord_hb_from_wire(_: Any) -> m.CoordHeartbeat:
    return m.CoordHeartbeat()


# ----------------------------------------------------------------------- membership


def _hello_wire(x: m.Hello) -> pb.JoinMsg.Hello:
    _check_len("Hello", "model_signature", x.model_signature, m.MODEL_SIGNATURE_BYTES,
               encoding=True)
    return _J.Hello(
        rank=x.rank,
        generation=x.generation,
        host=x.host,
        device=x.device,
        model_signature=x.model_signature,
        world_size=x.world_size,
        pid=x.pid,
        backend=x.backend,
        torch_version=x.torch_version,
        dataset_size=x.dataset_size,
    )


def _hello_domain(w: Any) -> m.Hello:
    _check_len("Hello", "model_signature", w.model_signature, m.MODEL_SIGNATURE_BYTES,
               encoding=False)
    if w.rank >= w.world_size:
        raise InvalidField(f"Hello.rank={w.rank} is not below world_size={w.world_size}",
                           msg_type="Hello")
    return m.Hello(
        rank=w.rank,
        generation=w.generation,
        host=w.host,
        device=w.device,
        model_signature=w.model_signature,
        world_size=w.world_size,
        pid=w.pid,
        backend=w.backend,
        torch_version=w.torch_version,
        dataset_size=w.dataset_size,
    )


def _hello_to_wire(x: m.Hello) -> pb.JoinMsg:
    return _J(hello=_hello_wire(x))


def _rejoin_to_wire(x: m.Rejoin) -> pb.JoinMsg:
    return _J(
        rejoin=_J.Rejoin(
            hello=_hello_wire(x.hello),
            resume_stream_seq=x.resume_stream_seq,
            checkpoint_version=x.checkpoint_version,
        )
    )


def _rejoin_from_wire(w: Any) -> m.Rejoin:
    if not w.HasField("hello"):
        raise InvalidField("Rejoin.hello is required", msg_type="Rejoin")
    return m.Rejoin(
        hello=_hello_domain(w.hello),
        resume_stream_seq=w.resume_stream_seq,
        checkpoint_version=w.checkpoint_version,
    )


_POLICY_TO_WIRE: Final = {
    m.Policy.SYNC: pb.POLICY_SYNC,
    m.Policy.CADENCE: pb.POLICY_CADENCE,
    m.Policy.ASYNC: pb.POLICY_ASYNC,
}
_POLICY_FROM_WIRE: Final = {v: k for k, v in _POLICY_TO_WIRE.items()}
_BACKEND_TO_WIRE: Final = {
    m.Backend.AUTO: pb.BACKEND_AUTO,
    m.Backend.NCCL: pb.BACKEND_NCCL,
    m.Backend.GLOO: pb.BACKEND_GLOO,
    m.Backend.BROKER: pb.BACKEND_BROKER,
}
_BACKEND_FROM_WIRE: Final = {v: k for k, v in _BACKEND_TO_WIRE.items()}


def run_config_to_wire(x: m.RunConfig) -> pb.RunConfig:
    return pb.RunConfig(
        policy=_POLICY_TO_WIRE[x.policy],
        backend=_BACKEND_TO_WIRE[x.backend],
        batch_size=x.batch_size,
        epochs=x.epochs,
        seed=x.seed,
        gamma=x.gamma,
        lr_scale_ratio=x.lr_scale_ratio,
        dataset_size=x.dataset_size,
        param_norm_every=x.param_norm_every,
        coordinator_timeout_s=x.coordinator_timeout_s,
        progressive=x.progressive,
        collective_timeout_s=x.collective_timeout_s,
        easgd_alpha=x.easgd_alpha,
        bf16_wire=x.bf16_wire,
        report_interval_ms=x.report_interval_ms,
    )


def run_config_from_wire(w: pb.RunConfig) -> m.RunConfig:
    policy = _POLICY_FROM_WIRE.get(w.policy)
    backend = _BACKEND_FROM_WIRE.get(w.backend)
    if policy is None or backend is None:
        raise InvalidField(f"RunConfig policy={w.policy} backend={w.backend} is not a known "
                           "pair", msg_type="RunConfig")
    if (w.batch_size < 1 or not w.coordinator_timeout_s > 0
            or not 0 <= w.collective_timeout_s < float("inf")
            or not 0 <= w.easgd_alpha <= 1
            or not 0 <= w.report_interval_ms < float("inf")):
        raise InvalidField("RunConfig needs batch_size >= 1, coordinator_timeout_s > 0, "
                           "a finite collective_timeout_s >= 0, easgd_alpha in [0, 1] and "
                           "a finite report_interval_ms >= 0", msg_type="RunConfig")
    return m.RunConfig(
        policy=policy,
        backend=backend,
        batch_size=w.batch_size,
        epochs=w.epochs,
        seed=w.seed,
        gamma=w.gamma,
        lr_scale_ratio=w.lr_scale_ratio,
        dataset_size=w.dataset_size,
        param_norm_every=w.param_norm_every,
        coordinator_timeout_s=w.coordinator_timeout_s,
        progressive=w.progressive,
        collective_timeout_s=w.collective_timeout_s,
        easgd_alpha=w.easgd_alpha or 1.0,
        bf16_wire=w.bf16_wire,
        report_interval_ms=w.report_interval_ms,
    )


def _accept_to_wire(x: m.Accept) -> pb.AdmitMsg:
    return _A(
        accept=_A.Accept(
            rank=x.rank,
            generation=x.generation,
            world_size=x.world_size,
            coordinator_generation=x.coordinator_generation,
            run=run_config_to_wire(x.run),
        )
    )


def _accept_from_wire(w: Any) -> m.Accept:
    if not w.HasField("run"):
        raise InvalidField("Accept.run is required", msg_type="Accept")
    return m.Accept(
        rank=w.rank,
        generation=w.generation,
        world_size=w.world_size,
        coordinator_generation=w.coordinator_generation,
        run=run_config_from_wire(w.run),
    )


def _reject_to_wire(x: m.Reject) -> pb.AdmitMsg:
    return _A(reject=_A.Reject(rank=x.rank, generation=x.generation, reason=x.reason))


def _reject_from_wire(w: Any) -> m.Reject:
    return m.Reject(rank=w.rank, generation=w.generation, reason=w.reason)


# ------------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class Variant:
    """One row of the protocol: a domain class and its wire twin."""

    type_name: str  # the Ddpbus-Type header value, e.g. "TimingMsg.Batch"
    cls: type[Any]
    family: type[PbMessage]  # the top-level protobuf message
    field: str | None  # the oneof member, None for single-variant families
    to_wire: Callable[[Any], PbMessage]
    from_wire: Callable[[Any], Any]


def _v(family: type[PbMessage], field: str | None, cls: type[Any],
       to_wire: Callable[[Any], PbMessage], from_wire: Callable[[Any], Any]) -> Variant:
    type_name = family.DESCRIPTOR.name + ("" if field is None else "." + cls.__name__)
    return Variant(type_name, cls, family, field, to_wire, from_wire)


VARIANTS: Final[tuple[Variant, ...]] = (
    _v(_T, "batch", m.Batch, _batch_to_wire, _batch_from_wire),
    _v(_T, "sync_ack", m.SyncAck, _sync_ack_to_wire, _sync_ack_from_wire),
    _v(_T, "exiting", m.Exiting, _exiting_to_wire, _exiting_from_wire),
    _v(_T, "lr_update", m.LrUpdate, _lr_update_to_wire, _lr_update_from_wire),
    _v(_T, "heartbeat", m.Heartbeat, _heartbeat_to_wire, _heartbeat_from_wire),
    _v(_T, "intent", m.Intent, _intent_to_wire, _intent_from_wire),
    _v(_T, "snapshot_ready", m.SnapshotReady, _snapshot_ready_to_wire,
       _snapshot_ready_from_wire),
    _v(_T, "new_nccl_id_generated", m.NewNcclIdGenerated, _nccl_id_to_wire, _nccl_id_from_wire),
    _v(_T, "eval_result", m.EvalResult, _eval_result_to_wire, _eval_result_from_wire),
    _v(_T, "checkpoint_result", m.CheckpointResult, _checkpoint_result_to_wire,
       _checkpoint_result_from_wire),
    _v(_T, "epoch_fn_elapsed", m.EpochFnElapsed, _epoch_fn_to_wire, _epoch_fn_from_wire),
    _v(_T, "reports", m.Reports, _reports_to_wire, _reports_from_wire),
    _v(_C, "request_params", m.RequestParams, _request_params_to_wire,
       _request_params_from_wire),
    _v(_C, "update", m.Update, _update_to_wire, _update_from_wire),
    _v(_C, "sync_now", m.SyncNow, _sync_now_to_wire, _sync_now_from_wire),
    _v(_C, "start_epoch", m.StartEpoch, _start_epoch_to_wire, _start_epoch_from_wire),
    _v(_C, "extend_partition", m.ExtendPartition, _extend_to_wire, _extend_from_wire),
    _v(_C, "declare_dead", m.DeclareDead, _declare_dead_to_wire, _declare_dead_from_wire),
    _v(_C, "new_nccl_session", m.NewNcclSession, _new_session_to_wire, _new_session_from_wire),
    _v(_C, "request_new_nccl_id", m.RequestNewNcclId, _request_id_to_wire,
       _request_id_from_wire),
    _v(_C, "stage_advisory", m.StageAdvisory, _advisory_to_wire, _advisory_from_wire),
    _v(_C, "throttle", m.Throttle, _throttle_to_wire, _throttle_from_wire),
    _v(_C, "set_global_step", m.SetGlobalStep, _global_step_to_wire, _global_step_from_wire),
    _v(_C, "checkpoint", m.Checkpoint, _checkpoint_to_wire, _checkpoint_from_wire),
    _v(_C, "execute_eval_callback", m.ExecuteEvalCallback, _eval_cb_to_wire, _eval_cb_from_wire),
    _v(_C, "set_epoch_callback_role", m.SetEpochCallbackRole, _role_to_wire, _role_from_wire),
    _v(_C, "shutdown", m.Shutdown, _shutdown_to_wire, _shutdown_from_wire),
    _v(_C, "shutdown_with_save", m.ShutdownWithSave, _save_shutdown_to_wire,
       _save_shutdown_from_wire),
    _v(_C, "epoch_aggregated", m.EpochAggregated, _aggregated_to_wire, _aggregated_from_wire),
    _v(_C, "eval_broadcast", m.EvalBroadcast, _eval_bcast_to_wire, _eval_bcast_from_wire),
    _v(_C, "save_consensus_model", m.SaveConsensusModel, _save_consensus_to_wire,
       _save_consensus_from_wire),
    _v(_C, "coord_heartbeat", m.CoordHeartbeat, _coord_hb_to_wire, _coord_hb_from_wire),
    _v(pb.MetricsMsg, None, m.MetricsMsg, metrics_to_wire, metrics_from_wire),
    _v(_J, "hello", m.Hello, _hello_to_wire, _hello_domain),
    _v(_J, "rejoin", m.Rejoin, _rejoin_to_wire, _rejoin_from_wire),
    _v(_A, "accept", m.Accept, _accept_to_wire, _accept_from_wire),
    _v(_A, "reject", m.Reject, _reject_to_wire, _reject_from_wire),
)

BY_CLASS: Final[Mapping[type[Any], Variant]] = {v.cls: v for v in VARIANTS}
BY_TYPE: Final[Mapping[str, Variant]] = {v.type_name: v for v in VARIANTS}


def variant_of(msg: m.Message) -> Variant:
    try:
        return BY_CLASS[type(msg)]
    except KeyError:
        raise EncodeError(f"{type(msg).__name__} is not a ddpbus wire message") from None


def to_wire(msg: m.Message) -> tuple[Variant, PbMessage]:
    """Domain -> protobuf; :class:`EncodeError` for values the wire cannot carry."""
    variant = variant_of(msg)
    try:
        return variant, variant.to_wire(msg)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, EncodeError):
            raise
        raise EncodeError(f"{variant.type_name}: {exc}") from exc


def from_wire(variant: Variant, wire: PbMessage) -> m.Message:
    """Protobuf (already parsed as ``variant.family``) -> domain.

    Raises :class:`MalformedPayload` when the payload holds another variant than the header
    names and :class:`InvalidField` when it breaks a protocol rule.
    """
    field = variant.field
    if field is None:
        result: m.Message = variant.from_wire(wire)
        return result
    if not wire.HasField(field):
        held = wire.WhichOneof("variant")
        raise MalformedPayload(
            f"payload holds {held or 'no variant'}, header says {variant.type_name}",
            msg_type=variant.type_name,
        )
    inner: m.Message = variant.from_wire(getattr(wire, field))
    return inner


def inner_dispatch(msg: m.ControlMsg) -> m.ControlMsg | None:
    """What the worker's training loop must act on; ``None`` for informational variants.

    ``CoordHeartbeat`` only resets the coordinator-liveness deadline and ``Update`` is
    consumed by the param bridge (which turns a present ``next_plan`` into a StartEpoch
    after applying the consensus); neither reaches the loop itself.
    """
    if isinstance(msg, m.CoordHeartbeat | m.Update):
        return None
    return msg

