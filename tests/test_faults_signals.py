"""Fault matrix: signals arrive at the worst moments, and none is lost or waited out.

    SIGTERM in a restart grace / exit barrier  -> exit 143 at once
    a preemption signal during a restart grace -> not lost: exit 75 at once
    a preemption signal at start-up (still blocked by the launcher) or in the rendezvous -> exit 75
    crash-loop stop                            -> rally exits within 2 s of saying so

Run beside a CPU hog too (RALLY_TEST_CPU_HOG=1, see conftest.py). Measured times are printed as
"MEASURED ..." lines (pytest -s) for the README's fault matrix.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from support.agents import c10d_args
from support.helpers import (
    ProcessTracker,
    clean_env,
    free_port,
    procs,  # noqa: F401 - a fixture
    read_events,
    survivors,
    wait_for,
    write_probe,
)
from support.live_rally import LiveRally

FAIL_WHILE_OTHER_IGNORES_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(0.5)
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "signum, expected", [(signal.SIGTERM, 143), (signal.SIGUSR1, 75)], ids=["SIGTERM", "preemption-SIGUSR1"]
)
def test_a_signal_during_the_restart_grace_ends_rally_at_once(
    tmp_path: Path, procs: ProcessTracker, signum: signal.Signals, expected: int
) -> None:
    write_probe(tmp_path / "probe.py", FAIL_WHILE_OTHER_IGNORES_SIGTERM)
    logs = tmp_path / "logs"
    rally = LiveRally(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--shutdown-timeout",
            "30",
            "--log-dir",
            str(logs),
            "probe.py",
        ],
        tmp_path,
        clean_env(),
        procs,
    )

    def failed() -> bool:
        return any(e.get("returncode") == 3 for e in read_events(logs))

    wait_for(failed, 60, what="rank 1 to fail")  # rank 0 now sits out the 30 s grace of the restart
    workers = [p.pid for p in psutil.Process(rally.proc.pid).children(recursive=True)]
    procs.track(*workers)
    sent = time.monotonic()
    os.kill(rally.proc.pid, signum)
    code, ended = rally.wait_exit(60)
    assert code == expected, rally.text()[-3000:]
    assert ended - sent < 2, f"took {ended - sent:.1f} s"
    assert "round 1" not in rally.text(), "no new round after the signal"
    assert not survivors(workers, within=0.5)
    print(f"MEASURED {signum.name} during a restart grace: exit {code} after {ended - sent:.2f} s")


FAIL_ON_HOST = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("PROBE_FAIL") == "1":
    time.sleep(1)
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


@pytest.mark.timeout(120)
def test_sigterm_during_the_exit_barrier_gives_143_at_once(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(tmp_path / "probe.py", FAIL_ON_HOST)
    port = free_port()
    base = [*c10d_args(port, "2", run_id="barrier"), "--nproc-per-node", "1", "--max-restarts", "0"]
    host = LiveRally([*base, "--shutdown-timeout", "1", "probe.py"], tmp_path, clean_env(PROBE_FAIL="1"), procs)
    host.wait_line("hosting the rendezvous store", 60)
    # The other node's worker ignores SIGTERM: its agent acknowledges the end only after 60 s.
    other = LiveRally([*base, "--shutdown-timeout", "60", "probe.py"], tmp_path, clean_env(), procs)
    try:
        host.wait_line("job failed: no restarts left", 90)  # now in the exit barrier
        sent = time.monotonic()
        os.kill(host.proc.pid, signal.SIGTERM)
        code, ended = host.wait_exit(60)
        assert code == 143, host.text()[-3000:]
        assert ended - sent < 2, f"took {ended - sent:.1f} s"
        print(f"MEASURED SIGTERM in the exit barrier: exit 143 after {ended - sent:.2f} s")
    finally:
        os.killpg(other.proc.pid, signal.SIGKILL)
        other.wait_exit(30)


def _blocks(pid: int, signum: int) -> bool:
    """Whether the process's main thread has `signum` blocked (launcher start-up, torch importing)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigBlk:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) & (1 << (signum - 1)))


@pytest.mark.timeout(90)
# "rendezvous" is same under load: the signal is sent once the agent says it hosts the store, when
# its handler has been in place since before the store opened (agent/agent.py installs it first),
# and the agent waits in the rendezvous for ever, so whenever the signal comes it finds the same
# wait. "start-up", a signal landing while the launcher still blocks it, stays in the CPU-hog pass.
@pytest.mark.parametrize("when", ["start-up", pytest.param("rendezvous", marks=pytest.mark.same_under_load)])
def test_a_preemption_signal_is_not_lost_at_start_up_or_in_the_rendezvous(
    tmp_path: Path, procs: ProcessTracker, when: str
) -> None:
    write_probe(tmp_path / "probe.py", "import time\ntime.sleep(600)\n")
    # Two nodes expected, one started: the agent waits in the rendezvous for ever.
    rally = LiveRally([*c10d_args(free_port(), "2", run_id="early"), "probe.py"], tmp_path, clean_env(), procs)
    if when == "start-up":  # the launcher holds it while torch imports, before any handler exists
        wait_for(
            lambda: _blocks(rally.proc.pid, signal.SIGUSR1), 30, interval=0.005, what="the launcher to block SIGUSR1"
        )
    else:
        rally.wait_line("hosting the rendezvous store", 60)
    sent = time.monotonic()
    os.kill(rally.proc.pid, signal.SIGUSR1)
    code, ended = rally.wait_exit(60)
    assert code == 75, rally.text()[-3000:]
    assert "preempted (SIGUSR1)" in rally.text()
    print(f"MEASURED SIGUSR1 during {when}: exit 75 after {ended - sent:.2f} s")


@pytest.mark.timeout(120)
def test_crash_loop_stop_exits_within_2_s(tmp_path: Path, procs: ProcessTracker) -> None:
    body = """
        from rally import job
        ckpt = job.load_latest()
        if ckpt is None:
            job.save({"step": 0}, 0)
        raise SystemExit(4)
    """
    write_probe(tmp_path / "loop.py", body)
    rally = LiveRally(
        [
            "--standalone",
            "--max-restarts",
            "10",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--crash-loop-limit",
            "1",
            "loop.py",
        ],
        tmp_path,
        clean_env(),
        procs,
    )
    said = rally.wait_line("crash loop:", 90)
    code, ended = rally.wait_exit(30)
    assert code == 4, rally.text()[-3000:]
    assert ended - said < 2, f"exited {ended - said:.1f} s after saying it stops"
    print(f"MEASURED crash-loop stop: exit {ended - said:.2f} s after the message")
