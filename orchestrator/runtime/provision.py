"""Create a job's JetStream resources per subjects.md: one function, idempotent.

The stream captures every ``stream`` subject of the job; the KV bucket holds membership,
coordinator snapshots, the leader lease and the torch.distributed rendezvous; the Object
Stores hold the broker backend's rounds and the resume bundles; the durable
consumers are ``coordinator`` (timing, metrics, join) and ``rank-<N>`` (its control and admit
subjects plus control.all, delivered together in stream order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.transport import bus

log = logging.getLogger(__name__)

# nats-server 2.15 caps a stream at 1,000 consumers unless the stream says otherwise; a job
# has one durable per rank plus the coordinator's, and watchers (`ddpbus sub`, `status`,
# `replay`, `report`) add short-lived ordered consumers
SERVER_DEFAULT_CONSUMERS = 1000
WATCHER_CONSUMERS = 256


def max_consumers(world_size: int) -> int:
    return max(SERVER_DEFAULT_CONSUMERS, world_size + 1 + WATCHER_CONSUMERS)


@dataclass(frozen=True, kw_only=True)
class JobStorage:
    """Retention and sizing of one job's stream and bucket."""

    max_age: timedelta = field(default=timedelta(days=7))
    # a backstop for a stream whose compaction cannot run (orchestrator/runtime/retention.py);
    # None: unlimited for a new stream, and an existing stream keeps the limit it has.
    # nats-server reserves a stream's max_bytes against the server's file store up front
    max_bytes: int | None = None
    max_msg_size: int = 1024 * 1024
    replicas: int = 1
    ack_wait: timedelta = field(default=timedelta(seconds=10))

    def __post_init__(self) -> None:
        if self.max_age <= timedelta(0):
            raise ConfigError("stream max_age must be positive")
        if self.max_bytes is not None and self.max_bytes < 1 and self.max_bytes != -1:
            raise ConfigError(f"stream max_bytes must be positive or -1 (unlimited), got "
                              f"{self.max_bytes}")
        if self.replicas not in (1, 3, 5):
            raise ConfigError(f"replicas must be 1, 3 or 5, got {self.replicas}")


@dataclass(frozen=True, slots=True)
class JobResources:
    stream: str
    bucket: str
    consumers: tuple[str, ...]


def stream_config(job: str, storage: JobStorage, world_size: int = 1) -> StreamConfig:
    return StreamConfig(
        max_consumers=max_consumers(world_size),
        name=sj.stream_name(job),
        subjects=sj.stream_subjects(job),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=storage.max_age.total_seconds(),
        max_bytes=-1 if storage.max_bytes is None else storage.max_bytes,
        max_msg_size=storage.max_msg_size,
        duplicate_window=sj.DUPLICATE_WINDOW.total_seconds(),
        allow_direct=True,
        num_replicas=storage.replicas,
    )


def consumer_configs(job: str, world_size: int, storage: JobStorage) -> list[ConsumerConfig]:
    def durable(name: str, filters: list[str]) -> ConsumerConfig:
        return ConsumerConfig(durable_name=name, filter_subjects=filters,
                              ack_policy=AckPolicy.ALL, deliver_policy=DeliverPolicy.ALL,
                              ack_wait=storage.ack_wait.total_seconds(), max_ack_pending=10_000)

    configs = [durable(sj.COORDINATOR_CONSUMER, sj.coordinator_filters(job))]
    configs += [durable(sj.rank_consumer(r), sj.rank_filters(job, r)) for r in range(world_size)]
    return configs


async def _ensure_stream(js: JetStreamContext, config: StreamConfig,
                         storage: JobStorage) -> StreamInfo:
    try:
        info = await js.stream_info(config.name or "")
    except NotFoundError:
        log.info("creating stream %s", config.name)
        return await js.add_stream(config)
    if storage.max_bytes is None:  # not asked for: keep the job's backstop as it is
        config.max_bytes = info.config.max_bytes
    if sorted(info.config.subjects or []) != sorted(config.subjects or []) or (
        info.config.max_age != config.max_age or info.config.max_bytes != config.max_bytes
        or info.config.max_msg_size != config.max_msg_size
        or (info.config.max_consumers or 0) < (config.max_consumers or 0)
    ):
        log.info("updating stream %s to the current layout", config.name)
        # never lower a consumer limit another world size raised
        config.max_consumers = max(config.max_consumers or 0, info.config.max_consumers or 0)
        return await js.update_stream(config)
    return info


