"""Health: hung workers are caught with their stacks, silent workers too, OOM kills are named,
events are logged, crash loops stop early, and `rally status` shows a running job."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from support.agents import c10d_args, start_agent, stop_all, write_script
from support.helpers import OnTerminal, clean_env, eventually, free_port, read_events, run_rally

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


@pytest.mark.timeout(120)
def test_hung_worker_with_no_restarts_left_fails_the_job(tmp_path):
    code, out, _ = _run(tmp_path, SILENT, "--silence-timeout", "1", "--max-restarts", "0")
    assert code != 0 and "no restarts left" in out


def _memory_cgroup_v1() -> Path | None:
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x)
    except (OSError, StopIteration):
        return None
    base = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
    return base if (base / "cgroup.procs").exists() and os.access(base, os.W_OK) else None


@pytest.mark.timeout(120)
def test_worker_killed_by_the_oom_killer_is_reported_as_such(tmp_path):
    """Uses a cgroup-v1 memory limit (the kernel's real OOM killer), as setrlimit gives MemoryError."""
    base = _memory_cgroup_v1()
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


@pytest.mark.timeout(120)
def test_output_off_a_terminal_has_no_escape_codes(tmp_path):
    code, out, _ = _run(tmp_path, "import sys; sys.exit(3)\n", "--nproc-per-node", "2")
    assert code == 3
    assert "\x1b" not in out
    assert re.search(r"^\d\d:\d\d:\d\d\.\d{3} rally: ", out, re.MULTILINE)  # timestamped lines


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
