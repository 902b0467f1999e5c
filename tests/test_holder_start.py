"""The memory tier's holder starts beside the agent and is waited for where it is first used
(agent/checkpoint/node_checkpoints.py `StartingHolder`): the agent's constructor no longer waits
~0.1 s for the holder's 'ready' line on the way to the job's first round, and a holder that cannot
start still leaves the node without a memory tier with one line. Real holder processes, no torch."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core.client import SECRET_ENV
from rally.agent.checkpoint.node_checkpoints import MEMORY_LIMIT_ENV, NodeCheckpoints


# No timing in it: the order of what the agent sees (a warning only at the first use).
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_a_holder_that_cannot_start_is_found_out_at_its_first_use_not_in_the_constructor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "not-a-number")  # the holder exits as it starts
    lines: list[str] = []
    ckpt = NodeCheckpoints(None, EventLog(tmp_path / "events.jsonl"), warn=lines.append)
    pid = ckpt.pid
    assert pid is not None  # known at once: the agent never counts it as one of the job's processes
    assert lines == [], "the constructor waited for the holder"
    assert ckpt.memory_steps() == []  # the first use waits, and finds it gone
    assert len(lines) == 1 and "the in-memory checkpoint tier is off" in lines[0], lines
    assert ckpt.holder is None and ckpt.pid is None and ckpt.env() == {}
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert ckpt.exit() is None
    assert len(lines) == 1


# No timing in it: a started holder serves the calls the agent makes, whichever comes first.
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_a_started_holder_serves_its_first_use_as_before(tmp_path: Path) -> None:
    lines: list[str] = []
    ckpt = NodeCheckpoints(None, EventLog(tmp_path / "events.jsonl"), warn=lines.append)
    pid = ckpt.pid
    try:
        assert ckpt.env()[SECRET_ENV]  # the first use: waits until the holder listens
        assert ckpt.holder is not None and ckpt.pid == pid
        assert ckpt.memory_steps() == []
    finally:
        assert ckpt.exit() is None
    assert lines == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
