"""The worker's end of in-process restarts (agent/worker_side/restartable.py), against this test
as its agent: a real script in its own process calls `rally.job.run`, connects to the test's
socket (agent/base/reentry_wire.py, the test's pid as the agent's) and is told what rally's agent
tells it, with timings the agent cannot be made to produce on demand.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base import reentry_wire as wire
from support.helpers import clean_env, kill_group

SCRIPT = textwrap.dedent(
    """
    import time
    from rally import job

    entries = 0

    def train():
        global entries
        entries += 1
        print(f"entry {entries}", flush=True)
        if entries == 1:
            raise ValueError("the first entry fails")
        time.sleep(60)  # the second: until the agent's abort interrupts it

    job.run(train)
    """
)


class Agent:
    """The test's side of one worker's connection."""

    def __init__(self, tmp: Path) -> None:
        self.name = f"rally-test-reentry-{os.getpid()}-{os.urandom(4).hex()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(wire.address(self.name))
        self.listener.listen(1)
        script = tmp / "train.py"
        script.write_text(SCRIPT)
        env = clean_env(**{wire.SOCKET_ENV: self.name, wire.AGENT_PID_ENV: str(os.getpid()), "RANK": "0"})
        self.worker = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.listener.settimeout(30)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(30)

    def said(self, timeout: float = 30) -> dict:
        """The worker's next message; TimeoutError when it says nothing within `timeout`."""
        self.conn.settimeout(timeout)
        message = wire.decode(self.conn.recv(wire.MAX_MESSAGE))
        assert message is not None
        return message

    def tell(self, op: str, **fields: object) -> None:
        self.conn.send(wire.encode(op, **fields))

    def close(self) -> None:
        kill_group(self.worker.pid)
        self.worker.wait(10)
        self.conn.close()
        self.listener.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path)
    try:
        yield a
    finally:
        a.close()


@pytest.mark.timeout(60)
def test_an_abort_that_comes_right_after_enter_is_not_lost(agent: Agent) -> None:
    """The next round can end before a re-entered worker is back in its function (a peer that
    fails at once). Its abort was lost when it came between "enter" and the entry (the control
    thread saw no function to interrupt, and the entry began by forgetting the abort): the
    function ran on, and rally's agent killed the process after PARK_SECONDS (10 s) instead of
    re-entering it."""
    assert agent.said()["op"] == "failed"  # the first entry raised
    agent.tell("abort", round=0)
    parked = agent.said()
    assert parked["op"] == "parked" and parked["ok"], parked
    for round_no in range(1, 7):  # the race is lost only sometimes: six rounds, each a chance to lose it
        agent.tell("enter", round=round_no, env={"RALLY_ROUND": str(round_no)})
        agent.tell("abort", round=round_no)  # the round ended before the worker re-entered
        started = time.monotonic()
        parked = agent.said(timeout=5)
        assert parked["op"] == "parked" and parked["ok"], parked
        assert time.monotonic() - started < 5, "the worker left only when its function returned"


@pytest.mark.timeout(60)
def test_a_parked_worker_answers_the_abort_of_a_round_it_was_not_entered_in(agent: Agent) -> None:
    """A round can end while the agent forms it, before it sends the parked workers "enter"
    (another node lost while this one waits for the workers' store, the pre-flight leaving a
    node out): the agent then parks its workers again. A parked worker ignored that abort, so
    the agent waited PARK_SECONDS (10 s) for a "parked" that never came, killed every worker and
    restarted them all."""
    assert agent.said()["op"] == "failed"
    agent.tell("abort", round=0)
    assert agent.said()["op"] == "parked"
    agent.tell("abort", round=1)  # round 1 ended before its "enter"
    parked = agent.said(timeout=5)
    assert parked["op"] == "parked" and parked["ok"], parked
    agent.tell("enter", round=2, env={"RALLY_ROUND": "2"})  # and the worker still enters round 2
    time.sleep(0.5)  # in the function by now
    agent.tell("abort", round=2)
    parked = agent.said(timeout=5)
    assert parked["op"] == "parked" and parked["ok"], parked
