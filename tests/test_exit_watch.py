"""Workers that never end after they are done are caught with no flag (agent/observe/exit_watch.py):
a rally.job.run worker alive long after its function returned is stopped and the job succeeds; a
plain script's rank alive long after every other rank exited 0 is reported once and waited for.

The stuck exit is a non-daemon thread that sleeps: the interpreter waits for it at exit, idle,
as a rank waits in torch's process-group destructor at exit (torch-free, so cheap and exact).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from rally.agent.observe.exit_watch import SHARE_OF_HANG_BOUND, Clock
from rally.agent.observe.hang_watch import IDLE_SHARE
from support.agents import AgentProcess, c10d_args, start_agent, stop_all, write_script
from support.helpers import (  # noqa: F401 - procs is a fixture
    ProcessTracker,
    clean_env,
    free_port,
    is_alive,
    procs,
    read_events,
    survivors,
    wait_for,
)
from support.live_rally import LiveRally

# --hang-report-after for these tests: the watch's bound is half of it (5 s instead of 30 s).
HANG_REPORT_AFTER = 10
BOUND = HANG_REPORT_AFTER * SHARE_OF_HANG_BOUND
FOREVER = 3600

# After its work, each rank in LINGER leaves a non-daemon thread behind for that many seconds: its
# interpreter waits for it at exit. The other ranks exit at once.
STUCK_AFTER = """
import os, threading, time
from rally import job

def train():
    print("trained", flush=True)
    return 0

def left_behind_by_a_data_loader(seconds):
    time.sleep(seconds)

RUN
linger = LINGER.get(int(os.environ["RANK"]))
if linger:  # not a daemon: the exit waits for it
    threading.Thread(target=left_behind_by_a_data_loader, args=(linger,)).start()
print("done", flush=True)
"""


def _start(tmp_path: Path, procs: ProcessTracker, linger: dict[int, float], restartable: bool) -> LiveRally:
    body = STUCK_AFTER.replace("LINGER", repr(linger)).replace("RUN", "job.run(train)" if restartable else "train()")
    script = write_script(tmp_path, "w.py", body)
    nproc = str(max(linger) + 1)
    args = ["--standalone", "--nproc-per-node", nproc, "--log-dir", str(tmp_path / "logs")]
    args += ["--hang-report-after", str(HANG_REPORT_AFTER), "--shutdown-timeout", "5", str(script)]
    return LiveRally(args, tmp_path, clean_env(COLUMNS="250"), procs)


def _pids(tmp_path: Path) -> dict[int, int]:
    return {e["rank"]: e["pid"] for e in read_events(tmp_path / "logs") if e["event"] == "worker_started"}


@pytest.mark.timeout(120)
def test_a_job_run_worker_alive_long_after_its_function_returned_is_stopped_and_the_job_succeeds(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    """Rank 1's function returned, but its process never exits (a thread left behind, as a gloo
    group's destructor hangs at exit). Within the bound after its return (5 s here, half of
    --hang-report-after) rally says where it is stuck, with its stacks, stops it and the job exits
    0: its function succeeded. Before this, the job never ended."""
    job = _start(tmp_path, procs, {1: FOREVER}, restartable=True)
    job.wait_line("[1] done", 60)
    returned_at = time.monotonic()
    job.wait_line("after its training function returned", BOUND + 30)
    code, ended_at = job.wait_exit(60)
    text = job.text()
    assert code == 0, text[-3000:]
    assert ended_at - returned_at < BOUND + 30, text[-3000:]
    (line,) = [line for line in text.splitlines() if "after its training function returned" in line]
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) on \S+ is still alive \d+ s after", line), line
    assert "it is stuck in _shutdown (threading.py:" in line and "so does the job" in line, line
    assert re.search(r'File "[^"]*w\.py", line \d+ in left_behind_by_a_data_loader', text), text[-3000:]
    assert "job succeeded" in text and "root cause" not in text, text[-3000:]
    pid = _pids(tmp_path)[1]
    assert not is_alive(pid)
    events = read_events(tmp_path / "logs")
    (stuck,) = [e for e in events if e["event"] == "stuck_after_return"]
    assert stuck["rank"] == 1 and stuck["pid"] == pid and stuck["where"].startswith("_shutdown"), stuck
    assert [e["outcome"] for e in events if e["event"] == "job_end"] == ["succeeded"]
    (report_path,) = (tmp_path / "logs").glob("*/report.json")
    report = json.loads(report_path.read_text())
    assert [s["rank"] for s in report["stuck_at_exit"]] == [1]
    assert [w["state"] for w in report["attempts"][-1]["workers"]] == ["succeeded", "succeeded"], report


@pytest.mark.timeout(120)
def test_a_plain_scripts_rank_alive_long_after_every_other_rank_exited_is_reported_once_and_waited_for(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    """The same rank in a script without rally.job.run: rally cannot tell a stuck exit from work
    done alone (rank 0 uploading the model), so it says once where the rank is, with its stacks,
    and the job waits for it as torchrun's does. Counted from the last other rank's exit (rank 2
    lingers 2 s), not the first's."""
    job = _start(tmp_path, procs, {1: FOREVER, 2: 2}, restartable=False)
    job.wait_line("after every other rank exited 0", BOUND + 40)
    time.sleep(BOUND + 3)  # long enough for a second report, which must not come
    text = job.text()
    assert job.proc.poll() is None, text[-3000:]  # the job waits
    (line,) = [line for line in text.splitlines() if "after every other rank exited 0" in line]
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) on \S+ is still running \d+ s after", line), line
    assert "it is in _shutdown (threading.py:" in line and "--silence-timeout" in line, line
    assert re.search(r'File "[^"]*w\.py", line \d+ in left_behind_by_a_data_loader', text), text[-3000:]
    pid = _pids(tmp_path)[1]
    procs.track(pid)
    assert is_alive(pid)
    events = read_events(tmp_path / "logs")
    (said,) = [e for e in events if e["event"] == "alive_after_peers"]
    assert said["rank"] == 1 and said["pid"] == pid, said
    (last_exit,) = [e["time"] for e in events if e["event"] == "worker_exited" and e["rank"] == 2]
    assert said["time"] - last_exit >= BOUND - 0.5, (said, last_exit)
    os.kill(job.proc.pid, signal.SIGTERM)  # the test ends it: the agent stops its workers
    code, _ = job.wait_exit(60)
    assert code == 128 + signal.SIGTERM and not survivors([pid], 10), job.text()[-2000:]


