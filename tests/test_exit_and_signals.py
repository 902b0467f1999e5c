"""Specification: rally's exit status, its root-cause report, restarts, and signals.

    all workers exit 0                      -> rally exits 0
    a worker exits N (no restarts left)     -> rally exits N; stderr names the rank, pid, "exit code N"
                                               and shows the worker's last stderr lines
    a worker dies of signal S               -> rally exits 128+S and names the signal
    --max-restarts K                        -> the whole group restarts; TORCHELASTIC_RESTART_COUNT counts
    SIGTERM/SIGINT/SIGHUP to rally          -> the same signal reaches every worker's process group,
                                               rally exits 128+S, and no worker or grandchild survives
    a worker that ignores the signal        -> SIGKILLed after --shutdown-timeout
    SIGKILL of rally itself                 -> workers and grandchildren are gone within 2 s

Workers here are plain Python (no torch) except the one @record test. Every process a test
learns about is tracked by pid and SIGKILLed at teardown if it is somehow still alive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from support.helpers import (
    ProcessTracker,
    Result,
    clean_env,
    describe_pids,
    finish,
    is_alive,
    procs,  # noqa: F401 - a fixture
    run_probe,
    start_rally,
    survivors,
    wait_for,
    write_probe,
)


def run_body(tmp_path: Path, body: str, *flags: str, nproc: int = 1, timeout: float = 90) -> Result:
    """`body` as the workers' script, probe.py, under rally with these flags."""
    write_probe(tmp_path / "probe.py", body)
    return run_probe(tmp_path, [*flags, "probe.py"], nproc=nproc, timeout=timeout)


def after_root_cause(stderr: str) -> str:
    """rally's report from the 'root cause' line on (the worker's own console lines come before it)."""
    index = stderr.find("root cause")
    assert index >= 0, f"no root cause in rally's stderr:\n{stderr[-4000:]}"
    return stderr[index:]


# Exit 0 with no root cause when every worker succeeds was a job of its own here (two workers
# printing a line): tests/test_logs.py's run_two_streams checks it on each of its jobs (two workers
# in most of them), in the main pass and in the parity pass.


FAIL_WITH_7 = """
    import os, sys, time
    open(os.path.join(os.environ["PROBE_OUT"], "pid_" + os.environ["RANK"]), "w").write(str(os.getpid()))
    if os.environ["RANK"] == "1":
        for i in range(30):
            print(f"stderr line {i} before the failure", file=sys.stderr)
        print("ValueError: the actual reason", file=sys.stderr)
        sys.exit(7)
    time.sleep(60)
"""


@pytest.mark.timeout(120)
def test_worker_exit_code_becomes_rallys_and_the_report_names_rank_pid_and_last_stderr_lines(tmp_path: Path) -> None:
    result = run_body(tmp_path, FAIL_WITH_7, "--max-restarts", "0", nproc=2)
    assert result.returncode == 7, result.describe()
    pid = (tmp_path / "out" / "pid_1").read_text()
    report = after_root_cause(result.stderr)
    first = report.splitlines()[0]
    assert re.search(r"\brank 1\b", first), first
    assert f"pid {pid}" in first, first
    assert "exit code 7" in first, first
    assert "ValueError: the actual reason" in report
    assert "stderr line 29 before the failure" in report, "the last stderr lines are shown"
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_worker_killed_by_sigkill_makes_rally_exit_137_naming_the_signal(tmp_path: Path) -> None:
    body = """
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """
    result = run_body(tmp_path, body, "--max-restarts", "0")
    assert result.returncode == 128 + signal.SIGKILL, result.describe()
    assert "SIGKILL" in after_root_cause(result.stderr)


# Same start either way: the script imports torch, so rally's default is the template already.
@pytest.mark.same_start_either_way
@pytest.mark.torch
@pytest.mark.timeout(120)
def test_traceback_from_the_record_error_file_is_the_root_cause(tmp_path: Path) -> None:
    # The worker's own stderr shows no traceback (its excepthook is silenced), so the
    # traceback in rally's report can only come from the error file that @record wrote.
    body = """
        import sys
        from torch.distributed.elastic.multiprocessing.errors import record

        sys.excepthook = lambda *args: print("worker stderr: no traceback here", file=sys.stderr)

        def load_shard(name):
            raise KeyError(f"shard {name} is missing from the index")

        @record
        def main():
            load_shard("shard-0042")

        main()
    """
    result = run_body(tmp_path, body, "--max-restarts", "0")
    assert result.returncode == 1, result.describe()
    report = after_root_cause(result.stderr)
    assert "shard-0042 is missing from the index" in report, result.describe()
    assert "in load_shard" in report, "the report holds the traceback, frames included"


