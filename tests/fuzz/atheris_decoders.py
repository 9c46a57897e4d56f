"""libFuzzer, through atheris, over the decoders the hypothesis campaign covers.

    python tests/fuzz/atheris_decoders.py -atheris_runs=N [-target=NAME] [-report=PATH]
                                          [libFuzzer flags] [CORPUS_DIR ...]

Targets: one per message family (``ControlMsg`` ... ``TensorFrame``: the input is a
payload, sent under the headers of one of the family's valid seed messages and, by a flag
byte, signed again with the job key so that it reaches the payload parser and the field
rules), ``TensorBlob`` (unpack, then the reducer's sum), ``Snapshot`` (a snapshot's JSON,
compressed and signed), ``BundleManifest`` (everything ``--resume`` does with a manifest),
``Lease``. With ``-target`` one of them is fuzzed, else all of them, the input's first byte
choosing which.
Without corpus directories, a seed corpus of valid inputs is written to a temporary one
(removed at exit).

The decoders are instrumented for coverage; an input that makes one raise anything but
its documented refusal is a crash: libFuzzer prints it, saves it and exits non-zero. At
exit the runs and outcomes per target are printed and, with ``-report``, added to that
JSON file under ``"atheris"`` (next to what the pytest campaign wrote there).
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "unit")]

with atheris.instrument_imports(include=["ddpbus"]):  # every ddpbus module loaded here
    import fuzz_corpus as fc
    import fuzz_states
    from fuzz_mutate import resigned

    from ddpbus.codecs import tensor
    from ddpbus.codecs.errors import DecodeError
    from ddpbus.orchestrator.persist import lease, snapshot
    from ddpbus.orchestrator.runtime import broker_reducer

Target = tuple[list[bytes], Callable[[bytes], str]]
_DECODER = fc.decoder()


def _family(family: str) -> Target:
    seeds = fc.seeds(family)

    def one(data: bytes) -> str:
        if len(data) < 2:
            return "short-input"
        base = seeds[data[0] % len(seeds)]
        x = fc.Inbound(base.subject, base.headers, data[2:])
        got = fc.decode(_DECODER, resigned(x) if data[1] & 1 else x)
        return fc.outcome(got)

    return [bytes([i, flag]) + s.payload for i, s in enumerate(seeds) for flag in (0, 1)], one


def _blob(data: bytes) -> str:
    try:
        tensor.unpack_tensors(data)
    except DecodeError as exc:
        fc.check_refusal(exc, data)
        outcome = exc.reason
    else:
        outcome = "accepted"
    acc = broker_reducer.Accumulator()
    c = broker_reducer.Contribution(rank=0, mass=1.0, step=1, digest="d", nbytes=len(data))
    try:
        acc.add(c, data)
        acc.consensus(version=1, bf16=False)
    except broker_reducer.ReduceError:
        return f"{outcome}/reduce-error"
    return f"{outcome}/reduced"


def _blob_seeds() -> list[bytes]:
    return [tensor.pack_tensors([("param.0", "float32", (2, 2), bytes(16)),
                                 ("buffers", "float32", (3,), bytes(12))], version=2),
            tensor.pack_tensors([("param.0", "bfloat16", (4,), bytes(8))])]


def _sealed(body: bytes) -> bytes:
    return snapshot.MAGIC + hmac.new(fc.KEY, body, hashlib.sha256).digest() + body


def _snapshot(data: bytes) -> str:
    """``data`` is the snapshot's JSON: compressed and signed here, so that libFuzzer's
    mutations reach the object rebuilding instead of failing zlib's checksum."""
    try:
        snapshot.decode(_sealed(zlib.compress(data, 1)), fc.KEY)
    except snapshot.SnapshotError as exc:
        return fuzz_states.snapshot_reason(exc)
    return "accepted"


def _snapshot_seeds() -> list[bytes]:
    out = []
    for phase in ("admitting", "forming"):
        snap = snapshot.Snapshot(state=fuzz_states.fresh(phase), stream_seq=3, outbox=[],
                                 coordinator_generation=2, saved_at=1.0)
        out.append(zlib.decompress(snapshot.encode(snap, fc.KEY)[len(snapshot.MAGIC) + 32:]))
    return out


_FINISHING = fuzz_states.fresh("finishing")


def _lease(data: bytes) -> str:
    holder = lease.parse(data, 1)
    if not isinstance(holder.holder, str) or not isinstance(holder.expires, float):
        raise fc.Crash(f"lease.parse made {holder!r} of {data!r}")
    return "unreadable" if holder.holder == "?" else "accepted"


def targets() -> dict[str, Target]:
    out = {family: _family(family) for family in fc.FAMILIES}
    out["TensorBlob"] = (_blob_seeds(), _blob)
    out["Snapshot"] = (_snapshot_seeds(), _snapshot)
    out["BundleManifest"] = ([fuzz_states.manifest(_FINISHING)],
                             lambda d: fuzz_states.resume_from(d, _FINISHING))
    out["Lease"] = ([json.dumps({"holder": "h:1", "expires": 12.5}).encode()], _lease)
    return out


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    ours = {"-target", "-report"}
    options = {}
    rest = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep and name in ours:
            options[name[1:]] = value
        else:
            rest.append(arg)
    return options, rest


def _report(tally: dict[str, Counter[str]], path: str | None) -> None:
    doc = {name: {"runs": c.total(), "outcomes": dict(c.most_common())}
           for name, c in tally.items() if c}
    for name, row in doc.items():
        print(f"atheris {name}: {row['runs']} runs {row['outcomes']}", file=sys.stderr)
    if path:
        out = Path(path)
        whole: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
        whole.setdefault("atheris", {}).update(doc)  # one run per target adds its own
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(whole, indent=2) + "\n")


def main(argv: list[str]) -> None:
    options, argv = _options(argv)
    table = targets()
    names = [options["target"]] if "target" in options else list(table)
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"unknown -target {sorted(unknown)}; one of {sorted(table)}")
    single = len(names) == 1
    tally: dict[str, Counter[str]] = {n: Counter() for n in names}
    atexit.register(_report, tally, options.get("report"))

    def one(data: bytes) -> None:
        if single:
            name, body = names[0], data
        elif data:
            name, body = names[data[0] % len(names)], data[1:]
        else:
            return
        tally[name][table[name][1](body)] += 1

    seeds = [seed if single else bytes([i]) + seed
             for i, name in enumerate(names) for seed in table[name][0]]
    if not any(not a.startswith("-") for a in argv[1:]):
        scratch = tempfile.TemporaryDirectory(prefix="ddpbus-atheris-")
        atexit.register(scratch.cleanup)
        corpus = Path(scratch.name)
        for j, seed in enumerate(seeds):
            (corpus / f"seed-{j}").write_bytes(seed)
        argv = [*argv, str(corpus)]
    if not any(a.startswith("-max_len=") for a in argv):  # room for the snapshot seeds
        argv = [*argv, f"-max_len={max(4096, *map(len, seeds))}"]
    atheris.Setup(argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
