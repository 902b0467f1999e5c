"""Fault matrix: a hostile or buggy worker, and what the job started, cannot steer or outlive the agent (issue 18).

    heartbeat file replaced by a FIFO          -> the agent keeps watching; SIGTERM stops it at once
    a FIFO at TORCHELASTIC_ERROR_FILE          -> the failure is reported (stderr tail), exit 1
    the error file a symlink to /dev/zero      -> not read (no memory blow-up), exit 1
    error.json holding [1,2,3], a string, or
    100 000 nested brackets                    -> no traceback: reported as a failure without one

Run beside a CPU hog too (RALLY_TEST_CPU_HOG=1, see conftest.py).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from helpers import ProcessTracker, clean_env, procs, run_rally, write_probe  # noqa: F401
from live_rally import LiveRally

STANDALONE = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0"]

FIFO_HEARTBEAT = """
import os, time
from rally import job
job.heartbeat()                          # the agent now reads the file every second
path = os.environ["RALLY_HEARTBEAT_FILE"]
os.unlink(path)
os.mkfifo(path)                          # a plain open() of it blocks for ever
print("replaced", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_a_heartbeat_file_replaced_by_a_fifo_does_not_wedge_the_agent(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(tmp_path / "probe.py", FIFO_HEARTBEAT)
    rally = LiveRally([*STANDALONE, "--shutdown-timeout", "2", "probe.py"], tmp_path, clean_env(), procs)
    rally.wait_line("replaced", 60)
    time.sleep(3)  # three heartbeat reads of the FIFO
    rally.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, ended = rally.wait_exit(30)
    assert code == 128 + signal.SIGTERM, rally.text()[-3000:]
    assert ended - sent < 10, f"the stop took {ended - sent:.1f} s\n{rally.text()[-3000:]}"
    assert "Traceback" not in rally.text()


def _failing_worker(kind: str) -> str:
    """A worker that leaves something hostile at TORCHELASTIC_ERROR_FILE, says so on stderr, and exits 1."""
    return f"""
import os, sys
path = os.environ["TORCHELASTIC_ERROR_FILE"]
kind = {kind!r}
if kind == "fifo":
    os.mkfifo(path)
elif kind == "dev-zero":
    os.symlink("/dev/zero", path)
else:
    content = {{"list": "[1,2,3]", "string": '"a string"', "nested": "[" * 100_000 + "]" * 100_000,
               "bad-fields": '{{"message": {{"extraInfo": [1], "message": 7}}}}'}}[kind]
    with open(path, "w") as f:
        f.write(content)
print("left a hostile error file", file=sys.stderr, flush=True)
sys.exit(1)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "list", "string", "nested", "bad-fields"])
def test_a_hostile_error_file_is_reported_as_a_plain_failure(tmp_path: Path, kind: str) -> None:
    write_probe(tmp_path / "probe.py", _failing_worker(kind))
    result = run_rally([*STANDALONE, "probe.py"], cwd=tmp_path, env=clean_env(), timeout=90)
    assert result.returncode == 1, result.describe()
    assert "failed with exit code 1" in result.stderr, result.describe()
    assert "left a hostile error file" in result.stderr, result.describe()  # the stderr tail stands in
    assert "Traceback" not in result.stderr, result.describe()
    assert result.elapsed < 60, result.describe()
