"""`--gpu-reclaim-timeout`: before the next round, wait until the old workers have left every GPU.

A worker that got SIGKILL is gone from the process table at once, but the driver may take seconds
to tear down its CUDA context; new workers that start meanwhile find the GPU's memory still
taken and fail with "CUDA out of memory", which would be blamed on the job. NVIDIA's ft_launcher
waits for it (`--ft-gpu-memory-reclaim-timeout`); so does rally: with NVML (agent/observe/gpu.py), after
the workers are stopped and before the node joins the next round, it reads the GPUs until no
process of the old workers is listed on any of them and each GPU's memory in use is back to what
it was before those workers started (within `RECLAIM_SLACK_BYTES`, for other tenants' drift),
at most `--gpu-reclaim-timeout` seconds; a GPU that stays occupied is named, and the node goes on.

The judgement is a pure function over `DeviceReading`s (`still_occupied`), tested without GPUs;
NVML has no event for this, so the wait reads every `RECLAIM_POLL_SECONDS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial

from rally.agent.observe.gpu import MIB, DeviceReading
from rally.rendezvous.status.long_wait import left_line
from rally.rendezvous.status.waiting import WaitProgress

RECLAIM_POLL_SECONDS = 0.1
# Memory above the baseline that still counts as free: other processes on a shared GPU move it a little.
RECLAIM_SLACK_BYTES = 256 * MIB


def still_occupied(devices: Iterable[DeviceReading], pids: set[int], baseline: dict[int, int]) -> list[str]:
    """Why a GPU is not yet free of the old workers: their processes, or memory above `baseline`
    (bytes in use per GPU index before they started). Empty: every GPU is reclaimed."""
    problems = []
    for device in devices:
        where = f"GPU {device.index}" + (f" ({device.uuid})" if device.uuid else "")
        left = sorted(pid for pid in device.processes if pid in pids)
        if left:
            held = sum(device.processes[pid] for pid in left)
            problems.append(
                f"{where}: old worker process{'es' if len(left) > 1 else ''} {', '.join(map(str, left))} still "
                f"hold {held / MIB:.0f} MiB"
            )
            continue
        before = baseline.get(device.index)
        if before is not None and device.memory_used > before + RECLAIM_SLACK_BYTES:
            problems.append(
                f"{where}: {device.memory_used / MIB:.0f} MiB in use, {before / MIB:.0f} MiB before the workers started"
            )
    return problems


def wait_reclaimed(
    read: Callable[[], list[DeviceReading]],
    pids: set[int],
    baseline: dict[int, int],
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    announce: Callable[[str], None] = lambda _line: None,
) -> tuple[list[str], float]:
    """Read the GPUs until `still_occupied` is empty or `timeout` passes; (what is left, seconds waited).
    Every few seconds meanwhile, `announce` hears what is still occupied and for how long at most."""
    started = clock()
    progress = WaitProgress(announce)
    while True:
        problems = still_occupied(read(), pids, baseline)
        waited = clock() - started
        if not problems or waited >= timeout:
            return problems, waited
        line = left_line(
            f"waiting for the last round's workers to leave the GPUs ({'; '.join(problems)})", timeout - waited
        )
        progress.tick(partial(str, line))  # this pass's line (a lambda would see the loop's last)
        # wait: short: RECLAIM_POLL_SECONDS (0.1 s) between GPU reads, up to --gpu-reclaim-timeout
        sleep(min(RECLAIM_POLL_SECONDS, max(timeout - waited, 0.0)))


def gpu_processes_of(devices: Iterable[DeviceReading], workers: set[int]) -> set[int]:
    """The processes on the GPUs that descend from `workers` (a DataLoader child holds CUDA memory too)."""
    import psutil

    found = set()
    for pid in {pid for device in devices for pid in device.processes} - workers:
        try:
            if any(parent.pid in workers for parent in psutil.Process(pid).parents()):
                found.add(pid)
        except psutil.Error:
            continue
    return found
