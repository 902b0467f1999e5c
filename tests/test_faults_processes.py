"""Fault matrix: processes and hangs, as the faults really arrive (signals: test_faults_signals.py).

    a collective hang (2 nodes, gloo)        -> the rank outside the collective is named, with its
                                                stack; the ranks waiting in all_reduce are summarised
    a SIGSTOPped worker in a hang            -> "stopped (SIGSTOP)" is the root cause
    a SIGSTOPped worker when rally stops     -> SIGCONT goes with the stop signal: no 30 s grace;
                                                `rally status` shows it as "stopped (SIGSTOP)"
    setsid'd and double-forked grandchildren -> gone after a round ends, after exit, and within 3 s
                                                of SIGKILL of the agent; re-parented orphans reaped
    OOM kill of an exiting worker            -> still attributed (the busy-machine failure)

Run beside a CPU hog too (RALLY_TEST_CPU_HOG=1, see conftest.py). Measured times are printed
as "MEASURED ..." lines (pytest -s) for the README's fault matrix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support.agents import c10d_args, start_agent, stop_all
from support.descendants import round_pids, write_leaver
from support.helpers import (  # noqa: F401
    ProcessTracker,
    clean_env,
    describe_pids,
    free_port,
    procs,
    rally_argv,
    run_rally,
    survivors,
    wait_for,
    writable_memory_cgroup_v1,
    write_probe,
)
from support.live_rally import LiveRally

# ------------------------------------------------------------------ 1. the real culprit of a collective hang

COLLECTIVE_HANG = """
import os, time
import torch
import torch.distributed as dist
from rally import job

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)

def stuck_reading_data():
    open(os.path.join(os.environ["PROBE_OUT"], "stuck"), "w").write(str(time.time()))
    while True:          # alive, even beating, but it never reaches the next all_reduce
        job.heartbeat()
        time.sleep(0.05)