RESTART_TWICE = """
    import os, sys, time
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(os.environ["PROBE_OUT"], "seen_" + os.environ["RANK"]), "a") as f:
        f.write(count + "\\n")
    if count in ("0", "1"):
        if os.environ["RANK"] == "1":
            # Fail only once rank 0 has recorded this round: which worker starts first must not
            # decide what the test sees (a round stopped before rank 0's first line loses its entry).
            seen_0 = os.path.join(os.environ["PROBE_OUT"], "seen_0")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if os.path.exists(seen_0) and len(open(seen_0).read().split()) > int(count):
                    break
                time.sleep(0.01)
            sys.exit(3)
        time.sleep(60)  # rank 0 is healthy; rally stops it for the restart
"""


@pytest.mark.timeout(150)
def test_max_restarts_restarts_the_whole_group_until_it_succeeds(tmp_path: Path) -> None:
    result = run_body(tmp_path, RESTART_TWICE, "--max-restarts", "2", "--shutdown-timeout", "5", nproc=2, timeout=120)
    assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        assert (tmp_path / "out" / f"seen_{rank}").read_text().split() == ["0", "1", "2"]


# Not in the parity pass (.ci/run): its worker starts as test_max_restarts_restarts_...'s do (the
# default pipes, a fork per round); the budget is the agent's, and a forked worker's own exit code
# reaching rally is test_worker_exit_code_becomes_rallys_...'s, which that pass runs.
@pytest.mark.same_start_as_a_sibling
@pytest.mark.timeout(120)
def test_a_failure_with_no_restarts_left_ends_the_job(tmp_path: Path) -> None:
    body = """
        import os, sys
        with open(os.path.join(os.environ["PROBE_OUT"], "seen"), "a") as f:
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
        sys.exit(5)
    """
    result = run_body(tmp_path, body, "--max-restarts", "1")
    assert result.returncode == 5, result.describe()
    assert (tmp_path / "out" / "seen").read_text().split() == ["0", "1"]


# A worker that records its pid, starts a grandchild `sleep 600` (same process group) and
# records that pid, then waits; on a signal it records the signal number and dies of it.
SIGNAL_PROBE = """
    import os, signal, subprocess, time
    out, rank = os.environ["PROBE_OUT"], os.environ["RANK"]
    IGNORE = os.environ.get("PROBE_IGNORE_SIGTERM") == "1"

    def record(signum, frame):
        with open(os.path.join(out, f"signal_{rank}"), "w") as f:
            f.write(str(signum))
        if not IGNORE:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, record)
    if IGNORE:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild too
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(out, f"pids_{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(os.path.join(out, f"pids_{rank}.tmp"), os.path.join(out, f"pids_{rank}"))
    while True:
        time.sleep(1)
"""


def start_signal_job(tmp_path: Path, procs: ProcessTracker, *flags: str, nproc: int = 2, ignore_sigterm: bool = False):
    """Start rally with SIGNAL_PROBE workers; return (rally process, worker pids, grandchild pids)."""
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", SIGNAL_PROBE)
    env = clean_env(PROBE_OUT=str(out), PROBE_IGNORE_SIGTERM="1" if ignore_sigterm else "0")
    rally = start_rally(["--standalone", "--nproc-per-node", str(nproc), *flags, "probe.py"], cwd=tmp_path, env=env)
    procs.track_group(rally.pid)
    files = [out / f"pids_{rank}" for rank in range(nproc)]
    try:
        wait_for(lambda: all(f.exists() for f in files), timeout=60, what="every worker to record its pids")
    except BaseException:
        if rally.poll() is not None:
            print(finish(rally, 5).describe())
        raise
    pairs = [tuple(int(x) for x in f.read_text().split()) for f in files]
    workers, grandchildren = [p[0] for p in pairs], [p[1] for p in pairs]
    procs.track(*workers, *grandchildren)
    assert all(is_alive(pid) for pid in workers + grandchildren)
    return rally, workers, grandchildren


