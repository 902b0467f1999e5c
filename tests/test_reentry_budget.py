"""When a failure may be recovered in-process (agent/rounds/reentry.py ReentryBudget): a pure rule
of times and checkpoint steps, tested without processes."""

from __future__ import annotations

import pytest

from rally.agent.rounds.reentry import BURST_LIMIT, BURST_SECONDS, ReentryBudget


@pytest.mark.timeout(10)
def test_fast_re_entries_without_progress_fall_back_after_the_limit() -> None:
    budget = ReentryBudget()
    now = 100.0
    for _ in range(BURST_LIMIT):  # the first, then BURST_LIMIT - 1 that came fast and stalled
        assert budget.refusal(5, now) is None
        budget.spent(5, now)
        now += 1.0
    assert budget.refusal(5, now) is not None  # the same step, again and again, fast: a loop


@pytest.mark.timeout(10)
@pytest.mark.parametrize("later, step", [(BURST_SECONDS + 1, 5), (1.0, 6)], ids=["slow", "progress"])
def test_progress_or_time_between_re_entries_resets_the_count(later: float, step: int) -> None:
    budget = ReentryBudget()
    now = 100.0
    for _ in range(BURST_LIMIT * 3):
        assert budget.refusal(step, now) is None
        budget.spent(step, now)
        now += later
        step += step - 5  # "progress": a newer step every time; "slow": the same step
