"""End-to-end training: real nats-server, real coordinator and worker processes, gloo.

Each test runs the commands a cluster runs (`ddpbus coordinator`, `ddpbus worker`) and checks
the outcome that matters: parameters equal to torch DDP's, every sample of every epoch
trained exactly once, replicas identical, accuracy, batch shares under a slow rank, and every
message variant of these flows seen on the wire.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from jobs import SPECS, LiveTap, held_metrics, spec, start_job, stream_messages, stream_types
from safetensors.torch import load_file

from ddpbus.orchestrator.runtime.nats_server import EmbeddedBroker
from ddpbus.worker_agent.data import epoch_permutation
from ddpbus.worker_agent.spec import load_spec

pytestmark = pytest.mark.timeout(300)

N_TRAIN = 1438  # digits training split (1797 - 359 held out)
BATCH = 32


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _same_replicas(out: Path, workers: int) -> dict[str, torch.Tensor]:
    states = [load_file(str(out / f"rank{r}.final.safetensors")) for r in range(workers)]
    for other in states[1:]:
        assert other.keys() == states[0].keys()
        for k in states[0]:
            assert torch.equal(states[0][k], other[k]), f"replicas differ at {k}"
    return states[0]


@pytest.mark.parametrize("backend", ["gloo", "broker"])
def test_sync_policy_matches_torch_ddp(broker: EmbeddedBroker, tmp_path: Path,
                                       backend: str) -> None:
    """Both averaging paths: the gloo collectives, and snapshots reduced through the
    broker (a different summation order, so equal within float32 rounding)."""
    job = start_job(broker.url, tmp_path, spec("parity"), job=f"parity-{backend}",
                    coordinator_args=["--backend", backend])
    summary = job.wait()
    assert summary["ok"], summary
    assert summary["rounds"] == summary["global_step"] // 2 == 44  # one step per average
    ours = _same_replicas(job.out, 2)
    consensus = load_file(str(job.out / "consensus.safetensors"))
    store, ref = tmp_path / "ddp.store", tmp_path / "ddp.safetensors"
    procs = [subprocess.Popen([sys.executable, str(SPECS.parent / "ddp_reference.py"), str(r),
                               "2", str(store), str(ref)], stderr=subprocess.PIPE)
             for r in range(2)]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    theirs = load_file(str(ref))
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert _rel_err(ours[k], theirs[k]) <= 1e-5, k
        assert torch.equal(consensus[k], ours[k])
    # and the run really moved: parameters are far from the initial ones
    torch.manual_seed(7)
    init = load_spec(spec("parity")).model().state_dict()
    assert all(_rel_err(ours[k], init[k]) > 1e-3 for k in init)


def _ledger(path: Path) -> list[tuple[int, int]]:
    pairs = []
    for file in path.glob("rank-*.txt"):
        for line in file.read_text().splitlines():
            epoch, index = line.split()
            pairs.append((int(epoch), int(index)))
    return pairs


def _each_sample_once(ledger: Path, epochs: int) -> None:
    """The workers' ledger holds every sample of every epoch exactly once."""
    trained = Counter(_ledger(ledger))
    per_epoch = (N_TRAIN // BATCH) * BATCH
    for epoch in range(epochs):
        expected = set(epoch_permutation(N_TRAIN, 42, epoch)[:per_epoch].tolist())
        got = {i for (e, i) in trained if e == epoch}
        assert got == expected, f"epoch {epoch}: {len(expected ^ got)} samples differ"
    assert set(trained.values()) == {1}, "a sample was trained twice in one epoch"


SLOW = pytest.mark.slow  # the rest of the matrix: test-all


@pytest.mark.parametrize(("policy", "progressive"), [
    pytest.param("sync", True, id="sync-progressive", marks=SLOW),
    pytest.param("sync", False, id="sync-partitions"),
    pytest.param("cadence", True, id="cadence-progressive"),
    pytest.param("cadence", False, id="cadence-partitions", marks=SLOW),
    pytest.param("async", True, id="async-progressive", marks=SLOW),
    pytest.param("async", False, id="async-partitions"),
])
def test_every_sample_once_converges_and_replicas_agree(broker: EmbeddedBroker,
                                                         tmp_path: Path, policy: str,
                                                         progressive: bool) -> None:
    """Seed 42 (the spec's: permutations and initial weights); cadence and async still
    vary with scheduling. Test accuracy over seeds 0-19 (tests/accuracy_spread.py; 359 test
    digits: one is 0.28 %), min / median / max:

    - sync-progressive 0.9387 / 0.9680 / 0.9805, sync-partitions 0.9415 / 0.9638 / 0.9749;
    - cadence-progressive 0.9638 / 0.9777 / 0.9861, cadence-partitions 0.9415 / 0.9749 /
      0.9889;
    - async-progressive 0.9666 / 0.9777 / 0.9889, async-partitions 0.9610 / 0.9749 /
      0.9889; under a loaded machine async-partitions once gave 0.947 (issue 33).

    (bench/results/accuracy-spread-20261207T070445Z.json and -20261207T122328Z.json.)
    Bounds: 0.92 for sync (worst 0.9387), 0.93 otherwise (worst 0.9415), four digits of
    margin or more."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    # sync averages after every step: 10 epochs (440 rounds) are enough to prove it
    epochs = 10 if policy == "sync" else 20
    job = start_job(broker.url, tmp_path, spec("ledger"), job=f"cov-{policy}",
                    coordinator_args=["--policy", policy, "--knob",
                                      f"progressive={str(progressive).lower()}"],
                    env={"LEDGER_DIR": str(ledger), "LEDGER_EPOCHS": str(epochs)})
    summary = job.wait()
    assert summary["ok"], summary
    assert summary["policy"] == policy
    assert summary["progressive"] is progressive
    assert summary["epochs"] == epochs
    _each_sample_once(ledger, epochs)
    assert summary["test_accuracy"] >= (0.92 if policy == "sync" else 0.93), summary["eval"]
    _same_replicas(job.out, 2)


@pytest.mark.parametrize(("policy", "knobs", "slowdown"), [
    pytest.param("cadence", [], None, id="cadence", marks=SLOW),
    pytest.param("async", [], None, id="async-easgd"),  # EASGD, alpha 0.5 by default
    pytest.param("cadence", ["bf16_wire=true", "max_batch_diff=1"], "2.5",
                 id="cadence-bf16-throttled", marks=SLOW),
])
def test_broker_backend_every_sample_once_converges_and_replicas_agree(
        broker: EmbeddedBroker, tmp_path: Path, policy: str, knobs: list[str],
        slowdown: str | None) -> None:
    """Accuracy over seeds 0-19 (tests/accuracy_spread.py), min / median / max: cadence
    0.9610 / 0.9749 / 0.9861, async-easgd 0.9610 / 0.9777 / 0.9833, cadence-bf16-throttled
    0.9610 / 0.9791 / 0.9861 (bench/results/accuracy-spread-20261207T070445Z.json and
    -20261207T122328Z.json); bound 0.93, as for the collective path (worst 0.9610)."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    name = f"brk-{policy}-{len(knobs)}"
    args = ["--policy", policy, "--backend", "broker"]
    for knob in knobs:
        args += ["--knob", knob]
    job = start_job(broker.url, tmp_path, spec("ledger"), job=name, coordinator_args=args,
                    worker_args={1: ["--slowdown", slowdown]} if slowdown else None,
                    env={"LEDGER_DIR": str(ledger)})
    summary = job.wait()
    assert summary["ok"], summary
    assert summary["backend"] == "broker"
    assert summary["schedule"]["easgd_alpha"] == (0.5 if policy == "async" else 1.0)
    assert summary["snapshot_aborts"] == 0
    # the tensor frames and beacons (core NATS) leave no gap in the ranks' stream ids
    assert summary["unseen_ids"] == 0
    _each_sample_once(ledger, 20)
    assert summary["test_accuracy"] >= 0.93, summary["eval"]
    _same_replicas(job.out, 2)  # every rank ends as the last consensus, EASGD too
    seen = stream_types(stream_messages(broker.url, name))
    assert {"ControlMsg.RequestParams", "TimingMsg.SnapshotReady", "ControlMsg.Update"} <= \
        set(seen)
    assert not {"ControlMsg.SyncNow", "ControlMsg.RequestNewNcclId"} & set(seen)
    assert seen["ControlMsg.RequestParams"] == summary["rounds"]
    if slowdown:
        assert seen["ControlMsg.Throttle"] >= 1, seen


@SLOW
def test_slow_rank_under_cadence_and_sync(broker: EmbeddedBroker, tmp_path: Path) -> None:
    shares = {}
    for policy in ("cadence", "sync"):
        job = start_job(broker.url, tmp_path / policy, spec("hetero"), job=f"het-{policy}",
                        coordinator_args=["--policy", policy],
                        worker_args={1: ["--slowdown", "2.5"]}, final_state=False)
        shares[policy] = job.wait()
    cadence, sync = shares["cadence"], shares["sync"]
    ratio = cadence["batches"]["0"] / cadence["batches"]["1"]
    # El Che gives each rank work in proportion to its measured speed (ms per batch), which
    # is ~2.5x apart here, more when the machine is loaded: compare with what it measured
    ms = {r: cadence["compute_ms"][r] / cadence["batches"][r] for r in ("0", "1")}
    measured = ms["1"] / ms["0"]
    # (it moves counts in damped steps, so over a short run the split trails the speeds)
    assert ratio > 1.8, cadence["batches"]
    assert 0.5 * measured <= ratio <= 1.33 * measured, (cadence["batches"], ms)
    assert cadence["rounds"] * 10 < sync["rounds"]
    # sync: equal work, so the fast rank computes ~1/2.5 of the time and idles the rest
    assert sync["batches"]["0"] == sync["batches"]["1"]
    assert sync["compute_ms"]["0"] < 0.6 * sync["compute_ms"]["1"], sync["compute_ms"]


# (a cosine LR changes every batch: its updates ride along; a lone Batch goes out only when
# a window's closing batch finds nothing else held, which timing decides: the broker run,
# every report alone, carries it for certain)
TIMING = {"SyncAck", "Exiting", "NewNcclIdGenerated", "EvalResult", "CheckpointResult",
          "EpochFnElapsed", "Intent", "Reports", "Reports/Batch", "Reports/LrUpdate"}
# (on the collective path every window's plans ride in its SetGlobalStep broadcast; the
# broker path, and async's lookahead, still send a rank its own StartEpoch)
CONTROL = {"SyncNow", "RequestNewNcclId", "NewNcclSession", "SetGlobalStep",
           "Checkpoint", "ExecuteEvalCallback", "SetEpochCallbackRole", "Shutdown",
           "EpochAggregated", "EvalBroadcast", "SaveConsensusModel"}


# the broker run reports every batch alone (report_interval 0): the lone variants travel too
BROKER_TIMING = TIMING - {"NewNcclIdGenerated", "Reports", "Reports/Batch",
                          "Reports/LrUpdate"} | {"SnapshotReady", "LrUpdate", "Batch"}
BROKER_CONTROL = CONTROL - {"SyncNow", "RequestNewNcclId", "NewNcclSession"} | {
    "RequestParams", "Update", "StartEpoch"}


@pytest.mark.parametrize("backend", ["gloo", "broker"])
def test_callbacks_failover_and_every_variant_on_the_wire(broker: EmbeddedBroker,
                                                          tmp_path: Path, backend: str) -> None:
    """On the broker backend the callbacks that need the consensus wait for the round's
    Update and see the consensus, not the rank's live parameters."""
    cb = tmp_path / "cb"
    cb.mkdir()
    name = f"cbk-{backend}"
    with LiveTap(broker.url, name) as tap:
        job = start_job(broker.url, tmp_path, spec("callbacks"), job=name,
                        coordinator_args=["--backend", backend, *(
                            ["--knob", "report_interval=0"] if backend == "broker" else [])],
                        env={"CALLBACK_DIR": str(cb)})
        summary = job.wait()
    assert summary["ok"], summary
    messages = stream_messages(broker.url, name)
    seen = stream_types(messages)
    # a plan's metrics that its window's closing batch finished come after the SyncAck
    checked = [held_metrics(messages, r) for r in range(2)]
    assert all(held >= 1 for held, _ in checked), checked
    timing, control = (TIMING, CONTROL) if backend == "gloo" else (BROKER_TIMING,
                                                                   BROKER_CONTROL)
    assert {f"TimingMsg.{t}" for t in timing} <= set(seen), seen
    assert {f"ControlMsg.{t}" for t in control} <= set(seen), seen
    assert {"MetricsMsg", "JoinMsg.Hello", "AdmitMsg.Accept"} <= set(seen)
    assert tap.seen["TimingMsg.Heartbeat"] >= 2
    assert tap.seen["ControlMsg.CoordHeartbeat"] >= 1
    events = job.events()
    kinds = [e["event"] for e in events]
    # the first checkpoint failed and moved to the next rank, then all versions landed
    failed = [e for e in events if e["event"] == "checkpoint-failed"]
    assert len(failed) == 1
    assert failed[0]["version"] == 2
    assert "checkpoint-failover" in kinds
    assert {p.name for p in cb.glob("user-checkpoint-v*.pt")} == {
        "user-checkpoint-v2.pt", "user-checkpoint-v3.pt", "user-checkpoint-v4.pt"}
    # evals: epoch 1 (eval_every 2, and the intent from epoch_fn) and the last epoch
    assert [e["epoch"] for e in summary["eval"]] == [1, 3]
    fired = sorted(int(x) for f in cb.glob("epoch-fn-rank-*.txt")
                   for x in f.read_text().split())
    assert fired == [0, 1, 2, 3]  # once per epoch, cluster-wide
    assert "intent" in kinds
    assert (job.out / "consensus.safetensors").exists()
    assert summary["refused"] == {}
    assert summary["decode_rejections"] == {}
