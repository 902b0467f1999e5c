"""A checkpoint's memory copy on more than one core: one core's copy does not reach the memory's bandwidth.

A save's copy into the memory tier is a plain memory copy (agent/checkpoint/core/layout.py), and
one core copies at most ~5-6 GB/s on this kind of machine (400 MB in 0.07 s) while the memory
takes more: two threads copied the same 400 MB in 0.058 s (one: 0.076 s) at a load of 3. For an overlapped save
(agent/checkpoint/core/overlap.py) it matters more: the copy shares the cores with the training
step it overlaps, and the kernel's scheduler gives each runnable thread an equal share, so one
copy thread among two busy ranks gets two thirds of a core and outlasts a 0.1 s step, which the
next optimizer step's fence then waits for. Two copy threads get a core between them.

The bytes to copy are cut into `copy_threads()` contiguous parts of equal size (a tensor split
where a part ends), the first part copied on the calling thread, the others on helper threads
(started once per process, again after a fork); each part is one `torch._foreach_copy_`
(torch_internals.copy_tensors), which runs without the GIL. `RALLY_CKPT_COPY_THREADS` sets
their number (1: the copy on the calling thread alone, as before); by default 2, or 1 on a
process allowed a single CPU. Copies smaller than `SPLIT_BYTES` are not split.

What it costs: the helper threads' CPU time is taken from whatever else runs on the node's
cores at the same time (on a node whose cores all compute, from the training step). The
benchmarks' steps (bench/workers/ckpt.py, bench/workers/goodput.py) compute for a fixed time,
not a fixed amount of work, so what the copy takes from their compute does not show there as
a longer step (on a GPU node, whose step leaves most CPU cores idle, it costs little).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from rally.agent.checkpoint.core import torch_internals

if TYPE_CHECKING:
    import torch

COPY_THREADS_ENV = "RALLY_CKPT_COPY_THREADS"
"""How many threads copy a save's tensors (default 2; 1: one)."""
DEFAULT_COPY_THREADS = 2
MAX_COPY_THREADS = 16
SPLIT_BYTES = 16 << 20
"""Copies smaller than this (16 MiB) stay on the calling thread: a helper's hand-off would cost more."""


def copy_threads() -> int:
    """The number of threads a large copy uses: RALLY_CKPT_COPY_THREADS (read afresh: a forked
    worker's own), else 2, and never more than the CPUs this process may run on."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    raw = os.environ.get(COPY_THREADS_ENV, "")
    try:
        wanted = int(raw) if raw else DEFAULT_COPY_THREADS
    except ValueError:
        wanted = DEFAULT_COPY_THREADS
    return max(1, min(wanted, cpus, MAX_COPY_THREADS))


def split(places: list[torch.Tensor], data: list[torch.Tensor], parts: int) -> list[tuple[list, list]]:
    """`places` and `data` (flat uint8 tensors, pairwise of one size) cut into `parts` runs of
    (nearly) equal bytes, in order; a tensor that straddles a cut is sliced at it."""
    total = sum(d.numel() for d in data)
    out: list[tuple[list, list]] = [([], [])]
    room = -(-total // parts)  # ceil: the last part is the smallest
    left = room
    for place, source in zip(places, data, strict=True):
        start, size = 0, source.numel()
        while start < size:
            if left == 0:
                out.append(([], []))
                left = room
            take = min(left, size - start)
            out[-1][0].append(place[start : start + take])
            out[-1][1].append(source[start : start + take])
            start += take
            left -= take
    return out


class Helpers:
    """The helper threads of this process (daemon threads: they end with the process)."""

    def __init__(self) -> None:
        self._pid = 0
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()

    def ensure(self, count: int) -> queue.SimpleQueue[Callable[[], None]]:
        """At least `count` helper threads running in this process; their job queue."""
        with self._lock:
            if self._pid != os.getpid():  # a fork keeps no thread: start afresh (see after_fork)
                self._pid, self._jobs, self._started = os.getpid(), queue.SimpleQueue(), 0
            while self._started < count:
                threading.Thread(
                    target=self._serve, args=(self._jobs,), name="rally-ckpt-copy-helper", daemon=True
                ).start()
                self._started += 1
            return self._jobs

    def after_fork(self) -> None:
        """In a forked child (a DataLoader's worker, say): none of the parent's threads, and a
        lock one of them may have held at the fork is not this process's to wait for."""
        self._lock = threading.Lock()
        self._started = 0

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            # an idle helper thread blocks here until the next copy (a daemon: it ends with the process)
            jobs.get()()


_helpers = Helpers()
os.register_at_fork(after_in_child=_helpers.after_fork)


def copy(places: list[torch.Tensor], data: list[torch.Tensor]) -> None:
    """Copy each of `data` into its place in `places` on `copy_threads()` threads; returns once
    every byte is copied, raising the first part's error if one failed."""
    threads = copy_threads()
    if threads == 1 or sum(d.numel() for d in data) < SPLIT_BYTES:
        torch_internals.copy_tensors(places, data)
        return
    parts = split(places, data, threads)
    jobs = _helpers.ensure(len(parts) - 1)
    done = threading.Semaphore(0)
    errors: list[BaseException] = []

    def copy_part(part: tuple[list, list]) -> None:
        try:
            torch_internals.copy_tensors(*part)
        except BaseException as exc:  # raised on the calling thread below
            errors.append(exc)
        finally:
            done.release()

    for part in parts[1:]:
        jobs.put(lambda part=part: copy_part(part))  # type: ignore[misc]
    copy_part(parts[0])
    for _ in parts:  # every part releases once, the calling thread's own included
        # the other parts of the same copy, each about as long as the calling thread's own part
        done.acquire()
    if errors:
        raise errors[0]
