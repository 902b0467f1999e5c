"""--numa-binding: the CPUs torch picks near a worker's GPU reach the worker's process, and every
thread it starts, for plain starts (bound before exec) and template forks (bound by the bootstrap).

There is no GPU on the test machines, so the choice of CPUs (torch's own code) is exercised only
for its error path here; the binding itself is applied for real to real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rally.agent.base.numa import AFFINITY_VARIABLE, NumaBindingError, cpus_near_gpu, format_cpus, parse_cpus
from rally.agent.guard import processes
from rally.agent.worker_side import bootstrap

REPORT_AFFINITY = """
import json, os, sys, threading
seen = {}
def in_thread():
    seen["thread"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=in_thread); t.start(); t.join()
seen["main"] = sorted(os.sched_getaffinity(0))
print(json.dumps(seen))
"""

needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs at least two CPUs to tell a binding apart"
)


def _one_cpu() -> int:
    return max(os.sched_getaffinity(0))  # not the whole set, so a binding is visible


def test_cpu_lists_round_trip_and_accept_ranges():
    assert parse_cpus(format_cpus({3, 0, 1})) == {0, 1, 3}
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}


@needs_two_cpus
@pytest.mark.timeout(30)
def test_a_plain_start_is_bound_before_exec_with_every_thread(tmp_path: Path):
    script = tmp_path / "w.py"
    script.write_text(REPORT_AFFINITY)
    cpu = _one_cpu()
    out = tmp_path / "out"
    with out.open("wb") as sink:
        child = processes.spawn(
            [sys.executable, str(script)], {**os.environ, AFFINITY_VARIABLE: str(cpu)}, None, sink, None
        )
        assert child.popen.wait(timeout=20) == 0
    assert json.loads(out.read_text()) == {"main": [cpu], "thread": [cpu]}


@needs_two_cpus
@pytest.mark.timeout(30)
def test_a_template_forked_worker_binds_itself_in_the_bootstrap(tmp_path: Path):
    script = tmp_path / "w.py"
    script.write_text(REPORT_AFFINITY)
    cpu = _one_cpu()
    done = subprocess.run(
        [sys.executable, bootstrap.__file__, "file", str(script)],
        env={**os.environ, AFFINITY_VARIABLE: str(cpu)}, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"main": [cpu], "thread": [cpu]}


@pytest.mark.timeout(60)
def test_without_a_gpu_torch_cannot_place_a_worker_and_says_why():
    # A torch without torch.numa (older than the ones that have it) is named instead (.ci/torch-matrix).
    has_numa = importlib.util.find_spec("torch.numa") is not None
    reason = r"cannot find the CPUs near GPU 0" if has_numa else r"this torch \(\S+\) has no torch.numa.binding"
    with pytest.raises(NumaBindingError, match=r"--numa-binding node: " + reason):
        cpus_near_gpu("node", 0)
