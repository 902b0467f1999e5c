"""Shared fixtures. The SLURM dev-cluster fixture lives in tests/slurm_cluster.py.

`cpu_hog`: faults do not arrive on idle machines. With RALLY_TEST_CPU_HOG=1 every test in a
module named test_faults_* runs beside one busy-loop process per core (its own process group,
killed by pgid afterwards), so detection and recovery are proven under load. .ci/run runs the
fault modules a second time that way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest_plugins = ["slurm_cluster"]

_HOG = "while True:\n    pass\n"


def _hog_wanted(request: pytest.FixtureRequest) -> bool:
    module = request.module.__name__.rpartition(".")[2]
    return os.environ.get("RALLY_TEST_CPU_HOG") == "1" and module.startswith("test_faults_")


@pytest.fixture(autouse=True)
def cpu_hog(request: pytest.FixtureRequest) -> Iterator[bool]:
    """One busy loop per core beside the test (only for test_faults_* with RALLY_TEST_CPU_HOG=1)."""
    if not _hog_wanted(request):
        yield False
        return
    hogs = [
        subprocess.Popen([sys.executable, "-c", _HOG], start_new_session=True, stdin=subprocess.DEVNULL)
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield True
    finally:
        for hog in hogs:
            try:
                os.killpg(hog.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            hog.wait(timeout=10)
