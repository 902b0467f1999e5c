"""`--metrics-port PORT`: this node's agent as Prometheus metrics at http://HOST:PORT/metrics.

prometheus-client serves the text format from a thread. Nothing is pushed or updated on a
timer: at each scrape :class:`AgentCollector` builds the metrics from the same status record
that the live view and `rally status` show (agent/agent.py `_status_record`), plus the round
ends this node has seen (its report). So a scrape costs nothing between scrapes, and the numbers
can never disagree with the other views.

Metrics (every worker metric carries `rank`, `local_rank` and `host` labels):

    rally_round                          the current rendezvous round
    rally_restarts_total                 job-wide restarts so far (TORCHELASTIC_RESTART_COUNT)
    rally_world_size                     workers in the job
    rally_nodes                          nodes in the current round
    rally_failures_total{kind}           round ends this node saw, by kind (worker_failed, worker_hung, node_lost, ...)
    rally_worker_state{state}            1 for the worker's state (running, succeeded, failed, stopped), else 0
    rally_worker_heartbeat_age_seconds   since its last rally.job.heartbeat()
    rally_worker_step                    the last step it gave to heartbeat(step=N)
    rally_worker_step_seconds            its seconds per step over --straggler-window steps
    rally_worker_straggler               1 while it is named a straggler
    rally_worker_cpu_percent             CPU of the worker (100 = one core)
    rally_worker_rss_bytes               resident memory
    rally_worker_gpu_memory_bytes        GPU memory of the worker and its children (with NVML)
    rally_worker_gpu_utilization_percent its GPU utilisation (with NVML)
    rally_gpu_problems                   GPU problems found on this node (ECC, XID, ...; with NVML)
    rally_checkpoint_saved_step          the newest step saved on this node, in memory or on disk
    rally_checkpoint_durable_step        the newest step this node made durable on disk
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

WORKER_STATES = ("running", "succeeded", "failed", "stopped")
# Round ends that count as failures (a node lost counts: the job lost work to it).
FAILURE_END_KINDS = ("worker_failed", "worker_hung", "node_lost")
LISTEN_ADDRESS = "0.0.0.0"  # Prometheus scrapes from another machine

WORKER_GAUGES = (
    ("heartbeat_age_seconds", "heartbeat_age", "Seconds since the worker's last rally.job.heartbeat()."),
    ("step", "step", "The last step the worker gave to rally.job.heartbeat(step=N)."),
    ("step_seconds", "step_time", "The worker's seconds per step over --straggler-window steps."),
    ("cpu_percent", "cpu", "CPU use of the worker process (100 = one core)."),
    ("rss_bytes", "rss", "Resident memory of the worker process."),
    ("gpu_memory_bytes", "gpu_memory", "GPU memory of the worker and its children (NVML)."),
    ("gpu_utilization_percent", "gpu_utilization", "GPU utilisation of the worker (NVML)."),
)


CHECKPOINT_GAUGES = [
    ("checkpoint_saved_step", "rally_checkpoint_saved_step", "The newest step saved on this node (in memory or on disk)."),
    ("checkpoint_durable_step", "rally_checkpoint_durable_step", "The newest step this node made durable on disk."),
]


class AgentCollector(Collector):
    """Builds every metric at scrape time from the agent's status record and its round ends."""

    def __init__(self, snapshot: Callable[[], dict | None], round_ends: Callable[[], list[str]]):
        """`snapshot` returns the status record (None before the first round); `round_ends`
        returns the kind of every round end this node has seen, oldest first."""
        self.snapshot = snapshot
        self.round_ends = round_ends

    def collect(self) -> Iterator[Metric]:
        record = self.snapshot() or {}
        ends = self.round_ends()
        failures = CounterMetricFamily("rally_failures", "Round ends this node saw that were failures, by kind.", labels=["kind"])
        for kind in FAILURE_END_KINDS:
            failures.add_metric([kind], float(ends.count(kind)))
        yield failures
        if not record:
            return
        yield GaugeMetricFamily("rally_round", "The current rendezvous round.", value=record.get("round", 0))
        yield CounterMetricFamily("rally_restarts", "Job-wide restarts so far.", value=record.get("restart_count", 0))
        yield GaugeMetricFamily("rally_world_size", "Workers in the job.", value=record.get("world_size", 0))
        if record.get("group_world_size") is not None:
            yield GaugeMetricFamily("rally_nodes", "Nodes in the current round.", value=record["group_world_size"])
        for field, name, text in CHECKPOINT_GAUGES:
            if record.get(field) is not None:
                yield GaugeMetricFamily(name, text, value=record[field])
        if record.get("gpu_problems") is not None:
            yield GaugeMetricFamily("rally_gpu_problems", "GPU problems on this node (ECC, XID, ...).", value=len(record["gpu_problems"]))
        yield from self._workers(record)

    def _workers(self, record: dict) -> Iterator[Metric]:
        host = str(record.get("host", ""))
        labels = ["rank", "local_rank", "host"]
        state = GaugeMetricFamily("rally_worker_state", "1 for the worker's current state.", labels=[*labels, "state"])
        straggler = GaugeMetricFamily("rally_worker_straggler", "1 while the worker is named a straggler.", labels=labels)
        gauges = {key: GaugeMetricFamily(f"rally_worker_{name}", text, labels=labels) for name, key, text in WORKER_GAUGES}
        for w in record.get("workers") or []:
            ids = [str(w.get("rank")), str(w.get("local_rank")), host]
            for name in WORKER_STATES:
                state.add_metric([*ids, name], 1.0 if w.get("state") == name else 0.0)
            straggler.add_metric(ids, 1.0 if w.get("straggler") else 0.0)
            for key, family in gauges.items():
                value = w.get(key)
                if isinstance(value, (int, float)):
                    family.add_metric(ids, float(value))
        yield state
        yield straggler
        yield from (family for family in gauges.values() if family.samples)


class MetricsServer:
    """The /metrics endpoint: prometheus-client's HTTP server in a daemon thread."""

    def __init__(self, port: int, collector: Collector):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.server, self.thread = start_http_server(port, addr=LISTEN_ADDRESS, registry=self.registry)
        self.port: int = self.server.server_port

    @property
    def url(self) -> str:
        return f"http://{socket.gethostname()}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(port: int, snapshot: Callable[[], dict | None], round_ends: Callable[[], list[str]]) -> MetricsServer:
    """Start serving; raises OSError with a one-line reason when the port cannot be bound."""
    try:
        return MetricsServer(port, AgentCollector(snapshot, round_ends))
    except OSError as exc:
        raise OSError(
            f"--metrics-port {port}: cannot listen ({exc.strerror or exc}); pick a free port, or 0 for any free one"
        ) from None


def round_end_kinds(attempts: list[Any]) -> list[str]:
    """The end kind of each finished attempt in a JobReport's attempts."""
    return [a.end.get("kind", "") for a in list(attempts) if a.end]