for step in range(10**9):
    if rank == 1 and step == 5:
        stuck_reading_data()
    dist.all_reduce(t)
    job.heartbeat()
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_collective_hang_names_the_rank_outside_the_collective_with_its_stack(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = write_probe(tmp_path / "hang.py", COLLECTIVE_HANG)
    port = free_port()
    args = [
        *c10d_args(port, "2"),
        "--nproc-per-node",
        "1",
        "--heartbeat-timeout",
        "2",
        "--max-restarts",
        "0",
        str(script),
    ]
    env = {**clean_env(PROBE_OUT=str(out)), "RALLY_NO_PRELOAD": "1"}
    agents = [start_agent(f"node{i}", tmp_path, args, env=env) for i in range(2)]
    try:
        wait_for(lambda: (out / "stuck").exists(), 150, what="rank 1 to get stuck outside the collective")
        stuck_at = time.monotonic()
        wait_for(lambda: all("root cause" in a.output() for a in agents), 60, what="the root cause on both nodes")
        detected = time.monotonic() - stuck_at
        codes = [a.wait(timeout=60) for a in agents]
        logs = [a.output() for a in agents]
    finally:
        stop_all(agents)
    for log in logs:
        cause = log[log.index("root cause") :]
        first = cause.splitlines()[0]
        assert "rank 1 " in first and "is hung: it is outside the collective that rank 0 waits in" in first, log[-4000:]
        assert "all_reduce" in first, first  # where the others wait
    reporter = next(log for log in logs if "its Python stacks" in log)
    report = reporter[reporter.index("root cause") :]
    assert "stuck_reading_data" in report, report  # the culprit's stack
    assert "rank 0 (node" in report and "in a collective: all_reduce" in report, report  # the others, one line each
    assert codes == [1, 1], logs
    print(f"MEASURED collective hang: culprit named {detected:.1f} s after it got stuck (--heartbeat-timeout 2)")


QUIET_HANG_ACROSS_NODES = """
import os, time
import torch
import torch.distributed as dist
from rally import job

dist.init_process_group("gloo")
rank = dist.get_rank()

def stuck_reading_data():
    open(os.path.join(os.environ["PROBE_OUT"], "stuck"), "w").write(str(time.time()))
    while True:
        time.sleep(0.1)

for step in range(10**9):
    if rank == 1 and step == 5:
        stuck_reading_data()
    dist.all_reduce(torch.ones(1))
    job.heartbeat(step)
    time.sleep(0.05)
"""
# --hang-report-after for the test below: what it proves (the evidence gathered across nodes through
# the store, the culprit named on another node) does not depend on the bound, and the default's own
# test (no flag at all) is tests/test_health.py's; 10 s instead of 60 spares this test's two runs
# (the main pass and the CPU-hog pass) 50 s each.
REPORT_AFTER = 10


@pytest.mark.torch
@pytest.mark.timeout(360)
def test_the_node_waiting_in_a_collective_names_the_hung_rank_on_another_node(tmp_path: Path) -> None:
    """Two nodes, only the report's bound set (no flag that stops a job): rank 1 (node 1) stops
    outside the collective that rank 0 (node 0) waits in. Node 0 sees its rank waiting, asks node 1
    for its snapshots through the store, and reports rank 1 with its stack; nobody is stopped
    (agent/observe/hang_watch.py)."""
    out = tmp_path / "out"
    out.mkdir()
    script = write_probe(tmp_path / "hang.py", QUIET_HANG_ACROSS_NODES)
    args = [
        *c10d_args(free_port(), "2"),
        "--nproc-per-node",
        "1",
        "--hang-report-after",
        str(REPORT_AFTER),
        str(script),
    ]
    env = {**clean_env(PROBE_OUT=str(out))}
    agents = [start_agent(f"node{i}", tmp_path, args, env=env) for i in range(2)]
    try:
        wait_for(lambda: (out / "stuck").exists(), 150, what="rank 1 to get stuck outside the collective")
        stuck_at = time.monotonic()
        wait_for(lambda: any("looks hung" in a.output() for a in agents), REPORT_AFTER + 60, what="the hang report")
        detected = time.monotonic() - stuck_at
        time.sleep(1)  # the rest of the report's lines
        logs = [a.output() for a in agents]
        assert all(a.popen.poll() is None for a in agents), logs  # reported, not stopped
    finally:
        stop_all(agents)
    reporter = next(log for log in logs if "looks hung" in log)
    report = reporter[reporter.index("looks hung") - 200 :]
    first = next(line for line in report.splitlines() if "looks hung" in line)
    assert "rank 1 (local rank 0" in first and "outside the collective that rank 0 waits in (all_reduce" in first, first
    assert "it is in stuck_reading_data (hang.py:" in first, first
    assert "line 12 in stuck_reading_data" in report and "rank 0 (node 0" in report, report
    assert REPORT_AFTER - 1 < detected < REPORT_AFTER + 40, detected
    print(f"MEASURED quiet hang across nodes: reported {detected:.1f} s after it got stuck (bound {REPORT_AFTER} s)")


# ------------------------------------------------------------------ 2. SIGSTOP: root cause, status, no 30 s grace

STOPPED_IN_HANG = """
import os, signal, time
from rally import job
for _ in range(10):
    job.heartbeat()
    time.sleep(0.02)
def waiting_for_rank_1():
    while True:
        time.sleep(0.05)
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)
waiting_for_rank_1()
"""


@pytest.mark.timeout(120)
def test_stopped_worker_is_the_root_cause_of_a_hang_as_stopped_sigstop(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(tmp_path / "stop.py", STOPPED_IN_HANG)
    rally = LiveRally(
        ["--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "1", "--max-restarts", "0", "stop.py"],
        tmp_path, clean_env(), procs,
    )  # fmt: skip
    code, _ = rally.wait_exit(90)
    text = rally.text()
    assert "root cause" in text, text[-3000:]
    cause = text[text.index("root cause") :].splitlines()[0]
    assert "rank 1 " in cause and "its process is stopped (SIGSTOP)" in cause, text[-3000:]
    assert code == 1, text[-3000:]


SLEEPER = """
import os, signal, time
open(os.path.join(os.environ["PROBE_OUT"], "pid_" + os.environ["RANK"]), "w").write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


@pytest.mark.timeout(120)
def test_sigstopped_worker_is_shown_as_stopped_and_does_not_hold_up_the_stop(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "sleeper.py", SLEEPER)
    port = free_port()
    args = [*c10d_args(port, "1", run_id="stopjob"), "--shutdown-timeout", "30", "--nproc-per-node", "2", "sleeper.py"]
    rally = LiveRally(args, tmp_path, clean_env(PROBE_OUT=str(out)), procs)
    wait_for(lambda: len(list(out.glob("pid_*"))) == 2, 60, what="both workers")
    stopped = int((out / "pid_1").read_text())
    procs.track(stopped)
    os.kill(stopped, signal.SIGSTOP)
    status_env = {**clean_env(), "COLUMNS": "200"}

    def status_shows_it() -> bool:
        done = run_rally(
            ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stopjob"],
            cwd=tmp_path,
            env=status_env,
            timeout=30,
        )
        return "stopped (SIGSTOP)" in done.stdout

    wait_for(status_shows_it, 20, interval=0.5, what="`rally status` to show the stopped worker")
    sent = time.monotonic()
    os.kill(rally.proc.pid, signal.SIGTERM)
    code, ended = rally.wait_exit(60)
    assert code == 128 + signal.SIGTERM, rally.text()[-3000:]
    assert ended - sent < 3, f"took {ended - sent:.1f} s: the stopped worker sat out the grace period"
    assert not survivors([stopped], within=0.5)
    print(f"MEASURED SIGSTOPped worker: rally stopped in {ended - sent:.2f} s (--shutdown-timeout 30)")


# ------------------------------------------------------------------ 3. no orphans, ever


@pytest.mark.timeout(120)
def test_no_descendant_survives_a_round_end_or_the_exit(tmp_path: Path, procs: ProcessTracker) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_leaver(tmp_path / "spawner.py")
    rally = LiveRally(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--shutdown-timeout",
            "2",
            "spawner.py",
            "fail-first",
        ],
        tmp_path,
        clean_env(PROBE_OUT=str(out)),
        procs,
    )
    wait_for(lambda: len(list(out.glob("worker_1_*"))) == 2, 60, what="the second round's workers")
    round0 = round_pids(out, 0)
    procs.track(*round0)
    # The second round's workers run only after the first round's tree is gone.
    assert not survivors(round0, within=0), f"alive into the next round: {describe_pids(round0)}"
    round1 = round_pids(out, 1)
    procs.track(*round1)
    os.kill(rally.proc.pid, signal.SIGTERM)
    code, _ = rally.wait_exit(60)
    assert code == 128 + signal.SIGTERM, rally.text()[-3000:]
    left = survivors(round1, within=0.2)
    assert not left, f"alive after rally exited: {describe_pids(left)}"


@pytest.mark.timeout(120)
def test_descendants_are_gone_within_3_s_of_sigkill_of_the_agent(tmp_path: Path, procs: ProcessTracker) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_leaver(tmp_path / "spawner.py")
    rally = LiveRally(
        ["--standalone", "--nproc-per-node", "2", "spawner.py", "forever"],
        tmp_path,
        clean_env(PROBE_OUT=str(out)),
        procs,
    )
    wait_for(lambda: len(list(out.glob("worker_0_*"))) == 2, 60, what="both workers and their descendants")
    everything = round_pids(out, 0)
    procs.track(*everything)
    helpers = [p.pid for p in psutil.Process(rally.proc.pid).children()]
    procs.track(*helpers)
    killed = time.monotonic()
    os.kill(rally.proc.pid, signal.SIGKILL)
    left = survivors(everything + helpers, within=3.0)
    gone_after = time.monotonic() - killed
    assert not left, f"alive 3 s after the agent was SIGKILLed: {describe_pids(left)}"
    print(f"MEASURED SIGKILL of the agent: every descendant (setsid'd, double-forked) gone in {gone_after:.2f} s")
    rally.wait_exit(10)


ORPHAN_MAKER = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(600)
    os._exit(0)
os.wait()
open(os.path.join(os.environ["PROBE_OUT"], "orphan"), "w").write(os.read(r, 32).decode())
while True:
    time.sleep(1)
"""


@pytest.mark.timeout(120)
def test_an_orphan_reparented_to_the_agent_is_reaped_the_moment_it_exits(tmp_path: Path, procs: ProcessTracker) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "orphans.py", ORPHAN_MAKER)
    rally = LiveRally(
        ["--standalone", "--nproc-per-node", "1", "orphans.py"], tmp_path, clean_env(PROBE_OUT=str(out)), procs
    )
    wait_for(lambda: (out / "orphan").exists() and (out / "orphan").read_text(), 60, what="the orphan")
    orphan = int((out / "orphan").read_text())
    procs.track(orphan)
    assert psutil.Process(orphan).ppid() == rally.proc.pid, "re-parented to the agent (a subreaper)"
    os.kill(orphan, signal.SIGKILL)
    killed = time.monotonic()

    def reaped() -> bool:
        return not psutil.pid_exists(orphan)  # not even a zombie: the agent collected it

    wait_for(reaped, 2, interval=0.01, what="the agent to reap its orphan")
    print(f"MEASURED re-parented orphan reaped {time.monotonic() - killed:.3f} s after it died")
    os.kill(rally.proc.pid, signal.SIGTERM)
    assert rally.wait_exit(60)[0] == 128 + signal.SIGTERM


# ------------------------------------------------------------------ 4. OOM attribution while the worker exits

OOM_PROBE = """
import ctypes, os, sys, threading
open(sys.argv[1], "w").write(str(os.getpid()))  # into the memory cgroup
print("in", flush=True)
sys.stdin.readline()  # the test has sampled it alive, in its cgroup
def hog():
    sys.stdin.readline()  # the test has sampled it again, while its pid is exiting
    chunks = []
    while True:
        chunks.append(bytearray(8 * 1024 * 1024))
threading.Thread(target=hog).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread (the pid) exits, the process lives on
"""


# Same under load: the test takes both samples itself at fixed points (the probe waits on stdin),
# and the exiting state is held, not raced (see the docstring).
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_oom_kill_is_attributed_even_when_the_sample_lands_while_the_worker_exits(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    """A process that has begun to exit shows its cgroup-v1 paths as "/": on a busy machine the
    agent's sampler often ran in that window and lost the worker's cgroup. The leader thread of
    this probe exits first, which holds the process in exactly that state, deterministically."""
    from rally.agent.observe.health import HealthMonitor, HealthSettings

    base = writable_memory_cgroup_v1()
    if base is None:
        pytest.skip("no writable cgroup-v1 memory controller here")
    group = base / f"rally-faults-oom-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 * 1024 * 1024))
        probe = write_probe(tmp_path / "oom.py", OOM_PROBE)
        child = subprocess.Popen(
            [sys.executable, str(probe), str(group / "cgroup.procs")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.track(child.pid)
        monitor = HealthMonitor(HealthSettings(resource_interval=0.1))
        monitor.watch(0, child.pid, None, time.monotonic())
        assert child.stdout.readline().strip() == "in"
        monitor.sample()  # alive, in the limited cgroup
        child.stdin.write("exit the main thread\n")
        child.stdin.flush()
        wait_for(
            lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 10, what="the leader thread to exit"
        )
        monitor.sample()  # lands while the pid is exiting: must not take "/" for a move
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == -signal.SIGKILL
        cause = monitor.explain_kill(0)
        assert cause is not None and cause.startswith("killed by the out-of-memory killer"), cause
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