@pytest.mark.timeout(120)
def test_a_rank_that_ends_slowly_but_within_the_bound_is_left_alone_while_a_stuck_one_is_stopped(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    """Every function returns at once; rank 1 then takes 2 s to exit (under the 5 s bound), rank 2
    never exits: only rank 2 is named and stopped, rank 1 exits 0 by itself, and the job succeeds."""
    job = _start(tmp_path, procs, {1: 2, 2: FOREVER}, restartable=True)
    code, _ = job.wait_exit(90)
    text = job.text()
    assert code == 0, text[-3000:]
    assert "job succeeded" in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if "after its training function returned" in line]
    assert line.startswith("rank 2 (local rank 2,") or "rally: warning: rank 2 (local rank 2," in line, line
    events = read_events(tmp_path / "logs")
    assert [e["rank"] for e in events if e["event"] == "stuck_after_return"] == [2], events
    exits = {e["rank"]: e["returncode"] for e in events if e["event"] == "worker_exited"}
    assert exits[1] == 0 and exits[0] == 0 and exits[2] == -signal.SIGTERM, exits


TRAINS_LONGER_ON_RANK_1 = """
import os, threading, time
from rally import job

def train():
    if os.environ["RANK"] == "1":
        time.sleep(TRAIN)  # rank 1 trains on after rank 0's function returned
    print("trained", flush=True)

def left_behind_by_a_data_loader():
    time.sleep(3600)

RUN
if os.environ["RANK"] == "0":
    threading.Thread(target=left_behind_by_a_data_loader).start()  # not a daemon: the exit waits for it
print("done", flush=True)
"""


