"""`--gpu-reclaim-timeout`: before a restart the agent waits until the old workers have left every
GPU and their memory is free, and names a GPU that stays occupied.

The judgement and the bounded wait need no GPU and are tested here with real processes standing
for the workers (a GPU "lists" a process exactly while it is alive, as NVML does); the same wait
against the real driver runs where NVML finds a GPU and is skipped, with the reason, elsewhere."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rally.agent.observe.gpu import MIB, DeviceReading, open_monitor
from rally.agent.observe.gpu_reclaim import RECLAIM_SLACK_BYTES, gpu_processes_of, still_occupied, wait_reclaimed

GIB = 1024 * MIB
BASE = 500 * MIB


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def _gpu_of(procs: list[subprocess.Popen]):
    """A GPU as NVML would read it while `procs` hold 1 GiB each: listed while alive (not zombies)."""

    def read() -> list[DeviceReading]:
        alive = {p.pid: GIB for p in procs if p.poll() is None}
        return [
            DeviceReading(
                index=0, uuid="GPU-test", memory_used=BASE + len(alive) * GIB, memory_total=16 * GIB, processes=alive
            )
        ]

    return read


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


@pytest.mark.timeout(30)
def test_the_wait_ends_when_the_old_workers_are_gone_and_their_memory_is_free():
    workers = [_sleeper(), _sleeper()]
    try:
        timer = threading.Timer(0.5, _kill, [workers])
        timer.start()
        problems, waited = wait_reclaimed(_gpu_of(workers), {p.pid for p in workers}, {0: BASE}, timeout=10)
        timer.join()
        assert problems == [] and 0.5 <= waited < 3, (problems, waited)
    finally:
        _kill(workers)


@pytest.mark.timeout(30)
def test_a_gpu_that_stays_occupied_is_named_after_the_bounded_wait():
    workers = [_sleeper()]
    try:
        started = time.monotonic()
        problems, waited = wait_reclaimed(_gpu_of(workers), {workers[0].pid}, {0: BASE}, timeout=0.5)
        assert 0.5 <= waited <= time.monotonic() - started < 2
        assert problems == [f"GPU 0 (GPU-test): old worker process {workers[0].pid} still hold 1024 MiB"]
    finally:
        _kill(workers)


def test_memory_above_the_baseline_counts_as_occupied_and_other_tenants_drift_does_not():
    gone = DeviceReading(index=1, memory_used=BASE + 2 * GIB, processes={4242: 2 * GIB})  # another job's process
    assert still_occupied([gone], {7, 8}, {1: BASE}) == ["GPU 1: 2548 MiB in use, 500 MiB before the workers started"]
    drift = DeviceReading(index=1, memory_used=BASE + RECLAIM_SLACK_BYTES, processes={})
    assert still_occupied([drift], {7, 8}, {1: BASE}) == []
    assert still_occupied([gone], {7, 8}, {}) == []  # no baseline (first round): only the processes count


@pytest.mark.timeout(30)
def test_a_workers_children_on_a_gpu_are_waited_for_too():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(parent.pid).children()
        devices = [DeviceReading(index=0, processes={child.pid: GIB, 1: GIB})]
        assert gpu_processes_of(devices, {parent.pid}) == {child.pid}
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        _kill([parent])


@pytest.mark.timeout(120)
def test_with_nvml_a_killed_cuda_process_leaves_the_gpu_within_the_timeout():
    monitor, reason = open_monitor()
    if monitor is None:
        pytest.skip(f"needs NVML and a GPU: {reason}")
    try:
        baseline = {d.index: d.memory_used for d in monitor.read()}
        worker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import torch, time; x = torch.ones(64 * 2**20, device='cuda'); print('ready', flush=True); "
                "time.sleep(60)",
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            assert worker.stdout.readline().strip() == "ready"
            assert any(worker.pid in d.processes for d in monitor.read())
        finally:
            _kill([worker])
        problems, waited = wait_reclaimed(monitor.read, {worker.pid}, baseline, timeout=30)
        assert problems == [], problems
    finally:
        monitor.close()


@pytest.mark.timeout(30)
def test_a_long_wait_for_the_gpus_says_what_still_holds_them_and_for_how_long_at_most():
    from rally.rendezvous.status.waiting import WAIT_PROGRESS_SECONDS

    workers = [_sleeper()]
    lines: list[str] = []
    try:
        wait_reclaimed(
            _gpu_of(workers), {workers[0].pid}, {0: BASE}, timeout=WAIT_PROGRESS_SECONDS + 2, announce=lines.append
        )
        held = f"GPU 0 (GPU-test): old worker process {workers[0].pid} still hold 1024 MiB"
        assert len(lines) == 1 and re.fullmatch(
            rf"waiting for the last round's workers to leave the GPUs \({re.escape(held)}\): up to [12] s more",
            lines[0],
        ), lines
    finally:
        _kill(workers)
