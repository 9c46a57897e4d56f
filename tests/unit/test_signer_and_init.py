"""The hand-rolled fast paths equal the standard ones they replace."""

from __future__ import annotations

import dataclasses
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpbus.codecs import messages as m
from ddpbus.codecs.convert import VARIANTS
from ddpbus.codecs.envelope import Signer
from ddpbus.codecs.errors import BadSignature, EncodeError


@settings(max_examples=200, deadline=None)
@given(key=st.binary(min_size=16, max_size=200), payload=st.binary(max_size=300),
       gen=st.integers(0, 2**64).map(str))
def test_signer_is_rfc2104_hmac_sha256(key: bytes, payload: bytes, gen: str) -> None:
    fields = ("ddpbus.j.timing.rank.1", "TimingMsg.Batch", gen, "rank-1.g1.1",
              "application/protobuf")
    framed = ("\n".join((*fields, str(len(payload)))) + "\n").encode() + payload
    assert Signer(key).sign(*fields, payload) == hmac.new(key, framed, "sha256").hexdigest()


def test_signer_refuses_short_keys_and_newlines() -> None:
    with pytest.raises(EncodeError, match="at least 16"):
        Signer(b"short")
    with pytest.raises(BadSignature, match="newline"):
        Signer(b"k" * 16).sign("a", "b\nc", "1", "id", "application/json", b"")


def test_fast_init_keeps_dataclass_semantics() -> None:
    for variant in VARIANTS:
        cls = variant.cls
        assert dataclasses.is_dataclass(cls)
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert not hasattr(cls, "__dict__") or "__slots__" in cls.__dict__
    b = m.Batch(rank=1, batch_ms=2.0, data_ms=0.5, step_count=3)
    assert (b.param_norm, b.batch_loss, b.sync_divergence) == (None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.rank = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="step_count"):
        m.Batch(rank=1, batch_ms=2.0, data_ms=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        m.Batch(1, 2.0, 0.5, 3)  # type: ignore[misc]
    one = m.MetricsMsg(rank=0, epoch=0, avg_loss=0.0, batches_processed=0, epoch_ms=0.0,
                       samples_processed=0)
    two = m.MetricsMsg(rank=0, epoch=0, avg_loss=0.0, batches_processed=0, epoch_ms=0.0,
                       samples_processed=0)
    assert one == two
    assert one.scalars is not two.scalars  # a fresh default per instance
    assert dataclasses.replace(b, rank=7).rank == 7
    assert hash(m.EpochPlan(epoch=1, partition_offset=2, partition_size=3)) == hash(
        m.EpochPlan(epoch=1, partition_offset=2, partition_size=3))


def test_positional_maker_builds_what_the_constructor_builds() -> None:
    make = m.positional_maker(m.Batch)
    made = make(1, 2.0, 0.5, 3, None, 0.25, float("inf"))
    assert made == m.Batch(rank=1, batch_ms=2.0, data_ms=0.5, step_count=3, batch_loss=0.25,
                           sync_divergence=float("inf"))
    assert type(made) is m.Batch
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.rank = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        make(1, 2.0)