def _two_nodes(tmp_path: Path, train: float, run: str) -> tuple[list[Path], list[AgentProcess]]:
    """Two agents of one c10d job, one worker each, running TRAINS_LONGER_ON_RANK_1; their log directories."""
    body = TRAINS_LONGER_ON_RANK_1.replace("TRAIN", str(train)).replace("RUN", run)
    script = write_script(tmp_path, "w.py", body)
    args = [*c10d_args(free_port(), "2"), "--nproc-per-node", "1", "--hang-report-after", str(HANG_REPORT_AFTER)]
    logs = [tmp_path / f"logs{i}" for i in range(2)]
    return logs, [
        start_agent(f"n{i}", tmp_path, [*args, "--log-dir", str(log), str(script)]) for i, log in enumerate(logs)
    ]


@pytest.mark.timeout(150)
def test_on_several_nodes_a_returned_rank_is_stopped_only_once_every_node_is_done(tmp_path: Path) -> None:
    """Two nodes: rank 0's function returns at once and its process never exits, while rank 1 on the
    other node trains for twice the bound. Rank 0 is left alone until rank 1 is done too (the other
    node's signed `done` mark says so), then stopped; both nodes exit 0."""
    train = 2 * BOUND
    logs, agents = _two_nodes(tmp_path, train, "job.run(train)")
    try:
        codes = [agent.wait(120) for agent in agents]
        outputs = "\n".join(agent.output() for agent in agents)
        assert codes == [0, 0], outputs[-4000:]
        events = [e for log in logs for e in read_events(log)]
        (stuck,) = [e for e in events if e["event"] == "stuck_after_return"]
        assert stuck["rank"] == 0, stuck
        (rank_1_exit,) = [e["time"] for e in events if e["event"] == "worker_exited" and e["rank"] == 1]
        assert stuck["time"] >= rank_1_exit and stuck["seconds"] >= train - 2, (stuck, rank_1_exit)  # start skew
        assert [e["outcome"] for e in events if e["event"] == "job_end"] == ["succeeded", "succeeded"], outputs
    finally:
        stop_all(agents)


@pytest.mark.timeout(150)
def test_on_several_nodes_a_plain_rank_is_reported_only_once_every_other_node_exited_0(tmp_path: Path) -> None:
    """The plain script on two nodes: rank 0 never exits, rank 1 on the other node trains for twice
    the bound. Rank 0, alone on its node from the start, is reported a bound after rank 1's exit on
    the other node, and both agents still wait."""
    logs, agents = _two_nodes(tmp_path, 2 * BOUND, "train()")
    try:

        def reported() -> list[dict]:
            return [e for log in logs for e in read_events(log) if e["event"] == "alive_after_peers"]

        (said,) = wait_for(reported, 90, what="the report", show=lambda: "\n".join(a.output() for a in agents))
        events = [e for log in logs for e in read_events(log)]
        (rank_1_exit,) = [e["time"] for e in events if e["event"] == "worker_exited" and e["rank"] == 1]
        assert said["rank"] == 0 and said["time"] - rank_1_exit >= BOUND - 0.5, (said, rank_1_exit)
        assert [a.popen.poll() for a in agents] == [None, None]
    finally:
        stop_all(agents)


@pytest.mark.timeout(10)
def test_a_rank_that_works_after_it_is_done_is_not_stuck_and_its_clock_starts_again() -> None:
    """The watch's clock (agent/observe/exit_watch.py): due once the bound passed with the rank idle
    (a stuck exit waits on a lock or a socket); a rank that used more than IDLE_SHARE of a core
    meanwhile is working (an upload, a last save) and is timed again from now; no CPU reading (the
    process went away) leaves it to the bound alone."""
    assert not Clock(100.0, 5.0).due(30.0, 129.0, 5.0)  # the bound has not passed
    assert Clock(100.0, 5.0).due(30.0, 130.0, 5.0 + IDLE_SHARE * 30.0)  # idle enough
    busy = Clock(100.0, 5.0)
    assert not busy.due(30.0, 130.0, 5.0 + IDLE_SHARE * 30.0 + 1.0)
    assert (busy.since, busy.cpu, busy.started) == (130.0, 5.0 + IDLE_SHARE * 30.0 + 1.0, 100.0)
    assert busy.due(30.0, 160.0, busy.cpu)  # idle from then on: due a bound later
    assert Clock(100.0, None).due(30.0, 130.0, 9.0) and Clock(100.0, 5.0).due(30.0, 130.0, None)
