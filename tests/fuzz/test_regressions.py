"""The crashes the fuzz campaign found, each pinned by its smallest input.

Before the fixes each of these raised something other than the decoder's documented
refusal: a tensor shape with thousands of dimensions (Python refused to print the byte
count), a contribution blob that does not unpack (the reducer's task died and its round
stayed "reducing" for good), lease values and bundle manifests with numbers no int or
float holds, nesting deeper than the JSON parser recurses, and bundle meta records whose
bad values only failed later: seeding the core, publishing SetGlobalStep, writing the next
bundle's meta or the run summary; and the coordinator core reading a rank from a control
message that reached its timing intake.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import fuzz_corpus as fc
import fuzz_states
import pytest
from fuzz_mutate import delimited, key, resigned, varint

from ddpbus.codecs import messages as m
from ddpbus.codecs import tensor
from ddpbus.codecs._pb import ddpbus_pb2 as pb
from ddpbus.codecs.envelope import Envelope
from ddpbus.codecs.errors import InvalidField
from ddpbus.orchestrator.core import bundle_meta
from ddpbus.orchestrator.core.state import Contribution, Joined, Metrics, Refuse, Timing
from ddpbus.orchestrator.core.transition import transition
from ddpbus.orchestrator.persist import bundles, lease, snapshot
from ddpbus.orchestrator.runtime.broker_reducer import Accumulator, ReduceError

# ------------------------------------------------------------------- tensor frames


def _frame_with_dims(dims: int) -> bytes:
    header = pb.TensorFrameHeader(name="w", dtype="float32", total_bytes=4,
                                  chunk_count=1).SerializeToString()
    header += delimited(3, varint(2**64 - 1) * dims)  # shape: packed u64s
    return len(header).to_bytes(4, "little") + header + bytes(4)


def test_a_frame_shape_of_a_thousand_dimensions_is_an_invalid_field() -> None:
    with pytest.raises(InvalidField, match="1000 dimensions, at most 64"):
        tensor.decode_frame(_frame_with_dims(1000))
    # through the envelope too, signed by a rank that holds the key
    seed = fc.seeds(tensor.TYPE_NAME)[0]
    got = fc.decode(fc.decoder(), resigned(fc.Inbound(seed.subject, seed.headers,
                                                      _frame_with_dims(1000))))
    assert not isinstance(got, Envelope)
    assert got.reason == "invalid-field"


def test_sixty_four_dimensions_still_decode_to_a_mismatch_not_a_crash() -> None:
    with pytest.raises(InvalidField, match="shape needs"):
        tensor.decode_frame(_frame_with_dims(tensor.MAX_DIMS))


# ------------------------------------------------------------------------ reducer


@pytest.mark.parametrize("blob", [b"\x01\x00\x00\x00\x00\x00\x00\x00", b"\xff" * 9,
                                  tensor.pack_tensors([("param.0", "float32", (1,),
                                                        bytes(4))]) * 2])
def test_a_contribution_that_does_not_unpack_is_a_reduce_error(blob: bytes) -> None:
    c = Contribution(rank=2, mass=1.0, step=1, digest="d", nbytes=len(blob))
    with pytest.raises(ReduceError, match="rank 2's contribution does not unpack"):
        Accumulator().add(c, blob)


# -------------------------------------------------------------------------- lease


@pytest.mark.parametrize("value", [
    b'{"holder": "h", "expires": 1' + b"0" * 400 + b"}",  # an int no float holds
    b"[" * 100_000,  # deeper than the JSON parser recurses
    b'{"holder": "h", "expires": NaN}', b'{"holder": "h", "expires": Infinity}',
    b'{"holder": "h", "expires": "-inf"}', b'["holder", "expires"]'])
def test_a_lease_value_that_does_not_read_counts_as_expired(value: bytes) -> None:
    assert lease.parse(value, 7) == lease.Holder("?", 0.0, 7)


def test_a_readable_lease_still_reads() -> None:
    assert lease.parse(b'{"holder": "h:1", "expires": 12}', 3) == lease.Holder("h:1", 12.0, 3)


# ------------------------------------------------------------------ coordinator core


@pytest.mark.parametrize("event", [
    Timing(m.Throttle(), "rank-3.g1.2"),  # the campaign's: a signed Throttle on control.rank.3
    Timing(m.Hello(rank=1, generation=1, host="h", device="cpu", model_signature=bytes(32),
                   world_size=4)),
    Metrics(m.Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=1)),  # type: ignore[arg-type]
    Joined(m.Reject(rank=0, generation=1, reason="full")),  # type: ignore[arg-type]
])
@pytest.mark.parametrize("phase", ["admitting", "training-sync-in-flight"])
def test_an_event_carrying_another_family_is_refused_and_changes_nothing(
        event: Any, phase: str) -> None:
    state = fuzz_states.fresh(phase)
    before = _frozen(state)
    _, out = transition(state, event, 1000.0)
    assert [c.reason for c in out if isinstance(c, Refuse)] == ["wrong-event"]
    assert len(out) == 1
    assert state.refusals.pop("wrong-event") == 1
    assert _frozen(state) == before  # not even its message id was recorded


def _frozen(state: Any) -> bytes:
    return snapshot.encode(snapshot.Snapshot(state=state, stream_seq=0, outbox=[],
                                             coordinator_generation=0, saved_at=0.0), fc.KEY)


# ----------------------------------------------------------------- bundle manifests


@pytest.fixture(scope="module")
def finishing() -> Any:
    return fuzz_states.fresh("finishing")


def _edited(raw: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    doc = json.loads(raw)
    edit(doc)
    return json.dumps(doc).encode()


def _meta(edit: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda doc: edit(doc["meta"])


MANIFESTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "version-infinity": (lambda d: d.update(version=math.inf), "manifest"),
    "seed-a-list": (_meta(lambda m: m.update(seed=[1])), "fits"),
    "epoch-infinity": (_meta(lambda m: m.update(epoch=math.inf)), "fits"),
    "coverage-epoch-infinity": (_meta(lambda m: m["coverage"][0].update(epoch=math.inf)),
                                "meta"),
    "coverage-epoch-a-list": (_meta(lambda m: m["coverage"][0].update(epoch=[0])), "meta"),
    # these passed the checks and failed later, in the running coordinator
    "elche-streak-infinity": (_meta(lambda m: m["elche"].update(stable_streak=math.inf)),
                              "meta"),  # seeding the core (ElChe.restore_state)
    "elche-calibrations-text": (_meta(lambda m: m["elche"].update(calibrations="x")), "meta"),
    "elche-ms-text": (_meta(lambda m: m["elche"]["smoothed_ms"].update({"0": "5"})), "meta"),
    "global-step-past-u64": (_meta(lambda m: m.update(global_step=2**64)), "meta"),  # publish
    "coverage-without-trained": (_meta(lambda m: m["coverage"][0].pop("trained")),
                                 "meta"),  # the run summary
    "coverage-gaps-nan": (_meta(lambda m: m["coverage"][0].update(gaps=[math.nan])),
                          "meta"),  # the next bundle's meta (allow_nan=False)
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_a_bad_manifest_is_a_bundle_error_where_it_is_read(case: str, finishing: Any) -> None:
    edit, stage = MANIFESTS[case]
    raw = _edited(fuzz_states.manifest(finishing), edit)
    assert fuzz_states.resume_from(raw, finishing) == f"refused-by-{stage}"


def test_a_manifest_nested_too_deep_is_a_bundle_error() -> None:
    with pytest.raises(bundles.BundleError, match="not a ddpbus bundle manifest"):
        bundles.Manifest.from_json(b"[" * 100_000, "deep")


def test_the_meta_a_run_writes_still_resumes(finishing: Any) -> None:
    assert fuzz_states.resume_from(fuzz_states.manifest(finishing), finishing) == "accepted"
    meta = copy.deepcopy(bundle_meta.meta(finishing, epoch=0))
    point = bundle_meta.point("here", 1, meta)
    assert point.elche["smoothed_ms"] == meta["elche"]["smoothed_ms"]
    assert point.coverage[0]["trained"] == meta["coverage"][0]["trained"]


def test_wire_helpers_write_what_protobuf_reads() -> None:
    msg = pb.TensorFrameHeader()
    msg.ParseFromString(key(3, 2) + varint(2) + varint(5) + varint(7))
    assert list(msg.shape) == [5, 7]


# ------------------------------------------------------- a worker's checkpoint readers


def _blob(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize("header", [
    b"[]",  # a header that is not a map
    b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the parser recurses
    json.dumps({"__metadata__": {"ddpbus": "[1, 2]"}}).encode(),  # meta not a record
    json.dumps({"__metadata__": {"ddpbus": "[" * 100_000}}).encode(),
    json.dumps({"__metadata__": ["not", "a", "map"]}).encode(),
], ids=["list-header", "deep-header", "meta-list", "deep-meta", "metadata-list"])
def test_an_optimizer_blob_that_does_not_read_is_a_checkpoint_error(header: bytes) -> None:
    import torch

    from ddpbus.worker_agent import checkpoint

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_optimizer_bytes(_blob(header), opt, "bundle v1 optim")
    assert opt.state_dict() == before


def test_a_model_file_with_unreadable_meta_is_a_checkpoint_error(tmp_path: Any) -> None:
    import torch
    from safetensors.torch import save_file

    from ddpbus.worker_agent import checkpoint

    for i, meta in enumerate(("[1]", "{" * 100_000, "not json")):
        path = tmp_path / f"m{i}.safetensors"
        save_file({"w": torch.zeros(2)}, str(path), metadata={"ddpbus": meta})
        with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
            checkpoint.read_meta(path)
