"""The decoders of what the broker stores, fuzzed: tensor blobs and the reducer that sums
them, tensor frames and their assembly, coordinator snapshots, bundle manifests (through
everything a resumed coordinator does with one), the leader lease.

Each has one way to refuse: blobs and frames a :class:`DecodeError` (the reducer a
:class:`ReduceError`), snapshots a :class:`SnapshotError`, manifests a
:class:`BundleError`; the lease reader never refuses (an unreadable lease counts as
expired). Anything else raised is a crash. Outcomes are tallied per family.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import random
import zlib
from collections import Counter
from typing import Any

import fuzz_corpus as fc
import fuzz_states
import numpy as np
import pytest
from fuzz_mutate import Mutator
from hypothesis import given
from hypothesis import strategies as st

from ddpbus.codecs import tensor
from ddpbus.codecs.errors import DecodeError
from ddpbus.orchestrator.core.state import (
    Contribution,
)
from ddpbus.orchestrator.persist import lease, snapshot
from ddpbus.orchestrator.runtime.broker_reducer import Accumulator, ReduceError

B = fc.BUDGET
SEEDS = st.integers(0, 2**64 - 1)
FLOATING = ("float32", "float64", "float16", "bfloat16")


def _probe(what: object, call: Any, refusals: tuple[type[Exception], ...]) -> Any:
    """``call()``, or the refusal it raised; any other exception is a :class:`fc.Crash`."""
    try:
        return call()
    except refusals as exc:
        if isinstance(exc, DecodeError):
            fc.check_refusal(exc, what)
        elif not str(exc):
            raise fc.Crash(f"a refusal without a reason: {exc!r} of {fc.shown(what)}") from exc
        return exc
    except Exception as exc:
        raise fc.Crash(f"{type(exc).__name__}: {exc} on {fc.shown(what)}") from exc


# ------------------------------------------------------------------ tensor blobs


@st.composite
def _blob(draw: st.DrawFn) -> bytes:
    names = ["param.0", *draw(st.lists(st.sampled_from(["param.1", "param.2", "buffers"]),
                                       unique=True, max_size=2))]
    tensors = []
    for name in names:
        dtype = draw(st.sampled_from(FLOATING)) if name != "buffers" else "float32"
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=2)))
        size = tensor.DTYPE_SIZES[dtype] * math.prod(shape)
        tensors.append((name, dtype, shape, draw(st.binary(min_size=size, max_size=size))))
    return tensor.pack_tensors(tensors, version=draw(st.integers(0, 9)))


def _mutate_blob(mutator: Mutator, blob: bytes) -> bytes:
    rng = mutator.rng
    roll = rng.random()
    if roll < 0.35 and len(blob) > 12:  # a hostile header inside the first frame
        size = int.from_bytes(blob[:8], "little")
        frame = mutator.frame(blob[8:8 + size])
        return len(frame).to_bytes(8, "little") + frame + blob[8 + size:]
    if roll < 0.5 and len(blob) >= 8:  # the first frame's length
        size = rng.choice((0, 1, 7, len(blob), 2**63, 2**64 - 1, int.from_bytes(
            blob[:8], "little") + rng.choice((-1, 1))))
        return (size % 2**64).to_bytes(8, "little") + blob[8:]
    if roll < 0.6:  # a frame twice, or two blobs back to back
        return blob + blob[:rng.randrange(len(blob) + 1)]
    return mutator.bytes(blob)


def _reduce_twice(blob: bytes) -> str:
    """Sum ``blob`` twice the way the reducer sums stored contributions (whatever they
    hold: the digest only proves it is what the rank announced), then build the consensus,
    which must unpack again. A refusal is a ReduceError (the round then fails cleanly)."""
    acc = Accumulator()
    c = Contribution(rank=0, mass=2.0, step=1, digest="d", nbytes=len(blob))
    with np.errstate(all="ignore"):  # garbage floats overflow: that is the data's own doing
        for _ in range(2):
            if isinstance(_probe(blob, lambda: acc.add(c, blob), (ReduceError,)), Exception):
                return "reducer-refused"
        out = _probe(blob, lambda: acc.consensus(version=1, bf16=False), (ReduceError,))
    if isinstance(out, Exception):
        return "reducer-refused"
    assert set(tensor.unpack_tensors(out)) == set(acc.layout)
    return "reduced"


def test_tensor_blobs_and_the_reducer() -> None:
    seen: Counter[str] = Counter()
    reduced: Counter[str] = Counter()

    @B.settings()
    @given(blob=_blob(), seed=SEEDS)
    def run(blob: bytes, seed: int) -> None:
        assert _reduce_twice(blob) == "reduced"
        mutator = Mutator(random.Random(seed))
        for _ in range(B.per_example):
            x = _mutate_blob(mutator, blob)
            got = _probe(x, lambda x=x: tensor.unpack_tensors(x), (DecodeError,))
            reducer = _reduce_twice(x)
            if isinstance(got, DecodeError):
                seen[got.reason] += 1
                assert reducer == "reducer-refused"
                continue
            assert all(c.chunk_count == 1 and c.data.nbytes == c.total_bytes
                       for c in got.values())
            seen["accepted"] += 1
            reduced[reducer] += 1

    run()
    fc.TALLY.add("TensorBlob", "unpack", seen)
    fc.TALLY.add("Reducer", "contributions", Counter(
        {"accepted": reduced["reduced"], "reduce-error": seen.total() - reduced["reduced"]}))
    assert seen.total() >= B.payloads
    fc.reached(seen, "accepted", "malformed", "invalid-field")
    fc.reached(reduced, "reduced", "reducer-refused")


# ------------------------------------------------------------ frames, assembled


@st.composite
def _chunks(draw: st.DrawFn) -> list[bytes]:
    dtype = draw(st.sampled_from(sorted(tensor.DTYPE_SIZES)))
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 3)))
    size = tensor.DTYPE_SIZES[dtype] * math.prod(shape)
    data = draw(st.binary(min_size=size, max_size=size))
    return list(tensor.encode_frames("w", dtype, shape, data, version=3,
                                     max_payload=draw(st.sampled_from([64, 96, 4096]))))


def test_tensor_frames_decoded_and_assembled() -> None:
    seen: Counter[str] = Counter()

    @B.settings()
    @given(frames=_chunks(), seed=SEEDS)
    def run(frames: list[bytes], seed: int) -> None:
        mutator = Mutator(random.Random(seed))
        rng = mutator.rng
        for _ in range(-(-B.per_example // len(frames))):
            mutated = [mutator.frame(f) if rng.random() < 0.5 else mutator.bytes(f)
                       if rng.random() < 0.3 else f for f in frames]
            rng.shuffle(mutated)
            mutated += rng.sample(mutated, rng.randrange(2))  # a chunk twice
            assembler: tensor.TensorAssembler | None = None
            for frame in mutated:
                got = _probe(frame, lambda f=frame: tensor.decode_frame(f), (DecodeError,))
                if isinstance(got, DecodeError):
                    seen[got.reason] += 1
                    continue
                if assembler is None:
                    first = _probe(frame, lambda c=got: tensor.TensorAssembler(c),
                                   (DecodeError,))
                    if isinstance(first, DecodeError):
                        seen[first.reason] += 1
                    else:
                        assembler = first
                        seen["accepted"] += 1
                    continue
                done = _probe(frame, lambda c=got, a=assembler: a.add(c), (DecodeError,))
                seen[done.reason if isinstance(done, DecodeError) else "accepted"] += 1
            if assembler is not None and assembler.complete:  # what it says it holds
                assert len(assembler.buffer) == tensor.DTYPE_SIZES[assembler.dtype] * \
                    math.prod(assembler.shape)

    run()
    fc.TALLY.add(tensor.TYPE_NAME, "decode+assemble", seen)
    assert seen.total() >= B.payloads
    fc.reached(seen, "accepted", "invalid-field", "malformed")


# -------------------------------------------------------------------- snapshots

SNAPSHOT_PHASES = ("admitting", "forming", "broker-round")  # small states: fast to rebuild


def _sealed(body: bytes) -> bytes:
    return snapshot.MAGIC + hmac.new(fc.KEY, body, hashlib.sha256).digest() + body


def _mutate_snapshot(mutator: Mutator, data: bytes, resign: bool) -> bytes:
    if not resign:
        return mutator.bytes(data)
    body = data[len(snapshot.MAGIC) + 32:]
    if mutator.rng.random() < 0.6:  # a signed snapshot whose JSON says something else
        text = mutator.json(zlib.decompress(body))
        return _sealed(zlib.compress(text, 1))
    return _sealed(mutator.bytes(body))


@pytest.mark.parametrize("kind", ["raw", "resigned"])
def test_snapshots(kind: str) -> None:
    seen: Counter[str] = Counter()
    bases = {p: snapshot.encode(snapshot.Snapshot(
        state=fuzz_states.fresh(p), stream_seq=7, outbox=[], coordinator_generation=2,
        saved_at=1.0), fc.KEY) for p in SNAPSHOT_PHASES}
    slow = 4 if kind == "resigned" else 1  # a signed one is rebuilt: fewer per example

    @B.settings(examples=-(-B.payloads * slow // B.per_example))
    @given(phase=st.sampled_from(SNAPSHOT_PHASES), seed=SEEDS)
    def run(phase: str, seed: int) -> None:
        mutator = Mutator(random.Random(seed))
        for _ in range(B.per_example // slow):
            x = _mutate_snapshot(mutator, bases[phase], kind == "resigned")
            got = _probe(x, lambda x=x: snapshot.decode(x, fc.KEY), (snapshot.SnapshotError,))
            if isinstance(got, Exception):
                seen[fuzz_states.snapshot_reason(got)] += 1
            else:
                assert kind == "resigned" or x == bases[phase]
                seen["accepted"] += 1

    run()
    fc.TALLY.add("Snapshot", kind, seen)
    assert seen.total() >= B.payloads
    if kind == "raw":
        assert set(seen) <= {"accepted", "bad-signature", "magic"}
    else:
        fc.reached(seen, "does-not-load", "accepted")


# ------------------------------------------------------------- bundle manifests

def test_bundle_manifests_through_a_resumed_core() -> None:
    seen: Counter[str] = Counter()
    state = fuzz_states.fresh("finishing")
    base = fuzz_states.manifest(state)
    assert fuzz_states.resume_from(base, state) == "accepted"
    slow = 2  # each accepted one seeds a core

    @B.settings(examples=-(-B.payloads * slow // B.per_example))
    @given(seed=SEEDS)
    def run(seed: int) -> None:
        mutator = Mutator(random.Random(seed))
        for _ in range(B.per_example // slow):
            raw = base
            for _ in range(mutator.rng.choice((1, 1, 2, 3))):
                raw = mutator.json(raw) if mutator.rng.random() < 0.8 else mutator.bytes(raw)
            seen[fuzz_states.resume_from(raw, state)] += 1

    run()
    fc.TALLY.add("BundleManifest", "parse+resume", seen)
    assert seen.total() >= B.payloads
    fc.reached(seen, "accepted", *(f"refused-by-{s}" for s in fuzz_states.STAGES))


# ------------------------------------------------------------------------ lease


def test_lease_values() -> None:
    seen: Counter[str] = Counter()
    base = json.dumps({"holder": "host:123", "expires": 1234.5}).encode()

    @B.settings()
    @given(seed=SEEDS)
    def run(seed: int) -> None:
        mutator = Mutator(random.Random(seed))
        for _ in range(B.per_example):
            raw = base
            for _ in range(mutator.rng.choice((1, 1, 2))):
                raw = mutator.json(raw) if mutator.rng.random() < 0.7 else mutator.bytes(raw)
            holder = _probe(raw, lambda raw=raw: lease.parse(raw, 5), ())
            assert isinstance(holder.holder, str)
            assert isinstance(holder.expires, float)
            assert holder.revision == 5
            unreadable = holder.holder == "?" and holder.expires == 0.0
            seen["unreadable" if unreadable else "accepted"] += 1

    run()
    fc.TALLY.add("Lease", "parse", seen)
    assert seen.total() >= B.payloads
    fc.reached(seen, "accepted", "unreadable")
