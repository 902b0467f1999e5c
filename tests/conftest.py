"""Shared fixtures. The SLURM dev-cluster fixture lives in tests/support/slurm_cluster.py, the uninterrupted
DDP run the DDP fault tests compare with in tests/support/ddp_reference.py.

`cpu_hog`: faults do not arrive on idle machines. With RALLY_TEST_CPU_HOG=1 every test in a
module named test_faults_* runs beside one busy-loop process per core (its own process group,
killed by pgid afterwards), so detection and recovery are proven under load. .ci/run runs the
timing-sensitive fault modules a second time that way, less the tests marked `same_under_load`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.checkpoint.core.shm import holders_of

pytest_plugins = ["support.slurm_cluster", "support.ddp_reference", "support.fsdp_reference"]

_HOG = "while True:\n    pass\n"


# Every process a test starts inherits this marker, so the fixture below can tell this session's
# processes from other jobs on a shared machine (clean_env keeps it: it is no launcher setting).
SESSION_MARKER = "PYTEST_RALLY_SESSION"
os.environ[SESSION_MARKER] = str(os.getpid())


def _rally_files_in_dev_shm() -> list[str]:
    """Files of rally's in /dev/shm (there should never be any: the tier's copies are memfds)."""
    try:
        return [f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if "rally" in name.lower()]
    except OSError:
        return []


def _rally_shared_memory() -> list[str]:
    """Memory-tier copies (memfds, agent/checkpoint/core/shm.py) held by processes of this test session."""
    mine = f"{SESSION_MARKER}={os.getpid()}".encode()
    found = []
    for pid, names in holders_of().items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if mine in environ.split(b"\0"):
            found += [f"pid {pid}: {name}" for name in names]
    return found


@pytest.fixture(autouse=True)
def no_shared_memory_left() -> Iterator[None]:
    """After every test nothing of rally's holds shared memory: no memory-tier copy is held by a
    process this session started (a holder gets 10 s to let go after its agent ended). The copies
    are memfds, never files: /dev/shm holds nothing of rally's by construction, and a memfd
    nobody holds is already freed, so "held by a process" is the whole question; a file of
    rally's appearing in /dev/shm would be a regression, and is checked as well."""
    before = set(_rally_shared_memory()) | set(_rally_files_in_dev_shm())
    yield
    deadline = time.monotonic() + 10
    while left := [x for x in _rally_shared_memory() + _rally_files_in_dev_shm() if x not in before]:
        if time.monotonic() > deadline:
            pytest.fail(f"shared memory left behind by the test: {left}")
        time.sleep(0.05)


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "same_under_load: in a fault module, a case whose fault a busy CPU cannot change (bad input, a "
        "schema, a signature check, the addresses a store binds, a wait for what never comes, bounded by a "
        "clock, a fault the test places at a fixed point, what the kernel does at once): .ci/run's CPU-hog "
        "pass leaves it out (-m 'not same_under_load'); a comment above each says why",
    )


# The SLURM tests share one dev cluster of 3 nodes (tests/support/slurm_cluster.py): under pytest-xdist
# they run in one worker, one job at a time, as in a single session.
_SLURM_MODULES = {"test_slurm_cluster", "test_slurm_jobs"}


# The modules that take longest in .ci/run's main pass, longest first (measured per module: the sum
# of its tests' wall times in a whole main pass at -n 3): they start first, so that the pass does not
# end with one worker alone on a long module while the others are idle (the longest first, then
# whatever is free to the worker that is free: within a module's length of even). A module that
# grows long belongs here; one that is gone is ignored.
_LONGEST_FIRST = (
    "test_inprocess_restart",
    "test_health",  # one test waits out the real 60 s default hang bound
    "test_faults_hostile",
    "test_checkpoint_trust",
    "test_bad_input",
    "test_multinode",
    "test_template",
    "test_job_end_bounded",
    "test_faults_memory_tier",
    "test_logs",
    "test_faults_trust",
    "test_preflight",
    "test_sharded_jobs",
    "test_env_contract",
    "test_faults_local",
    "test_exit_and_signals",
    "test_faults_membership",
    "test_faults_store_reach",
    "test_status_hostile",
    "test_wait_lines",
    "test_snippets",
    "test_faults_processes",
)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's; without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (.ci/run's main pass: `-n 3`) each test module runs whole in one
    worker, so a module-scoped fixture (one store, one job, one built wheel) is still made once;
    the SLURM modules share one worker (the one cluster). The modules of _LONGEST_FIRST go first,
    in its order, then those with more tests."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if Path(path).stem in _SLURM_MODULES else path

        def _assign_work_unit(self, node: object) -> None:
            if not self.ordered:  # the first assignment: the queue is whole, ordered by test count
                self.ordered = True
                rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
                longest = sorted((s for s in self.workqueue if Path(s).stem in rank), key=lambda s: rank[Path(s).stem])
                for scope in reversed(longest):
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)  # type: ignore[arg-type]

    return ByModule(config, log)
