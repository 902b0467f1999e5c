"""What the store can hand rally's record parser (rendezvous/base/records.py): one bounded line, always.

A forger who reaches the store (no job token) can write any bytes under a record's key. Whatever
it wrote, StoredRecord.load answers with one UntrustedValue line of bounded length, never a
RecursionError traceback and never a line that repeats every field name it was sent.
"""

from __future__ import annotations

import json

import pytest

from rally.rendezvous.base.records import NodeInfo, RoundEnd
from rally.rendezvous.c10d.store import UntrustedValue

LINE_LIMIT = 400


def refusal(raw: str) -> str:
    with pytest.raises(UntrustedValue) as caught:
        NodeInfo.load(raw, "rally/job/0/node/3")
    line = str(caught.value)
    assert "\n" not in line and len(line) < LINE_LIMIT, line
    assert "store key 'rally/job/0/node/3' holds an invalid node descriptor" in line
    return line


# Bad input only: a busy CPU changes nothing here.
@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_a_value_nested_100000_deep_is_one_line_not_a_recursion_error() -> None:
    assert "nested too deeply" in refusal("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in refusal('{"node_id": ' + "[" * 100_000 + "]" * 100_000 + "}")


# Bad input only: a busy CPU changes nothing here.
@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_a_record_with_many_unknown_fields_names_a_few_in_one_bounded_line() -> None:
    fields = {f"field_{i:06d}_{'x' * 200}": i for i in range(100_000)}
    line = refusal(json.dumps(fields))
    assert "unknown fields 'field_000000_" in line and "and 99997 more" in line, line
    assert "missing fields 'addr', 'host', 'node_id' and" in line, line


# Bad input only: a busy CPU changes nothing here.
@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_a_huge_or_deep_field_value_is_shown_by_its_kind() -> None:
    end = json.loads(RoundEnd(kind="succeeded", detail="done").to_json())  # type: ignore[arg-type]
    with pytest.raises(UntrustedValue) as caught:
        RoundEnd.load(json.dumps({**end, "detail": [[[[1]]]] * 100_000}), "rally/job/0/end/1")
    assert "detail is a JSON array, not a string" in str(caught.value) and len(str(caught.value)) < LINE_LIMIT
