"""A worker agent's start, up to the run's settings, without NATS: which weights a rank starts
from (a fresh rank, a restarted one, a run with its own seed) and what it says in its
Hello / Rejoin; and the trainer's refusals reaching the agent's count."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from worker_harness import run_config, spec

from ddpbus.codecs import Decoder, Encoder
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import DdpbusError
from ddpbus.orchestrator.core.session import NOT_JOINABLE
from ddpbus.orchestrator.transport.auth import Access
from ddpbus.worker_agent import checkpoint
from ddpbus.worker_agent.agent import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REJECTED,
    WorkerAgent,
    WorkerSettings,
    model_signature,
)
from ddpbus.worker_agent.spec import TrainSpec
from ddpbus.worker_agent.trainer import Trainer, TrainerSettings


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Start:
    """An agent whose start is run up to where the run's settings are loaded: admission
    answers ``accept`` (None: rejected), and it stops right after (no bundle to load)."""

    def __init__(self, out: Path, monkeypatch: pytest.MonkeyPatch, train_spec: TrainSpec,
                 *, resume_seq: int = 0, accept: m.Accept | None = None) -> None:
        self.sent: list[m.Message] = []
        agent = WorkerAgent(WorkerSettings(job="j", rank=0, world_size=2,
                                           nats=Access(url="nats://127.0.0.1:1"), key=b"k" * 32,
                                           out_dir=out), train_spec)
        torch.manual_seed(train_spec.schedule().seed)  # as WorkerAgent.run builds it
        agent.trainer = Trainer(train_spec, TrainerSettings(
            rank=0, device=torch.device("cpu"), store_factory=dist.HashStore, out_dir=out),
            lambda _msg, _durable: None)
        self.initial = _weights(agent.trainer.model)
        agent.generation, agent.resume_seq = 1, resume_seq

        async def nothing(*_args: Any) -> None:
            return None

        async def admission() -> m.Accept | None:
            return accept

        async def no_bundle_loaded(*_args: Any) -> bool:
            return False  # ends the start here (EXIT_FAILED)

        monkeypatch.setattr(agent, "_send", lambda msg, durable=True: self.sent.append(msg))
        monkeypatch.setattr(agent, "_find_bundle", nothing)
        monkeypatch.setattr(agent, "_beacon", nothing)
        monkeypatch.setattr(agent, "_await_admission", admission)
        monkeypatch.setattr(agent, "_load_bundle", no_bundle_loaded)
        self.agent = agent

    async def run(self) -> int:
        try:
            return await self.agent._lifecycle(self.agent.trainer, torch.device("cpu"))
        finally:
            await asyncio.gather(*self.agent.link.tasks)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.agent.trainer.model)


def _earlier_model(out: Path, global_step: int) -> dict[str, torch.Tensor]:
    """A consensus model an earlier run (or this rank's earlier incarnation) left in --out."""
    torch.manual_seed(1234)
    model = torch.nn.Linear(4, 1)
    checkpoint.save_model(out / "consensus.safetensors", model,
                          {"kind": "consensus", "global_step": global_step})
    return _weights(model)


async def test_a_fresh_rank_ignores_a_consensus_model_left_in_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    old = _earlier_model(tmp_path, global_step=40)
    start = Start(tmp_path, monkeypatch, spec())
    with caplog.at_level(logging.WARNING):
        assert await start.run() == EXIT_REJECTED
    assert _same(start.weights, start.initial)
    assert not _same(start.weights, old)
    assert [type(x) for x in start.sent] == [m.Hello]
    assert any("consensus.safetensors" in r.getMessage() and "ignoring" in r.getMessage()
               for r in caplog.records)


async def test_a_restarted_rank_starts_from_the_consensus_model_and_says_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _earlier_model(tmp_path, global_step=40)
    start = Start(tmp_path, monkeypatch, spec(), resume_seq=17)
    assert await start.run() == EXIT_REJECTED
    assert _same(start.weights, old)
    (rejoin,) = start.sent
    assert isinstance(rejoin, m.Rejoin)
    assert (rejoin.resume_stream_seq, rejoin.checkpoint_version) == (17, 40)


def _accept(seed: int) -> m.Accept:
    return m.Accept(rank=0, generation=1, world_size=2, coordinator_generation=1,
                    run=run_config(seed=seed))


async def test_a_run_with_its_own_seed_starts_every_fresh_rank_from_that_seeds_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_spec = spec(knobs={"seed": 3})
    start = Start(tmp_path, monkeypatch, train_spec, accept=_accept(seed=8))
    assert await start.run() == EXIT_FAILED  # (stopped where a bundle would be loaded)
    torch.manual_seed(8)
    want = _weights(train_spec.model())
    assert _same(start.weights, want)
    assert not _same(start.weights, start.initial)
    # the Hello went before the run's seed was known: its model signature (names, shapes,
    # dtypes) still describes the model
    hello = start.sent[0]
    assert isinstance(hello, m.Hello)
    assert hello.model_signature == model_signature(start.agent.trainer.model)


async def test_the_specs_own_seed_keeps_the_weights_and_a_restart_keeps_its_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_spec = spec(knobs={"seed": 3})
    start = Start(tmp_path, monkeypatch, train_spec, accept=_accept(seed=3))
    assert await start.run() == EXIT_FAILED
    assert _same(start.weights, start.initial)
    old = _earlier_model(tmp_path, global_step=40)
    restart = Start(tmp_path, monkeypatch, train_spec, resume_seq=5, accept=_accept(seed=8))
    assert await restart.run() == EXIT_FAILED
    assert _same(restart.weights, old)


async def test_a_plan_the_trainer_refuses_is_counted_for_the_heartbeat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = Start(tmp_path, monkeypatch, spec()).agent
    agent.loop = asyncio.get_running_loop()
    counted = asyncio.Event()

    def refuse_twice() -> None:  # the training thread's side
        for _ in range(2):
            agent._trainer_refused("plan-out-of-range")
        agent.loop.call_soon_threadsafe(counted.set)  # runs after the two, in order

    thread = threading.Thread(target=refuse_twice)
    thread.start()
    thread.join()
    await asyncio.wait_for(counted.wait(), 5)
    assert agent.rejected == {"plan-out-of-range": 2}


@pytest.mark.parametrize(("reason", "ends_ok", "code"), [
    (f"the run is draining; {NOT_JOINABLE}", True, EXIT_OK),  # a replacement, too late
    (f"the run is draining; {NOT_JOINABLE}", False, EXIT_REJECTED),  # it failed, or hangs
    ("model signature differs from the cohort's", True, EXIT_REJECTED),
])
async def test_a_rank_refused_as_the_run_ends_has_nothing_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reason: str, ends_ok: bool,
        code: int) -> None:
    """A Job's replacement pod that comes as the run is ending is refused ("no rank can
    join now"): it exits 0 once the run's summary says it ended well (its Job completes
    instead of failing a finished run); any other refusal is one."""
    start = Start(tmp_path, monkeypatch, spec())
    start.agent._admitted = asyncio.get_running_loop().create_future()
    start.agent._on_admit(m.Reject(rank=0, generation=1, reason=reason))  # the coordinator's
    asked: list[bool] = []

    async def run_ends_ok() -> bool:
        asked.append(True)
        return ends_ok

    monkeypatch.setattr(start.agent, "_run_ends_ok", run_ends_ok)
    assert await start.run() == code
    assert asked == ([True] if NOT_JOINABLE in reason else [])  # no wait for other reasons