async def ensure_job(js: JetStreamContext, job: str, world_size: int,
                     storage: JobStorage | None = None) -> JobResources:
    """Create or update the job's stream, KV bucket and durable consumers.

    Safe to call any number of times, from any process: existing resources with the
    same layout are left alone; a larger ``world_size`` adds the missing rank consumers; an
    existing consumer gets the current filters but keeps where it starts delivering (a
    coordinator's takeover may have re-created its durable from a stream sequence).
    """
    sj.check_job(job)
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    storage = storage or JobStorage()
    config = stream_config(job, storage, world_size)
    await _ensure_stream(js, config, storage)
    bucket = sj.kv_bucket(job)
    try:
        await js.key_value(bucket)
    except BucketNotFoundError:
        log.info("creating KV bucket %s", bucket)
        await js.create_key_value(KeyValueConfig(
            bucket=bucket, history=5, storage=StorageType.FILE, replicas=storage.replicas,
            # reads by direct get name the key in the API subject, so permissions can
            # scope them (a plain stream-message get cannot be scoped)
            direct=True))
    # the Object Stores too: a rank's credentials may use them but not create them
    await bus.rounds_store(js, job)
    await bundles.object_store(js, job, create=True)
    names = []
    for consumer in consumer_configs(job, world_size, storage):
        await _ensure_consumer(js, config.name or "", consumer)
        names.append(consumer.durable_name or "")
    return JobResources(stream=config.name or "", bucket=bucket, consumers=tuple(names))


def _filters(config: ConsumerConfig) -> set[str]:
    return set(config.filter_subjects or []) | ({config.filter_subject}
                                                 if config.filter_subject else set())


async def _ensure_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> None:
    """Create the durable ``config`` names, or bring an existing one's filters and ack
    settings up to date. Where it starts delivering is never rewritten: a takeover
    re-creates the coordinator's durable from its snapshot's stream sequence
    (``DeliverPolicy.BY_START_SEQUENCE``), and nats-server refuses to change a deliver
    policy in place (err_code 10012): the existing start position is carried over."""
    name = config.durable_name or ""
    try:
        info = await js.consumer_info(stream, name)
    except NotFoundError:
        log.info("creating consumer %s on %s", name, stream)
        await js.add_consumer(stream, config)
        return
    have = info.config
    if (_filters(have) == _filters(config) and have.ack_wait == config.ack_wait
            and have.max_ack_pending == config.max_ack_pending):
        return
    log.info("updating consumer %s on %s to the current layout", name, stream)
    config.deliver_policy = have.deliver_policy
    config.opt_start_seq = have.opt_start_seq
    config.opt_start_time = have.opt_start_time
    await js.add_consumer(stream, config)  # updates in place


async def retire_consumers(js: JetStreamContext, job: str, world_size: int) -> int:
    """Delete the job's durable consumers (the coordinator's and every rank's) once its run
    is over; the stream, the bucket and the Object Stores stay (status, replay, report,
    resume). Each durable is state the server keeps, loads and syncs: a finished job's
    would cost every later server restart (~10 ms each on shutdown: a broker holding a
    1,024-rank job's took over 10 s to stop) and count against the stream's consumer cap.
    Watchers' ephemeral consumers are left alone. Returns how many it deleted; a rank
    started after this finds no consumer and the run's summary, and stops (nothing to
    join)."""
    stream = sj.stream_name(job)
    deleted = 0
    for consumer in consumer_configs(job, world_size, JobStorage()):
        try:
            await js.delete_consumer(stream, consumer.durable_name or "")
        except NotFoundError:
            continue
        deleted += 1
    return deleted
