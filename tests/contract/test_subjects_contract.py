"""subjects.md and codecs/subjects.py state the same contract, in both directions."""

from __future__ import annotations

import re
from pathlib import Path

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.convert import VARIANTS
from ddpbus.codecs.tensor import TYPE_NAME as TENSOR_TYPE

DOC = Path(__file__).resolve().parents[2] / "subjects.md"


def _table(heading: str) -> list[list[str]]:
    """The rows of the first Markdown table under ``## heading``, cells unquoted."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    body = rows[2:]  # header and separator
    return [[c.strip().replace("`", "") for c in r.strip("|").split("|")] for r in body]


def test_subject_table_matches_constants() -> None:
    doc = {tuple(r) for r in _table("Subjects")}
    code = {(s.template, s.sender, s.receiver, s.message, s.storage,
             s.consumer.replace("`", "")) for s in sj.SUBJECTS}
    assert doc - code == set(), "in subjects.md but not in codecs/subjects.py"
    assert code - doc == set(), "in codecs/subjects.py but not in subjects.md"


def test_header_table_matches_constants() -> None:
    doc = {(r[0], r[2]) for r in _table("Headers")}
    code = {(h.name, h.checked) for h in sj.HEADERS}
    assert doc == code
    doc_values = {r[0]: r[1] for r in _table("Headers")}
    for h in sj.HEADERS:
        assert doc_values[h.name] == h.value.replace("`", "")


def test_every_message_type_has_a_subject_and_every_subject_a_type() -> None:
    types = {v.type_name for v in VARIANTS} | {TENSOR_TYPE}
    for t in types:
        assert any(s.allows(t) for s in sj.SUBJECTS), f"{t} has no subject"
    for s in sj.SUBJECTS:
        assert any(s.allows(t) for t in types), f"{s.template} carries no known type"


def test_stream_resources_in_doc_match_code() -> None:
    rows = {r[1]: r for r in _table("Stored resources")}
    assert sj.stream_name("<job>".replace("<job>", "J")) == "DDPBUS_J"
    assert "DDPBUS_<job>" in rows
    assert "ddpbus_<job>" in rows
    assert sj.kv_bucket("J") == "ddpbus_J"
    consumer_rows = {name for name, r in rows.items() if r[0] == "consumer"}
    assert consumer_rows == {sj.COORDINATOR_CONSUMER, "rank-<N>"}
    coord = rows[sj.COORDINATOR_CONSUMER][2]
    for f in sj.coordinator_filters("J"):
        assert f.removeprefix("ddpbus.J.") in coord
    rank = rows["rank-<N>"][2]
    for f in sj.rank_filters("J", 7):
        assert f.removeprefix("ddpbus.J.").replace(".7", ".<N>") in rank
    assert f"{int(sj.DUPLICATE_WINDOW.total_seconds() // 60)} min" in rows["DDPBUS_<job>"][2]


def test_stream_subjects_are_exactly_the_stored_ones() -> None:
    stored = {s.wildcard("J") for s in sj.SUBJECTS if s.storage == "stream"}
    assert set(sj.stream_subjects("J")) == stored
    for s in sj.SUBJECTS:
        if s.storage == "core":
            assert s.wildcard("J") not in sj.stream_subjects("J")


def test_templates_round_trip_through_parse_subject() -> None:
    for spec in sj.SUBJECTS:
        subject = spec.subject("job-1", 12 if spec.per_rank else None)
        parsed = sj.parse_subject(subject, "job-1")
        assert parsed.spec is spec
        assert parsed.rank == (12 if spec.per_rank else None)
        assert re.fullmatch(spec.template.replace(".", r"\.").replace("<job>", "job-1")
                            .replace("<N>", "12"), subject)
