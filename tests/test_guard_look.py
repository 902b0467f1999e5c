"""The orphan guard's look while the agent lives (agent/guard/orphan_guard.py `Orders.look`).

After its first look the guard reads only /proc's listing and the entries of the processes
started since the last look (a full scan of /proc twice a second cost ~0.5 % of a core on a
machine with 100 processes, and grows with every process on the node). These tests check that
the incremental look proves the same processes the job's as a full scan does, including an
orphan the agent (a child subreaper) adopted, and none of another process's new children.

The "agent" is a small standard-library script run as a subprocess: it makes itself a child
subreaper, as the agent does, and runs the guard's code by file path, as the guard does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import rally.agent.guard.orphan_guard as orphan_guard

AGENT = """
import ctypes, json, os, sys, time
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import orphan_guard as g

ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as the agent
read = []
real_row = g._row
def counted_row(pid):
    read.append(pid)
    return real_row(pid)
g._row = counted_row
me = os.getpid()
orders = g.Orders()
orders.look(me)  # the first look: every process
full = len(read)
print("looked", flush=True)
stranger = [int(p) for p in sys.stdin.readline().split()]  # started by the test: not below this process
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:  # the orphan: its parent exits at once, so this process adopts it
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        time.sleep(30)
        os._exit(0)
    os._exit(0)
os.wait()
orphan = int(os.read(r, 32))
before = orders.listed
del read[:]
orders.look(me)  # only the processes started since the first look
incremental = len(read)
reference = g.proven(g.processes(), me, set())  # a full scan, now
print(json.dumps({
    "full": full, "incremental": incremental, "orphan": orphan, "parent": g._row(orphan).ppid,
    "seen": {str(p): s for p, s in orders.seen.items()}, "reference": {str(p): s for p, s in reference.items()},
    "stranger_seen": [p for p in stranger if p in orders.seen], "new_listed": len(orders.listed - before),
}), flush=True)
os.kill(orphan, 9)
"""


# The guard's bookkeeping is plain code on /proc; a busy CPU changes none of it.
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_the_incremental_look_proves_what_a_full_scan_does(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    agent = subprocess.Popen(
        [sys.executable, str(script), orphan_guard.__file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stranger, found = None, {}
    try:
        assert agent.stdout is not None and agent.stdin is not None
        assert agent.stdout.readline().strip() == "looked"
        # A process started after the first look, with a child of its own: new, but not the job's.
        stranger = subprocess.Popen(
            ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert stranger.stdout is not None
        child = int(stranger.stdout.readline())
        agent.stdin.write(f"{stranger.pid} {child}\n")
        agent.stdin.flush()
        found = json.loads(agent.stdout.readline())
    finally:
        for process in (agent, stranger):
            if process is not None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        if found.get("orphan"):  # a session of its own: the agent's group kill does not reach it
            try:
                os.kill(found["orphan"], signal.SIGKILL)
            except ProcessLookupError:
                pass  # the agent script killed it already
    assert found["parent"] == agent.pid, "the orphan should have been adopted by the subreaper"
    assert str(found["orphan"]) in found["seen"], found
    assert found["stranger_seen"] == [], found
    # Everything a full scan proves the job's now, the incremental look proved too, with the same start time.
    missing = {p: s for p, s in found["reference"].items() if found["seen"].get(p) != s}
    assert not missing, found
    # It read the entries of fewer processes than the first look, which read them all.
    assert found["incremental"] < found["full"], found
