"""The bench's scratch directory (bench/scratch.py) goes away however a run ends: a normal finish,
SIGTERM, SIGINT, SIGHUP; a SIGKILLed run's is removed by the next run (killed runs once left ~60 GB
of checkpoints in /tmp)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import eventually, kill_group

REPO = Path(__file__).resolve().parents[1]
RUN = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as run from a terminal, even if started with SIGINT ignored
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from bench.scratch import scratch_dir
with scratch_dir(False, Path(sys.argv[2])) as root:
    (root / "step.pt").write_bytes(b"x" * 1000)
    print(root, flush=True)
    if sys.argv[3] == "finish":
        sys.exit(0)
    time.sleep(60)
"""


def start(parent: Path, how: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN, str(REPO), str(parent), how],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    root = Path(proc.stdout.readline().strip())
    assert root.parent == parent and root.name.startswith(f"rally_bench_{proc.pid}_")
    if how == "wait":  # (a finishing run may have removed it already)
        assert root.is_dir()
    return proc, root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [None, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_bench_runs_scratch_is_removed_on_a_finish_and_on_a_stop_signal(tmp_path: Path, signum: int | None) -> None:
    proc, root = start(tmp_path, "finish" if signum is None else "wait")
    try:
        if signum is not None:
            proc.send_signal(signum)
        proc.wait(timeout=30)
        assert not root.exists()
    finally:
        kill_group(proc.pid)
        proc.wait()


@pytest.mark.timeout(60)
def test_the_scratch_of_a_sigkilled_run_is_removed_by_the_next_run(tmp_path: Path) -> None:
    killed, left = start(tmp_path, "wait")
    kill_group(killed.pid)
    killed.wait()
    assert left.exists()
    proc, root = start(tmp_path, "finish")
    try:
        proc.wait(timeout=30)
        assert eventually(lambda: not left.exists() and not root.exists(), 5)
    finally:
        kill_group(proc.pid)
        proc.wait()