@pytest.mark.parametrize(("ends_ok", "code"), [(True, EXIT_OK), (False, EXIT_REJECTED)])
async def test_a_rank_whose_hello_the_runs_shutdown_overtook_has_nothing_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends_ok: bool, code: int) -> None:
    """A Job's replacement pod whose Rejoin was still unanswered when the run's Shutdown came
    (read off its own consumer, the run already ended: the helm smoke run's kill saw it on
    2026-12-08, the replacement 0.4 s late) exits 0 once the summary says the run ended well,
    as a refused one does; exit 2 would fail the Job of a finished run."""
    start = Start(tmp_path, monkeypatch, spec())
    agent = start.agent
    agent.decoder = Decoder(job="j", key=b"k" * 32, generation_floor=lambda _sender: 0)
    agent._admitted = asyncio.get_running_loop().create_future()
    subject = sj.CONTROL_ALL.subject("j")
    out = Encoder(job="j", key=b"k" * 32, sender=sj.COORDINATOR, generation=1).encode(
        subject, m.Shutdown())
    await agent._on_control(SimpleNamespace(subject=subject, headers=out.headers,  # type: ignore[arg-type]
                                            data=out.payload))
    assert agent._too_late
    with pytest.raises(DdpbusError, match="the run ended before this rank was admitted"):
        agent._admitted.result()

    async def admission() -> m.Accept | None:
        return None  # what _await_admission returns for that exception

    async def run_ends_ok() -> bool:
        return ends_ok

    monkeypatch.setattr(agent, "_await_admission", admission)
    monkeypatch.setattr(agent, "_run_ends_ok", run_ends_ok)
    assert await start.run() == code
