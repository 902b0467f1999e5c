"""This node as `rally status`, the live view and /metrics see it: one JSON-able record.

The keep-alive thread publishes it to the store every few seconds (agent/rounds/threads.py), the
live view renders it (agent/observe/live.py), the observer turns it into metrics (agent/observe/metrics.py). It
is built from a snapshot of the worker group without locks: a worker that exits meanwhile shows
its old state until the next record, which is harmless for a display.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from rally.agent.observe.hang_report import StackSource
from rally.agent.observe.health import HealthMonitor
from rally.rendezvous.protocol import Assignment


class ShownWorker(StackSource, Protocol):
    def state(self) -> str:
        """Its process state as `rally status` shows it (running, exited 1, ...)."""


class ShownWorkers(Protocol):
    """This round's workers as the status record shows them (agent/rounds/workers.py's WorkerGroup is one)."""

    @property
    def workers(self) -> Sequence[ShownWorker]: ...


class Observations(Protocol):
    """What the observer adds to the record (agent/observe/observer.py's Observer is one)."""

    def worker_fields(self, worker: StackSource, health: HealthMonitor) -> dict: ...

    def node_fields(self) -> dict: ...


def node_status(
    host: str,
    node_id: str,
    assignment: Assignment,
    group: ShownWorkers | None,
    health: HealthMonitor,
    observer: Observations,
) -> dict:
    """`group` is the round's WorkerGroup (or None between rounds), `health` its HealthMonitor,
    `observer` adds step times, stragglers and GPUs (agent/observe/observer.py)."""
    workers = []
    for w in list(group.workers) if group else []:
        sample = health.resources(w.local_rank)
        workers.append(
            {
                "rank": w.global_rank,
                "local_rank": w.local_rank,
                "pid": w.pid,
                "state": w.state(),
                "cpu": sample.cpu_percent,
                "cpu_seconds": sample.cpu_seconds,
                "rss": sample.rss,
                "gpu_memory": sample.gpu_memory,
                "heartbeat_age": health.heartbeat_age(w.local_rank),
                **observer.worker_fields(w, health),
            }
        )
    return {
        "host": host,
        "node_id": node_id,
        "group_rank": assignment.group_rank,
        "round": assignment.round,
        "restart_count": assignment.restart_count,
        "world_size": assignment.world_size,
        "group_world_size": assignment.group_world_size,
        "updated": time.time(),
        "workers": workers,
        **observer.node_fields(),
    }
