"""Codec throughput: ddpbus payload codec, signed envelope and tensor frames vs baselines.

Every case is one encode *and* one decode, checked once for a faithful round trip:

- ``TimingMsg.Batch`` and ``ControlMsg.StartEpoch`` in ops/s: the payload codec alone
  (``convert.to_wire`` + serialize, parse + ``convert.from_wire``) and the full envelope
  (``Encoder.encode`` + ``Decoder.decode``: headers, HMAC sign and verify), each as
  protobuf and as JSON. Baseline: ``pickle`` of the same dataclass (a yardstick only).
- A 64 MiB float32 tensor in GB/s: one frame (``encode_frames`` -> ``decode_frame`` ->
  ``np.frombuffer``), 8 MiB chunks reassembled by ``TensorAssembler``, and those chunks
  through the signed envelope. Baselines: one ``bytes()`` copy (memcpy), ``pickle``.

The host is shared and noisy: a group's cases run interleaved, round after round; the
table shows medians over the rounds, and each ratio is the median of the per-round ratios
to the baseline of the same round. The two targets (docs/performance.md) print as PASS/FAIL;
the exit status is 0 either way (the bench is informational).

Run from the repository root: ``python bench/codec.py`` (writes bench/results/codec.json;
``--json PATH`` elsewhere); ``--quick`` is a smoke run (3 rounds, 8 MiB tensor, 1 MiB chunks).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from _results import record
from google.protobuf import json_format
from google.protobuf.internal import api_implementation

from ddpbus.codecs import convert, tensor
from ddpbus.codecs import messages as m
from ddpbus.codecs import subjects as sj
from ddpbus.codecs.envelope import Decoder, Encoder, to_json

JOB: Final = "bench"
KEY: Final = b"bench-job-key-0123456789abcdef"
RANK: Final = 3
MIB: Final = 1024 * 1024
DEFAULT_JSON: Final = Path(__file__).resolve().parent / "results" / "codec.json"
BATCH_TARGET_OPS: Final = 300_000
FRAME_TARGET_RATIO: Final = 0.5
TENSOR: Final = "tensor float32"
#: (group, message, subject, sender)
MESSAGES: Final[tuple[tuple[str, m.Message, str, str], ...]] = (
    ("TimingMsg.Batch",
     m.Batch(rank=RANK, batch_ms=12.5, data_ms=1.25, step_count=123_456, param_norm=4.5,
             batch_loss=0.6931, sync_divergence=0.001),
     sj.TIMING_RANK.subject(JOB, RANK), f"rank-{RANK}"),
    ("ControlMsg.StartEpoch",
     m.StartEpoch(plan=m.EpochPlan(epoch=7, partition_offset=1_000_000, partition_size=250_000)),
     sj.CONTROL_ALL.subject(JOB), sj.COORDINATOR),
)

Case = tuple[str, Callable[[], object]]  # (name, one encode+decode); the first is the baseline
Row = dict[str, Any]
F32Array = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int
    ops: int  # small-message encode+decode pairs per timed sample
    tensor_bytes: int
    chunk_bytes: int


def message_cases(msg: m.Message, subject: str, sender: str) -> list[Case]:
    def payload(as_json: bool) -> Callable[[], object]:
        def run() -> object:
            variant, wire = convert.to_wire(msg)
            back = variant.family()
            if as_json:
                json_format.Parse(to_json(wire).encode(), back, ignore_unknown_fields=True)
            else:
                back.ParseFromString(wire.SerializeToString())
            return convert.from_wire(variant, back)
        return run

    def envelope(as_json: bool) -> Callable[[], object]:
        enc = Encoder(job=JOB, key=KEY, sender=sender, generation=1, wire_json=as_json)
        dec = Decoder(job=JOB, key=KEY)

        def run() -> object:
            out = enc.encode(subject, msg)
            return dec.decode(out.subject, out.headers, out.payload).message
        return run

    return [
        ("pickle dumps+loads (baseline)", lambda: pickle.loads(pickle.dumps(msg))),
        ("payload codec protobuf", payload(False)),
        ("payload codec JSON", payload(True)),
        ("envelope protobuf (HMAC)", envelope(False)),
        ("envelope JSON (HMAC)", envelope(True)),
    ]


def assemble(chunks: Iterable[tensor.TensorChunk]) -> F32Array:
    it = iter(chunks)
    asm = tensor.TensorAssembler(next(it))
    for chunk in it:
        asm.add(chunk)
    if not asm.complete:
        raise RuntimeError("the tensor did not reassemble")
    return np.frombuffer(asm.buffer, dtype=np.float32).reshape(asm.shape)


def tensor_cases(s: Settings, arr: F32Array) -> list[Case]:
    shape: tuple[int, ...] = arr.shape
    view = arr.data.cast("B")
    subject = sj.DATA_RANK.subject(JOB, RANK)
    enc = Encoder(job=JOB, key=KEY, sender=f"rank-{RANK}", generation=1,
                  max_frame_payload=s.chunk_bytes)
    dec = Decoder(job=JOB, key=KEY, max_frame_payload=s.chunk_bytes)

    def frames(max_payload: int) -> Iterable[tensor.TensorChunk]:
        for payload in tensor.encode_frames("w", "float32", shape, view,
                                            max_payload=max_payload):
            yield tensor.decode_frame(payload)

    def single() -> object:
        (chunk,) = frames(s.tensor_bytes + 4096)  # one frame holds the whole tensor
        return np.frombuffer(chunk.data, dtype=np.float32).reshape(chunk.shape)

    def enveloped() -> Iterable[tensor.TensorChunk]:
        for out in enc.encode_tensor(subject, "w", "float32", shape, view):
            chunk = dec.decode(out.subject, out.headers, out.payload).message
            if not isinstance(chunk, tensor.TensorChunk):
                raise TypeError(f"expected a tensor chunk, got {type(chunk).__name__}")
            yield chunk

    return [  # wrapping the memcpy result in an ndarray is O(1): it makes the result checkable
        ("memcpy bytes(view) (baseline)", lambda: np.ndarray(shape, np.float32, bytes(view))),
        ("pickle dumps+loads ndarray", lambda: pickle.loads(pickle.dumps(arr, protocol=5))),
        ("frame single -> frombuffer", single),
        ("frames chunked + assembler", lambda: assemble(frames(s.chunk_bytes))),
        ("envelope chunked (HMAC)", lambda: assemble(enveloped())),
    ]


def sample(fn: Callable[[], object], ops: int) -> float:
    """Seconds for ``ops`` calls of ``fn`` (garbage collector paused, as timeit does)."""
    gc.collect()
    gc.disable()
    start = time.perf_counter()
    for _ in range(ops):
        fn()
    elapsed = time.perf_counter() - start
    gc.enable()
    return elapsed


def run_group(group: str, cases: list[Case], faithful: Callable[[object], bool], *,
              ops: int, scale: float, unit: str, rounds: int) -> list[Row]:
    """Interleave the cases round by round; rates are ``ops * scale / seconds``."""
    for name, fn in cases:
        if not faithful(fn()):  # correctness, and a warm-up
            raise RuntimeError(f"{group} / {name}: the round trip is not faithful")
    samples: list[list[float]] = [[] for _ in cases]
    ratios: list[list[float]] = [[] for _ in cases]
    for _ in range(rounds):
        rates = [ops * scale / sample(fn, ops) for _, fn in cases]
        for i, rate in enumerate(rates):
            samples[i].append(rate)
            ratios[i].append(rate / rates[0])
    return [{"group": group, "case": name, "unit": unit, "baseline": cases[0][0],
             "median": statistics.median(rs), "ratio": statistics.median(qs), "samples": rs}
            for (name, _), rs, qs in zip(cases, samples, ratios, strict=True)]


def targets(rows: list[Row]) -> list[Row]:
    """The two targets (docs/performance.md), each followed by its envelope counterpart for
    reference (``is_target`` False: the envelope adds headers and HMAC, the targets do not
    cover it)."""
    by = {(r["group"], r["case"]): r for r in rows}
    checks = (("TimingMsg.Batch", "payload codec protobuf", "median", BATCH_TARGET_OPS, True),
              ("TimingMsg.Batch", "envelope protobuf (HMAC)", "median", BATCH_TARGET_OPS, False),
              (TENSOR, "frame single -> frombuffer", "ratio", FRAME_TARGET_RATIO, True),
              (TENSOR, "envelope chunked (HMAC)", "ratio", FRAME_TARGET_RATIO, False))
    return [{"name": f"{g} {c}, {'ops/s' if key == 'median' else 'ratio vs memcpy'}",
             "value": by[g, c][key], "target": goal, "is_target": is_target,
             "pass": by[g, c][key] >= goal} for g, c, key, goal, is_target in checks]


def print_report(header: str, rows: list[Row], checks: list[Row]) -> None:
    print(header + "\n")
    print(f"{'group':<22} {'case':<34} {'median':>10} {'unit':<5} {'spread':>6} "
          f"{'ratio':>7}  vs baseline")
    for r in rows:
        spread = (max(r["samples"]) - min(r["samples"])) / r["median"]
        value = f"{r['median']:,.0f}" if r["unit"] == "ops/s" else f"{r['median']:.2f}"
        print(f"{r['group']:<22} {r['case']:<34} {value:>10} {r['unit']:<5} {spread:>6.0%} "
              f"{r['ratio']:>6.3f}x  {r['baseline'].removesuffix(' (baseline)')}")
    print()
    for c in checks:
        fmt = "{:,.0f}" if c["target"] > 1 else "{:.3f}"
        value, goal = fmt.format(c["value"]), fmt.format(c["target"])
        if c["is_target"]:
            print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['name']}: {value} (target >= {goal})")
        else:
            print(f"info  {c['name']}: {value} ({'above' if c['pass'] else 'below'} {goal}; "
                  "not a target: includes headers + HMAC)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (for tests)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"where to write the JSON report (default {DEFAULT_JSON})")
    args = parser.parse_args()
    s = (Settings(rounds=3, ops=200, tensor_bytes=8 * MIB, chunk_bytes=1 * MIB) if args.quick
         else Settings(rounds=11, ops=5_000, tensor_bytes=64 * MIB, chunk_bytes=8 * MIB))
    started = time.perf_counter()
    rows: list[Row] = []
    for group, msg, subject, sender in MESSAGES:
        rows += run_group(group, message_cases(msg, subject, sender), msg.__eq__, ops=s.ops,
                          scale=1.0, unit="ops/s", rounds=s.rounds)
    arr = np.random.default_rng(0).random(s.tensor_bytes // 4, np.float32).reshape(-1, 1024)

    def same_array(x: object) -> bool:
        return isinstance(x, np.ndarray) and bool(np.array_equal(x, arr))
    rows += run_group(TENSOR, tensor_cases(s, arr), same_array, ops=1,
                      scale=s.tensor_bytes / 1e9, unit="GB/s", rounds=s.rounds)
    checks = targets(rows)
    env = {"python": platform.python_version(), "numpy": np.__version__,
           "protobuf_backend": api_implementation.Type(), "cpus": os.cpu_count()}
    print_report(f"ddpbus codec bench{' (quick)' if args.quick else ''}: {s.rounds} rounds, "
                 f"{s.ops} ops/sample, tensor {s.tensor_bytes // MIB} MiB, chunks "
                 f"{s.chunk_bytes // MIB} MiB, " + ", ".join(f"{k} {v}" for k, v in env.items()),
                 rows, checks)
    elapsed = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"quick": args.quick, "settings": asdict(s), **env, "wall_s": elapsed,
              "results": rows, "targets": checks}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwall time {elapsed:.1f} s; JSON written to {args.json}")
    record("codec-quick" if args.quick else "codec", report,
           {f"{r['group']} {r['case']} {r['unit']}": r["median"] for r in rows}
           | {f"{c['name']} (target {c['target']:g})": c["value"] for c in checks}, args.json)


if __name__ == "__main__":
    main()
