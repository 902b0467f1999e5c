"""Health: hung workers are caught with their stacks, silent workers too, OOM kills are named,
events are logged, crash loops stop early, and `rally status` shows a running job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.observe.hang_report import Snapshot
from rally.agent.observe.hang_watch import CONFIRM_SECONDS, HangWatch, stuck_rank
from support.agents import c10d_args, start_agent, stop_all, write_script
from support.helpers import (  # noqa: F401 - procs is a fixture
    OnTerminal,
    ProcessTracker,
    clean_env,
    eventually,
    free_port,
    kill_group,
    procs,
    read_events,
    run_rally,
    start_rally,
    writable_memory_cgroup_v1,
)
from support.live_rally import LiveRally

HEARTBEATS_THEN_HANG = """
import os, sys, time
from rally import job
def stuck_in_allreduce():
    while True:
        time.sleep(0.05)
for _ in range(20):
    job.heartbeat()
    time.sleep(0.02)
print("beating done", flush=True)
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    stuck_in_allreduce()
"""

STOPS_ITSELF = """
import os, signal, sys, time
from rally import job
def about_to_stop():
    os.kill(os.getpid(), signal.SIGSTOP)
for _ in range(20):
    job.heartbeat()
    time.sleep(0.02)
if os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    about_to_stop()
"""

SILENT = """
import os, time
print("hello", flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    def waiting_quietly():
        time.sleep(600)
    waiting_quietly()
"""


def _run(tmp: Path, script: str, *args: str, timeout: float = 90) -> tuple[int, str, float]:
    path = write_script(tmp, "w.py", script)
    done = run_rally(["--standalone", "--log-dir", str(tmp / "logs"), *args, str(path)], cwd=tmp, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, done.elapsed


def _report(tmp: Path) -> dict:
    (path,) = (tmp / "logs").glob("*/report.json")
    return json.loads(path.read_text())


@pytest.mark.timeout(120)
def test_worker_that_stops_heartbeating_is_caught_with_its_stack_and_the_job_restarts(tmp_path):
    code, out, _ = _run(
        tmp_path, HEARTBEATS_THEN_HANG, "--nproc-per-node", "2", "--heartbeat-timeout", "1", "--max-restarts", "1"
    )
    assert code == 0, out
    assert re.search(r"rank 1 .* is hung: it sent no heartbeat for 1\.\d s", out), out
    assert "stuck_in_allreduce" in out  # the stack names the function it is stuck in
    # printed once (in the root cause; main also echoed the dump among the worker's output), and
    # without the frames of rally's bootstrap and runpy below the script's own
    assert len(re.findall(r'File "[^"]*w\.py", line \d+ in stuck_in_allreduce', out)) == 1, out
    assert "bootstrap.py" not in out and "runpy.py" not in out, out
    hung = [a["end"] for a in _report(tmp_path)["attempts"] if a["end"]["kind"] == "worker_hung"]
    assert hung and any("stuck_in_allreduce" in line for line in hung[0]["info"]["stacks"])
    events = read_events(tmp_path / "logs")
    detected = next(e for e in events if e["event"] == "worker_hung")
    started = [e for e in events if e["event"] == "worker_started" and e["rank"] == 1][0]
    # 20 beats take ~0.5 s; then the timeout (1 s) plus at most one second of slack
    assert detected["time"] - started["time"] < 0.5 + 1 + 1 + 2  # generous: start-up on a loaded machine


@pytest.mark.timeout(120)
def test_worker_stopped_with_sigstop_is_caught_and_its_stack_collected(tmp_path):
    code, out, _ = _run(
        tmp_path, STOPS_ITSELF, "--nproc-per-node", "2", "--heartbeat-timeout", "1", "--max-restarts", "1"
    )
    assert code == 0, out
    assert "rank 0" in out and "is hung" in out
    assert "about_to_stop" in out


@pytest.mark.timeout(120)
def test_silent_worker_is_caught_by_the_silence_timeout(tmp_path):
    code, out, _ = _run(tmp_path, SILENT, "--silence-timeout", "1.5", "--max-restarts", "1")
    assert code == 0, out
    assert "printed nothing for 1." in out
    assert "waiting_quietly" in out


# Also rally's console off a terminal (this job's output is a pipe): no escape codes, a time stamp
# on each of rally's lines. That was a job of its own (two workers exiting 3).
@pytest.mark.timeout(120)
def test_hung_worker_with_no_restarts_left_fails_the_job(tmp_path):
    code, out, _ = _run(tmp_path, SILENT, "--silence-timeout", "1", "--max-restarts", "0")
    assert code != 0 and "no restarts left" in out
    assert "\x1b" not in out, out
    assert re.search(r"^\d\d:\d\d:\d\d\.\d{3} rally: ", out, re.MULTILINE), out  # timestamped lines


@pytest.mark.timeout(120)
def test_worker_killed_by_the_oom_killer_is_reported_as_such(tmp_path):
    """Uses a cgroup-v1 memory limit (the kernel's real OOM killer), as setrlimit gives MemoryError."""
    base = writable_memory_cgroup_v1()
    if base is None:
        pytest.skip("no writable cgroup-v1 memory controller here to set a memory limit")
    group = base / f"rally-test-oom-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 * 1024 * 1024))
        script = f"""
import os, time
open({str(group / "cgroup.procs")!r}, "w").write(str(os.getpid()))
time.sleep(1.5)  # let rally sample the worker inside its cgroup (it samples every 0.1 s)
hog = []
while True:
    hog.append(bytearray(8 * 1024 * 1024))
    time.sleep(0.05)
"""
        code, out, _ = _run(tmp_path, script, "--resource-interval", "0.1")
        assert code == 137, out
        assert "killed by the out-of-memory killer" in out, out
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.timeout(120)
def test_events_jsonl_records_the_lifecycle(tmp_path):
    fails_once = """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(5)
"""
    code, out, _ = _run(tmp_path, fails_once, "--nproc-per-node", "2", "--max-restarts", "1")
    assert code == 0, out
    events = [
        e for e in read_events(tmp_path / "logs") if e["event"] != "gpu_health_skipped"
    ]  # no GPU here: see test_observe.py
    kinds = [e["event"] for e in events]
    assert kinds[0] == "round_formed" and kinds[-1] == "job_end"
    assert kinds.count("worker_started") == 4 and kinds.count("round_formed") == 2
    exited = [e for e in events if e["event"] == "worker_exited" and e["returncode"] == 5]
    assert exited and exited[0]["rank"] == 1
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["restart_count"] == 1 and "exit code 5" in restart["cause"]
    assert events[-1]["outcome"] == "succeeded" and events[-1]["exit_code"] == 0
    assert all(isinstance(e["time"], float) for e in events)


@pytest.mark.timeout(120)
def test_restarts_that_make_no_checkpoint_progress_stop_as_a_crash_loop(tmp_path):
    script = """
import sys
from rally import job
ckpt = job.load_latest()
step = ckpt.step + 1 if ckpt else 0
while step < 100:
    if step == 7:
        raise RuntimeError("fails at step 7 every time")
    if step % 5 == 0:
        job.save({"step": step}, step)
    step += 1
"""
    code, out, _ = _run(
        tmp_path, script, "--max-restarts", "10", "--checkpoint-dir", str(tmp_path / "ckpt"), "--crash-loop-limit", "2"
    )
    assert code == 1, out
    assert "crash loop: 2 restarts in a row made no progress" in out and "step 5" in out
    assert "fails at step 7 every time" in out
    assert out.count("restarting all workers") == 3  # restarts 1-2 stall; the loop is seen at 3
    assert _report(tmp_path)["outcome"] == "crash loop"


@pytest.mark.timeout(150)
def test_rally_status_shows_a_running_three_node_job(tmp_path):
    port = free_port()
    probe = write_script(tmp_path, "probe.py", "import time\nwhile True:\n    time.sleep(0.1)\n")
    agents = [
        start_agent(f"n{i}", tmp_path, [*c10d_args(port, "3", run_id="statusjob"), "--nproc-per-node", "2", str(probe)])
        for i in range(3)
    ]
    try:
        assert eventually(lambda: all("round 0:" in a.output() for a in agents), 60)
        env = clean_env(COLUMNS="200")

        def status() -> str:
            args = ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "statusjob"]
            done = run_rally(args, cwd=tmp_path, env=env, timeout=30)
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert eventually(lambda: status().count("running") == 6, 20), status()
        text = status()
        assert "round 0" in text
        for rank in range(6):
            assert re.search(rf"│ {rank}\s+│", text), text
        missing = run_rally(
            ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nosuchjob"], cwd=tmp_path, timeout=30
        )
        assert missing.returncode != 0
        assert "no job with run id 'nosuchjob'" in missing.stderr and "Traceback" not in missing.stderr
    finally:
        stop_all(agents)


@pytest.mark.timeout(120)
def test_on_a_terminal_a_live_table_of_the_workers_is_shown(tmp_path):
    """rally under a real pseudo-terminal (both stdout and stderr), as a person would run it."""
    script = write_script(
        tmp_path, "w.py", "import time\nfor i in range(25):\n    print('step', i, flush=True)\n    time.sleep(0.2)\n"
    )
    env = {**clean_env(), "TERM": "xterm", "COLUMNS": "120", "LINES": "40"}
    terminal = OnTerminal(["--standalone", "--nproc-per-node", "2", str(script)], cwd=tmp_path, env=env)
    try:
        raw = terminal.read(100).decode(errors="replace")
        assert terminal.proc.wait(timeout=30) == 0
    finally:
        terminal.close()
    assert "\x1b[" in raw  # a live display redraws with control codes, unlike plain output
    text = terminal.text()
    assert "rally · node 0 · round 0" in text, text[-2000:]
    assert re.search(r"┃ rank\s+┃ pid\s+┃ state", text) and "heartbeat" in text, text[-2000:]


# --- hangs caught with no flag at all (agent/observe/hang_watch.py) ----------------------------

DEFAULT_REPORT_AFTER = 60  # JobSpec.hang_report_after: the first test below passes no flag, so this is the default
# The bound the quiet-phase test sets with --hang-report-after: the same watch judges the same
# evidence whatever the bound (the rule's cases are the unit test below), so a phase three times
# the bound proves in 35 s what three times the default would in 3 minutes.
SHORT_REPORT_AFTER = 10

RANK_1_STOPS_IN_STEP_3 = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from rally import job

dist.init_process_group("gloo")
rank = dist.get_rank()

def stuck_reading(path):
    while not path.exists(): time.sleep(0.1)

for step in range(10):
    if rank == 1 and step == 3:
        print("stuck now", flush=True)
        stuck_reading(Path(sys.argv[1]))
    dist.all_reduce(torch.ones(1))
    job.heartbeat(step)
    time.sleep(0.05)
print("finished", flush=True)
dist.destroy_process_group()
"""


def _status_command(text: str) -> list[str]:
    """`rally status --rdzv-endpoint ... --rdzv-id ...` as the job printed it at start."""
    found = re.search(r"rally status (--rdzv-endpoint \S+ --rdzv-id \S+)", text)
    assert found, text
    return ["status", *found.group(1).split()]


@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("quiet_phase_job")  # started now, so that its 35 s of sleep overlap this test's 60 s wait
def test_with_no_hang_flag_a_rank_its_peers_wait_for_in_a_collective_is_reported_and_the_job_goes_on(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    """The quickstart's command, no hang flag: rank 1 stops in step 3 while rank 0 waits for it in
    all_reduce. Within the default bound (plus a look) rally names rank 1 with its file, line and
    stacks (printed once, without rally's bootstrap frames) on the console, in `rally status`, in
    events.jsonl and in report.json, and stops nothing: once rank 1 goes on, the job finishes and
    says the hang is over. On main nothing was said until gloo's own timeout (30 min)."""
    script = write_script(tmp_path, "w.py", RANK_1_STOPS_IN_STEP_3)
    release = tmp_path / "release"
    job = LiveRally(
        ["--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script), str(release)],
        tmp_path, clean_env(COLUMNS="250"), procs,
    )  # fmt: skip
    stuck_at = job.wait_line("[1] stuck now", 120)
    reported_at = job.wait_line("looks hung", DEFAULT_REPORT_AFTER + 60)
    # the bound, plus one look (stacks within 2 s) and the load of a shared 2-core machine
    assert DEFAULT_REPORT_AFTER <= reported_at - stuck_at + 1 < DEFAULT_REPORT_AFTER + 20, job.text()[-3000:]
    text = job.text()
    line = next(line for line in text.splitlines() if "looks hung" in line)
    assert "rank 1 (local rank 1" in line and "rank 0 waits in (all_reduce" in line, line
    assert "it is in stuck_reading (w.py:12)" in line, line
    assert len(re.findall(r'File "[^"]*w\.py", line 12 in stuck_reading', text)) == 1, text[-3000:]
    assert "bootstrap.py" not in text and "runpy.py" not in text, text[-3000:]

    def status_with_the_hang() -> str | None:
        done = run_rally(_status_command(text), cwd=tmp_path, env=clean_env(COLUMNS="250"), timeout=60)
        assert done.returncode == 0, done.describe()
        return done.stdout if "hang: rank 1 (local rank 1" in done.stdout else None

    # the node's record reaches the store with its next keep-alive, every few seconds
    shown = eventually(status_with_the_hang, 30, interval=1)
    assert shown and "stuck_reading (w.py:12)" in shown, shown
    (reported,) = [e for e in read_events(tmp_path / "logs") if e["event"] == "hang_reported"]
    assert reported["rank"] == 1 and reported["where"] == "stuck_reading (w.py:12)", reported
    assert any("in stuck_reading" in line for line in reported["stacks"]), reported
    (report_path,) = (tmp_path / "logs").glob("*/report.json")
    assert [h["rank"] for h in json.loads(report_path.read_text())["hangs"]] == [1]

    release.touch()  # rank 1 goes on: nothing was stopped, the job finishes
    job.wait_line("the hang reported", 60)
    code, _ = job.wait_exit(120)
    assert code == 0, job.text()[-3000:]
    assert "[0] finished" in job.text() and "[1] finished" in job.text()
    events = [e["event"] for e in read_events(tmp_path / "logs")]
    assert "worker_hung" not in events and "restart" not in events and "hang_over" in events, events


EVERY_RANK_LOADS_DATA = """
import time
import torch
import torch.distributed as dist
from rally import job

dist.init_process_group("gloo")
for step in range(3):
    dist.all_reduce(torch.ones(1))
    job.heartbeat(step)

def loading_the_dataset():
    time.sleep(SECONDS)  # every rank, quiet and outside any collective: a long data-loading phase

loading_the_dataset()
for step in range(3, 6):
    dist.all_reduce(torch.ones(1))
    job.heartbeat(step)
print("finished", flush=True)
dist.destroy_process_group()
""".replace("SECONDS", str(3 * SHORT_REPORT_AFTER + 5))
QUIET_PHASE_JOB_TIMEOUT = 260.0


@pytest.fixture(scope="module")
def quiet_phase_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path, float]]:
    """The quiet-phase job of the test below (the process, its directory, when it started), started
    by the no-flag hang test before it, so that the 35 s this job sleeps pass while that test waits
    its 60 s for the report: both jobs mostly sleep, and the module is ~40 s shorter than with one
    after the other. Neither job can see the other: each is a standalone job of its own (its own
    store on a port from the OS, its own run id, log directory and workers). Its output goes to a
    file, which no pipe left unread can block."""
    tmp = tmp_path_factory.mktemp("quiet_phase")
    script = write_script(tmp, "w.py", EVERY_RANK_LOADS_DATA)
    args = ["--standalone", "--log-dir", str(tmp / "logs"), "--nproc-per-node", "2"]
    bound = ["--hang-report-after", str(SHORT_REPORT_AFTER)]
    with open(tmp / "output", "w") as output:
        proc = start_rally([*args, *bound, str(script)], cwd=tmp, stdout=output, stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        yield proc, tmp, started
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
        proc.wait()


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_long_quiet_phase_on_every_rank_with_no_collective_waiting_is_not_reported(
    quiet_phase_job: tuple[subprocess.Popen, Path, float],
) -> None:
    """Every rank sleeps 35 s ("loading data"), three times the bound (--hang-report-after 10), with
    nobody waiting in a collective: no report, nothing stopped, the job finishes."""
    proc, tmp_path, started = quiet_phase_job
    try:
        # the job's end, within the bound it had when it ran alone (counted from its start)
        code = proc.wait(timeout=max(QUIET_PHASE_JOB_TIMEOUT - (time.monotonic() - started), 1.0))
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        pytest.fail(f"rally did not finish within {QUIET_PHASE_JOB_TIMEOUT:g} s\n{(tmp_path / 'output').read_text()}")
    out = (tmp_path / "output").read_text()
    assert code == 0, out
    assert "looks hung" not in out and "is hung" not in out, out
    assert out.count("] finished") == 2, out
    events = [e["event"] for e in read_events(tmp_path / "logs")]
    assert "hang_reported" not in events and "worker_hung" not in events, events


def _seen(rank: int, frame: str, quiet: float, cpu: float, state: str = "sleeping", section: str = "") -> Snapshot:
    stack = ["Current thread 0x1 (most recent call first):", f'  File "{frame}", line 7 in step']
    return Snapshot(rank, rank, "vm", 100 + rank, state, stack, 3, 0, quiet, section, cpu)


IN_ALL_REDUCE = "/site-packages/torch/distributed/distributed_c10d.py"


@pytest.mark.timeout(10)
def test_the_default_watch_wants_a_waiter_a_quiet_rank_outside_and_a_second_look_that_sees_the_same() -> None:
    """The rule of agent/observe/hang_watch.py, case by case: one look is never enough (a healthy job
    can be caught with rank 0 in all_reduce while a rank that never prints computes); a rank that
    moved or used CPU between the looks, sits in a section, or has nobody waiting for it is not hung."""
    after = 60.0
    waiter, culprit = _seen(0, IN_ALL_REDUCE, 61, 10.0), _seen(1, "/job/train.py", 61, 20.0)
    assert stuck_rank([waiter, culprit], after) == (culprit, [waiter])
    # nobody in a collective (data loading on every rank), a culprit in a section, or quiet too short
    assert stuck_rank([_seen(0, "/job/load.py", 90, 1), _seen(1, "/job/load.py", 90, 1)], after) is None
    assert stuck_rank([waiter, _seen(1, "/job/train.py", 61, 20.0, section="eval")], after) is None
    assert stuck_rank([waiter, _seen(1, "/job/train.py", 59, 20.0)], after) is None
    assert stuck_rank([_seen(0, IN_ALL_REDUCE, 29, 10.0), culprit], after) is None  # the waiter just got there
    # a stopped process is a culprit even inside a collective
    stopped = _seen(1, IN_ALL_REDUCE, 61, 20.0, state="stopped (SIGSTOP)")
    assert stuck_rank([waiter, stopped], after) == (stopped, [waiter])

    def looks(*second: tuple[Snapshot, list[Snapshot]] | None) -> list[bool]:
        watch = HangWatch(after)
        verdicts = [watch.judge(stuck_rank([waiter, culprit], after), 1000.0)]
        return verdicts + [watch.judge(found, 1000.0 + CONFIRM_SECONDS) for found in second]

    assert looks((culprit, [waiter])) == [False, True]  # the same, idle: reported at the second look
    busy = _seen(1, "/job/train.py", 66, 20.0 + CONFIRM_SECONDS)  # a core's worth of CPU in between
    moved = _seen(1, "/job/other.py", 66, 20.0)
    assert looks((busy, [waiter])) == [False, False] and looks((moved, [waiter])) == [False, False]
    assert looks(None) == [False, False]


@pytest.mark.timeout(10)
def test_the_live_view_shows_a_reported_hang_under_the_workers_table() -> None:
    """The live view renders the node's status record (agent/observe/live.py): a hang the default
    watch reported (the record's `hang`, from HangReporter.status_fields) is a line under the table."""
    from rich.console import Console

    from rally.agent.observe.live import LiveView

    detail = "rank 1 (local rank 1, pid 7413) on vm looks hung: no progress for 66 s"
    record = {
        "host": "vm", "group_rank": 0, "round": 0, "world_size": 2,
        "workers": [{"rank": r, "local_rank": r, "pid": 7412 + r, "state": "running"} for r in (0, 1)],
        "hang": {"rank": 1, "host": "vm", "detail": detail, "time": time.time() - 12},
    }  # fmt: skip
    console = Console(width=250, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(LiveView(console, lambda: record).render())
    assert f"hang: {detail} (reported 12 s ago)" in console.export_text()
