"""What the agent does after a round, as a table: `decide(round end, assignment, max_restarts)`
(agent/decide.py) is pure, so every case is one row, with no process and no store."""

from __future__ import annotations

import pytest

from rally.agent.decide import Exit, Reform, Restart, decide
from rally.rendezvous.base.records import Assignment, EndKind, RoundEnd


def assignment(restart_count: int) -> Assignment:
    return Assignment(
        round=restart_count + 2, group_rank=0, group_world_size=2, rank_offset=0, world_size=4,
        restart_count=restart_count, membership_changes=2, watch_rank=1, watch_host="n1", master_host="n0",
    )  # fmt: skip


def end(kind: EndKind, exit_status: int | None = None) -> RoundEnd:
    return RoundEnd(kind, f"{kind.value} on n1", "n1", {} if exit_status is None else {"exit_status": exit_status})


CASES = [
    # (how the round ended, restarts already spent, --max-restarts, what happens)
    pytest.param(end(EndKind.SUCCEEDED), 0, 0, Exit(0), id="success-exits-0"),
    pytest.param(end(EndKind.SUCCEEDED), 3, 3, Exit(0), id="success-after-the-last-restart-exits-0"),
    pytest.param(end(EndKind.WORKER_FAILED, 3), 0, 2, Restart(1), id="failure-with-budget-restarts"),
    pytest.param(end(EndKind.WORKER_FAILED, 3), 1, 2, Restart(2), id="failure-spends-the-last-restart"),
    pytest.param(
        end(EndKind.WORKER_FAILED, 3),
        2,
        2,
        Exit(3, gave_up=True),
        id="failure-without-budget-exits-with-the-workers-status",
    ),
    pytest.param(
        end(EndKind.WORKER_FAILED, 0), 0, 0, Exit(1, gave_up=True), id="failure-reporting-status-0-still-exits-non-zero"
    ),
    pytest.param(end(EndKind.WORKER_FAILED), 0, 0, Exit(1, gave_up=True), id="failure-without-a-status-exits-1"),
    pytest.param(end(EndKind.WORKER_HUNG, 1), 0, 1, Restart(1), id="hang-restarts-like-a-failure"),
    pytest.param(end(EndKind.WORKER_HUNG, 1), 1, 1, Exit(1, gave_up=True), id="hang-without-budget-gives-up"),
    pytest.param(end(EndKind.NODE_LOST), 0, 0, Reform(), id="node-lost-re-forms-for-free"),
    pytest.param(end(EndKind.NODE_LEFT), 5, 0, Reform(), id="node-left-re-forms-even-past-the-budget"),
    pytest.param(end(EndKind.NODE_JOINED), 0, 0, Reform(), id="node-joined-re-forms"),
    pytest.param(end(EndKind.PREEMPTED, 75), 0, 3, Exit(75), id="preemption-exits-75"),
    pytest.param(end(EndKind.ABORTED, 4), 0, 3, Exit(4), id="abort-exits-with-its-status"),
    pytest.param(end(EndKind.ABORTED), 0, 3, Exit(1), id="abort-without-a-status-exits-1"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("round_end", "spent", "max_restarts", "expected"), CASES)
def test_after_a_round(round_end: RoundEnd, spent: int, max_restarts: int, expected: object) -> None:
    assert decide(round_end, assignment(spent), max_restarts) == expected


@pytest.mark.timeout(10)
def test_every_way_a_round_can_end_is_in_the_table() -> None:
    covered = {case.values[0].kind for case in CASES}
    assert covered == set(EndKind)
