"""Every decoder of the envelope, fuzzed per message family.

Two kinds of mutated message start from a valid signed one of every variant:

- *raw*: mutated and left with the signature it had. Nothing a forger without the key can
  do gets a new meaning through: each one is refused before its payload is read (subject,
  size cap, headers, type, signature), or, when the mutation only touched what the
  signature does not cover, decodes to exactly the original.
- *re-signed*: mutated, then signed again with the job key (a rank that holds the key and
  sends garbage). These reach the payload parser and the field rules: each one is decoded
  into a message that keeps the protocol's rules, or refused with a documented reason.

Never any other exception. The outcomes are tallied per family for the campaign report.
"""

from __future__ import annotations

import random
from collections import Counter

import fuzz_corpus as fc
import pytest
from fuzz_mutate import Mutator, resigned
from hypothesis import given
from hypothesis import strategies as st

from ddpbus.codecs import convert, tensor
from ddpbus.codecs import messages as m
from ddpbus.codecs.envelope import Envelope
from ddpbus.codecs.errors import DecodeError

B = fc.BUDGET
SEEDS = st.integers(0, 2**64 - 1)
#: Reasons only a message past the signature can earn (its payload was read).
AFTER_SIGNATURE = fc.REASONS - fc.BEFORE_PAYLOAD


def _donors(family: str) -> tuple[fc.Inbound, ...]:
    """Payloads to splice in: every other family's seeds, then this family's."""
    return tuple(x for other, x in fc.every_seed() if other != family) + fc.seeds(family)


def _check_accepted(env: Envelope, x: fc.Inbound) -> None:
    """What a decoded message promises its receiver."""
    assert env.subject == x.subject
    assert env.msg_type == x.headers["Ddpbus-Type"]
    assert env.generation >= fc.FLOOR
    if env.msg_type == tensor.TYPE_NAME:
        chunk = env.message
        assert isinstance(chunk, tensor.TensorChunk)
        assert chunk.chunk_index < chunk.chunk_count
        assert chunk.chunk_offset + chunk.data.nbytes <= chunk.total_bytes
        return
    msg = env.message
    assert type(msg) is convert.BY_TYPE[env.msg_type].cls
    if env.rank is not None and not env.kind.startswith(("control", "live.coordinator")):
        inner = msg.hello if isinstance(msg, m.Rejoin) else msg
        assert getattr(inner, "rank", env.rank) == env.rank
    convert.to_wire(msg)  # what was accepted can be sent on (no asymmetric rule)


@pytest.mark.parametrize("family", fc.FAMILIES)
def test_raw_mutations_never_get_past_the_signature(family: str) -> None:
    dec = fc.decoder()
    seen: Counter[str] = Counter()
    donors = _donors(family)

    @B.settings()
    @given(base=fc.inbound(family), seed=SEEDS)
    def run(base: fc.Inbound, seed: int) -> None:
        original = fc.decode(dec, base)
        assert isinstance(original, Envelope), original
        meaning = fc.fingerprint(original)
        mutator = Mutator(random.Random(seed), donors)
        for _ in range(B.per_example):
            x = mutator.mutate(base, resign=False)
            got = fc.decode(dec, x)
            seen[fc.outcome(got)] += 1
            if isinstance(got, DecodeError):
                assert got.reason in fc.BEFORE_PAYLOAD, (got, fc.shown(x))
            else:  # only what the signature does not cover changed
                assert fc.fingerprint(got) == meaning, fc.shown(x)

    run()
    fc.TALLY.add(family, "raw", seen)
    assert seen.total() >= B.payloads
    assert seen["bad-signature"] > seen.total() // 10


@pytest.mark.parametrize("family", fc.FAMILIES)
def test_resigned_mutations_decode_or_are_refused_with_a_reason(family: str) -> None:
    dec = fc.decoder()
    seen: Counter[str] = Counter()
    donors = _donors(family)

    @B.settings()
    @given(base=fc.inbound(family), seed=SEEDS)
    def run(base: fc.Inbound, seed: int) -> None:
        mutator = Mutator(random.Random(seed), donors)
        for _ in range(B.per_example):
            x = mutator.mutate(base, resign=True)
            got = fc.decode(dec, x)
            seen[fc.outcome(got)] += 1
            if isinstance(got, Envelope):
                _check_accepted(got, x)

    run()
    fc.TALLY.add(family, "resigned", seen)
    assert seen.total() >= B.payloads
    # the re-signed ones reach the payload: some decode, some are refused for what they hold
    fc.reached(seen, "accepted")
    assert any(seen[r] for r in AFTER_SIGNATURE), seen


@pytest.mark.parametrize(("family", "x"), list(fc.every_seed()))
def test_every_seed_decodes_and_a_forgery_of_it_does_not(family: str, x: fc.Inbound) -> None:
    dec = fc.decoder()
    assert isinstance(fc.decode(dec, x), Envelope), family
    forged = fc.decode(dec, resigned(x, fc.OTHER_KEY))
    assert isinstance(forged, DecodeError)
    assert forged.reason == "bad-signature"
