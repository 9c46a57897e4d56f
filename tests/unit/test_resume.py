"""Resume bundles in the pure core: the meta written at each epoch boundary, a run seeded
from it, and the refusals (simulated cohort, fake clock)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from cluster_sim import Sim
from core_harness import Core, hello, records
from rich.console import Console

from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core import bundle_meta
from ddpbus.orchestrator.core.config import schedule_from
from ddpbus.orchestrator.core.elche import ElChe
from ddpbus.orchestrator.core.state import Joined
from ddpbus.orchestrator.core.summary import summarize
from ddpbus.orchestrator.persist import bundles
from ddpbus.orchestrator.tools.progress import final_table
from ddpbus.worker_agent import checkpoint

BATCH, DATASET, EPOCHS = 8, 2400, 4
PER_EPOCH = DATASET // BATCH


def sim(epochs: int = EPOCHS, speeds: tuple[float, ...] = (2.0, 3.0, 4.0),
        point: Any = None, **knobs: Any) -> Sim:
    schedule = schedule_from({"policy": "cadence", "batch_size": BATCH, "epochs": epochs,
                              **knobs})
    return Sim(schedule, speeds, dataset_size=DATASET, resume=point)


def saved(s: Sim) -> list[m.SaveConsensusModel]:
    return [msg for _, _, msg in s.sent if isinstance(msg, m.SaveConsensusModel)]


def test_every_epoch_boundary_writes_a_bundle_whose_meta_proves_its_epochs() -> None:
    s = sim()
    s.run()
    metas = [json.loads(msg.bundle_meta) for msg in saved(s)]
    assert [msg.version for msg in saved(s)] == [1, 2, 3, 4]
    assert [meta["reason"] for meta in metas] == ["epoch-boundary"] * 3 + ["final"]
    assert summarize(s.state)["last_bundle"] == 4
    steps = [meta["global_step"] for meta in metas]
    assert steps == sorted(steps)
    assert steps[0] > 0
    assert steps[-1] == s.state.global_step
    for version, meta in enumerate(metas, start=1):
        assert meta["epoch"] == version
        assert [c["epoch"] for c in meta["coverage"]] == list(range(version))
        assert all(c["exact"] and c["trained"] == PER_EPOCH for c in meta["coverage"])
        assert (meta["seed"], meta["batch_size"], meta["dataset_size"]) == (42, BATCH, DATASET)
        assert meta["world_size"] == 3
        assert set(meta["elche"]["smoothed_ms"]) == {"0", "1", "2"}


def test_bundle_every_zero_keeps_only_the_final_one() -> None:
    s = sim(bundle_every=0)
    s.run()
    assert [msg.version for msg in saved(s)] == [EPOCHS]


def _point(s: Sim, version: int) -> Any:
    [msg] = [x for x in saved(s) if x.version == version]
    return bundle_meta.point(f"test v{version}", version, json.loads(msg.bundle_meta))


def test_a_resumed_run_trains_only_the_later_epochs_and_proves_the_whole_run() -> None:
    first = sim()
    first.run()
    point = _point(first, 2)
    second = sim(point=point)
    second.run()
    trained = Counter((e, b) for _, _, e, b in second.batch_log)
    assert {e for e, _ in trained} == {2, 3}
    assert second.consensus == Counter({(e, b): 1 for e in (2, 3) for b in range(PER_EPOCH)})
    summary = summarize(second.state)
    assert summary["coverage"]["exact"], summary["coverage"]
    assert summary["coverage"]["resumed_epochs"] == 2
    assert summary["coverage"]["batches"] == EPOCHS * PER_EPOCH
    assert summary["resumed_from"]["epoch"] == 2
    # the global step and averaging rounds continue; El Che starts calibrated
    first_window = next(msg for _, _, msg in second.sent if isinstance(msg, m.SetGlobalStep))
    assert first_window.global_step == point.global_step
    assert second.state.rounds > point.rounds
    assert second.state.elche.calibrations > point.elche["calibrations"]
    assert summary["epochs"] == 2  # aggregated by this run
    assert [e.epoch for e in second.state.aggregated] == [2, 3]
    assert summary["loss_epochs"] == [2, 3]  # the loss list says which epochs it holds
    # the final table counts the whole run
    console = Console(record=True, width=120)
    console.print(final_table(summary))
    rows = {line.split()[0]: line for line in console.export_text().splitlines() if line}
    assert f"{EPOCHS}/{EPOCHS} (2 of them resumed from a bundle)" in rows["epochs"], rows
    # a bundle written by the resumed run carries the whole run's proof
    last = json.loads(saved(second)[-1].bundle_meta)
    assert [c["epoch"] for c in last["coverage"]] == [0, 1, 2, 3]


def test_a_resume_may_change_the_world_size() -> None:
    first = sim()
    first.run()
    point = _point(first, 1)
    second = sim(speeds=(2.0, 3.0), point=point)
    assert second.state.elche.anchor == point.elche["anchor"]
    assert second.state.elche.calibrations == 0  # per-rank speeds are measured afresh
    second.run()
    assert summarize(second.state)["coverage"]["exact"]


def test_the_elche_state_round_trips() -> None:
    a = ElChe(range(3), anchor=10, min_anchor=1, max_anchor=200, overhead_target=0.1)
    a.anchor, a.calibrations, a.anchor_rank = 37, 6, 2
    for r, ms in enumerate((2.0, 3.0, 4.0)):
        a._readings[r].append(ms)
    a.counts = {0: 74, 1: 49, 2: 37}
    b = ElChe(range(3), anchor=10, min_anchor=1, max_anchor=200, overhead_target=0.1)
    assert b.restore_state(json.loads(json.dumps(a.export_state())))
    assert (b.anchor, b.calibrations, b.anchor_rank, b.counts) == (37, 6, 2, a.counts)
    assert [b.smoothed_ms(r) for r in range(3)] == [2.0, 3.0, 4.0]


@pytest.mark.parametrize(("change", "why"), [
    (lambda d: d.pop("global_step"), "malformed"),
    (lambda d: d.update(epoch="two"), "malformed"),
    (lambda d: d.update(elche={"anchor": "big"}), "malformed"),
    (lambda d: d["coverage"].pop(), "coverage"),
    (lambda d: d["coverage"][0].update(exact=False), "coverage"),
    (lambda d: d["coverage"][1].update(epoch=0), "coverage"),
])
def test_a_bad_meta_is_refused(change: Any, why: str) -> None:
    first = sim(epochs=3)
    first.run()
    meta = json.loads(saved(first)[1].bundle_meta)
    change(meta)
    with pytest.raises(bundles.BundleError, match=why):
        bundle_meta.point("bad", 2, meta)


def _manifest(**meta: Any) -> bundles.Manifest:
    return bundles.Manifest(job="old", version=2, store={"kind": "dir", "path": "/x"},
                            parts={}, meta={"epoch": 2, "seed": 42, "batch_size": 8, **meta})


@pytest.mark.parametrize(("meta", "run", "why"), [
    ({"seed": 7}, {}, "seed 7"),
    ({"batch_size": 16}, {}, "batch_size 16"),
    ({}, {"epochs": 2}, "raise --epochs"),
])
def test_a_bundle_that_does_not_fit_the_run_is_refused(meta: dict[str, Any],
                                                       run: dict[str, Any], why: str) -> None:
    settings = {"seed": 42, "batch_size": 8, "epochs": 5} | run
    with pytest.raises(bundles.BundleError, match=why):
        bundles.check_fits(_manifest(**meta), **settings)
    bundles.check_fits(_manifest(), seed=42, batch_size=8, epochs=5)


def test_a_rank_with_another_dataset_size_is_rejected_by_a_resumed_run() -> None:
    first = sim(epochs=2)
    first.run()
    core = Core(world=2, epochs=4)
    core.state.config = type(core.state.config)(
        schedule=core.state.config.schedule, world_size=2, resume=_point(first, 1))
    out = core.feed(Joined(hello(0, dataset=DATASET + 8)))
    rejects = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Reject)]
    assert rejects, out
    assert "resumed bundle" in rejects[0].reason
    assert not records(out, "rank-admitted")


# ------------------------------------------------------------------ storage


@pytest.mark.parametrize("raw", [b"", b"{}", b"[1]", b'{"schema_version": 99, "job": "j", '
                                 b'"version": 1, "store": {"kind": "dir"}, "parts": '
                                 b'{"model": {}, "optim": {}}, "meta": {}}',
                                 b'{"schema_version": 1, "job": "j", "version": 1, "store": '
                                 b'{"kind": "ftp"}, "parts": {"model": {}, "optim": {}}, '
                                 b'"meta": {}}'])
def test_a_bad_manifest_is_refused(raw: bytes) -> None:
    with pytest.raises(bundles.BundleError):
        bundles.Manifest.from_json(raw, "test")


def _blobs() -> tuple[dict[str, bytes], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return ({"model": checkpoint.model_bytes(model, {"v": 1}),
             "optim": checkpoint.optimizer_bytes(opt, {"v": 1})}, model, opt)


def test_a_directory_bundle_round_trips_and_a_tampered_one_is_refused(tmp_path: Path) -> None:
    blobs, model, opt = _blobs()
    written = bundles._write_directory(tmp_path, "old", 3, blobs, {"epoch": 3})
    bundles._point_latest(tmp_path, written)  # what write() does once KV committed it
    for source in (tmp_path, tmp_path / "v3", tmp_path.parent / tmp_path.name):
        found = bundles.read_directory(source)
        assert found == written
    got = asyncio.run(bundles.read_blobs(None, found))  # type: ignore[arg-type]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    checkpoint.load_model_bytes(got["model"], fresh, "v3")
    checkpoint.load_optimizer_bytes(got["optim"], fresh_opt, "v3")
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                       fresh_opt.state_dict()["state"][0]["momentum_buffer"])
    path = tmp_path / "v3" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(bundles.BundleError, match="digest"):
        asyncio.run(bundles.read_blobs(None, found))  # type: ignore[arg-type]
    with pytest.raises(bundles.BundleError, match="holds no bundle"):
        bundles.read_directory(tmp_path / "v3" / "nothing")


def test_a_blob_for_another_model_or_garbage_is_a_clear_error() -> None:
    blobs, _, _ = _blobs()
    other = torch.nn.Linear(4, 2)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model"):
        checkpoint.load_model_bytes(blobs["model"], other, "v1")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load_model_bytes(b"\x00garbage", other, "v1")
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_optimizer_bytes(blobs["optim"],
                                        torch.optim.SGD(other.parameters(), lr=0.1), "v1")