SHUTDOWN_TIMEOUT = 10


# The parity pass (.ci/run) runs only SIGTERM: the workers of the three start alike (the probe sets
# its own handler for each of the three signals), and only the signal the agent forwards differs;
# that a forked worker's dispositions and signal mask are a plain start's is test_template.py's
# test_signals_the_agent_ignores_or_blocks_at_spawn_time_are_inherited_as_by_a_plain_start.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGTERM,
        pytest.param(signal.SIGINT, marks=pytest.mark.same_start_as_a_sibling),
        pytest.param(signal.SIGHUP, marks=pytest.mark.same_start_as_a_sibling),
    ],
    ids=lambda s: s.name,
)
def test_signal_to_rally_is_forwarded_to_workers_and_nothing_survives(
    tmp_path: Path, procs: ProcessTracker, signum: signal.Signals
) -> None:
    rally, workers, grandchildren = start_signal_job(
        tmp_path, procs, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--log-dir", str(tmp_path / "logs")
    )
    helpers = [p.pid for p in psutil.Process(rally.pid).children() if p.pid not in workers]
    sent = time.monotonic()
    os.kill(rally.pid, signum)
    result = finish(rally, timeout=SHUTDOWN_TIMEOUT + 20, started=sent)
    assert result.returncode == 128 + signum, result.describe()
    # a closing line, and report.json lists the workers as they were stopped (main: no line, "workers": [])
    (report_path,) = (tmp_path / "logs").glob("*/report.json")
    closing = f"rally: stopped by {signum.name}: all 2 workers on this node stopped; exit code {128 + signum}; report: "
    assert closing + str(report_path) in result.stderr, result.describe()
    report = json.loads(report_path.read_text())
    assert report["outcome"] == f"stopped by {signum.name}" and report["exit_code"] == 128 + signum, report
    stopped = report["attempts"][-1]["workers"]
    assert sorted(w["rank"] for w in stopped) == [0, 1] and {w["exit"] for w in stopped} == {signum.name}, stopped
    # The workers die of the signal at once, so rally does not wait out the grace period.
    assert result.elapsed < SHUTDOWN_TIMEOUT, f"took {result.elapsed:.1f} s to stop\n{result.describe()}"
    for rank in range(len(workers)):
        assert (tmp_path / "out" / f"signal_{rank}").read_text() == str(int(signum)), (
            f"rank {rank} did not get {signum.name}"
        )
    left = survivors(workers + grandchildren + helpers, within=0.5)
    assert not left, f"still alive after rally exited: {describe_pids(left)}"


@pytest.mark.timeout(120)
def test_worker_that_ignores_sigterm_is_killed_after_the_shutdown_timeout(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    rally, workers, grandchildren = start_signal_job(tmp_path, procs, "--shutdown-timeout", "1", ignore_sigterm=True)
    sent = time.monotonic()
    os.kill(rally.pid, signal.SIGTERM)
    result = finish(rally, timeout=30, started=sent)
    assert result.returncode == 128 + signal.SIGTERM, result.describe()
    assert 0.9 <= result.elapsed < 8, (
        f"SIGKILL comes after the 1 s grace period, not before, not much later\n{result.describe()}"
    )
    left = survivors(workers + grandchildren, within=0.5)
    assert not left, f"still alive after rally exited: {describe_pids(left)}"


@pytest.mark.timeout(120)
def test_sigkill_of_rally_takes_workers_and_grandchildren_with_it(tmp_path: Path, procs: ProcessTracker) -> None:
    rally, workers, grandchildren = start_signal_job(tmp_path, procs)
    helpers = [p.pid for p in psutil.Process(rally.pid).children() if p.pid not in workers]
    procs.track(*helpers)
    os.kill(rally.pid, signal.SIGKILL)
    rally.wait(timeout=10)
    rally.communicate()
    left = survivors(workers + grandchildren + helpers, within=2.0)
    assert not left, f"still alive 2 s after rally was SIGKILLed: {describe_pids(left)}"
