"""`--metrics-port PORT`: this node's agent as Prometheus metrics at http://HOST:PORT/metrics.

prometheus-client's WSGI app renders the text format, served from one thread that drops idle and
slow clients (agent/observe/metrics_http.py). Nothing is pushed or updated on a
timer: at each scrape `AgentCollector` builds the metrics from the same status record
that the live view and `rally status` show (agent/agent.py `_status_record`), plus the round
ends this node has seen (its report). So a scrape costs nothing between scrapes, and the numbers
can never disagree with the other views.

Names follow Prometheus' conventions (base units, `_total` for counters, a `_info` gauge);
every metric carries a `run_id` label, every worker metric also `rank`, `local_rank` and `host`:

    rally_build_info{version,torch,python}  1; the versions this agent runs with
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
    rally_worker_cpu_seconds_total       CPU time (user + system) of the worker process
    rally_worker_rss_bytes               resident memory
    rally_worker_gpu_memory_bytes        GPU memory of the worker and its children (with NVML)
    rally_worker_gpu_utilization_percent its GPU utilisation (with NVML)
    rally_gpu_problems_total             GPU problems found on this node so far (ECC, XID, ...; with NVML)
    rally_preflight_seconds{probe}       this node's last pre-flight numbers: compute, link, allreduce
                                         (agent/checks/preflight.py)
    rally_preflight_left_out{node}       1 for each node the last pre-flight left out
    rally_checkpoint_saved_step          the newest step saved on this node, in memory or on disk
    rally_checkpoint_durable_step        the newest step this node made durable on disk

The endpoint listens on loopback by default (`--metrics-addr 127.0.0.1`): what it says (hosts,
ranks, restarts, the run id) is nobody else's business until the user opens it, and a Prometheus
(or a node_exporter-style agent) on the node itself can scrape it there. `--metrics-addr 0.0.0.0`
(or one interface's address) opens it to a Prometheus on another machine.
"""

from __future__ import annotations

import platform
import socket
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rally.agent.observe.metrics_http import BoundedHttpServer

WORKER_STATES = ("running", "succeeded", "failed", "stopped")
# Round ends that count as failures (a node lost counts: the job lost work to it).
FAILURE_END_KINDS = ("worker_failed", "worker_hung", "node_lost")
DEFAULT_ADDRESS = "127.0.0.1"  # this host only; --metrics-addr 0.0.0.0 lets a Prometheus elsewhere scrape it
WILDCARDS = ("", "0.0.0.0", "::")

WORKER_GAUGES = (
    ("heartbeat_age_seconds", "heartbeat_age", "Seconds since the worker's last rally.job.heartbeat()."),
    ("step", "step", "The last step the worker gave to rally.job.heartbeat(step=N)."),
    ("step_seconds", "step_time", "The worker's seconds per step over --straggler-window steps."),
    ("rss_bytes", "rss", "Resident memory of the worker process."),
    ("gpu_memory_bytes", "gpu_memory", "GPU memory of the worker and its children (NVML)."),
    ("gpu_utilization_percent", "gpu_utilization", "GPU utilisation of the worker (NVML)."),
)


def build_versions(rally_version: str) -> dict[str, str]:
    """rally's (as the launcher gave it in the job's spec), torch's and Python's versions, read
    without importing torch (the agent never does)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    return {"version": rally_version, "torch": torch_version, "python": platform.python_version()}


CHECKPOINT_GAUGES = [
    (
        "checkpoint_saved_step",
        "rally_checkpoint_saved_step",
        "The newest step saved on this node (in memory or on disk).",
    ),
    ("checkpoint_durable_step", "rally_checkpoint_durable_step", "The newest step this node made durable on disk."),
]


class AgentCollector(Collector):
    """Builds every metric at scrape time from the agent's status record and its round ends."""

    def __init__(
        self,
        snapshot: Callable[[], dict | None],
        round_ends: Callable[[], list[str]],
        run_id: str = "",
        rally_version: str = "",
    ):
        """`snapshot` returns the status record (None before the first round); `round_ends`
        returns the kind of every round end this node has seen, oldest first; `run_id` labels
        every metric, so one Prometheus can tell the jobs of a shared node apart."""
        self.snapshot = snapshot
        self.round_ends = round_ends
        self.run_id = run_id
        self.versions = build_versions(rally_version)

    def _one(self, family: type, name: str, text: str, value: float) -> Metric:
        metric = family(name, text, labels=["run_id"])
        metric.add_metric([self.run_id], float(value))
        return metric

    def collect(self) -> Iterator[Metric]:
        record = self.snapshot() or {}
        ends = self.round_ends()
        info = GaugeMetricFamily(
            "rally_build_info",
            "1; the versions of rally, torch and Python this agent runs with.",
            labels=["run_id", *self.versions],
        )
        info.add_metric([self.run_id, *self.versions.values()], 1.0)
        yield info
        failures = CounterMetricFamily(
            "rally_failures", "Round ends this node saw that were failures, by kind.", labels=["run_id", "kind"]
        )
        for kind in FAILURE_END_KINDS:
            failures.add_metric([self.run_id, kind], float(ends.count(kind)))
        yield failures
        if not record:
            return
        yield self._one(GaugeMetricFamily, "rally_round", "The current rendezvous round.", record.get("round", 0))
        yield self._one(
            CounterMetricFamily, "rally_restarts", "Job-wide restarts so far.", record.get("restart_count", 0)
        )
        yield self._one(GaugeMetricFamily, "rally_world_size", "Workers in the job.", record.get("world_size", 0))
        if record.get("group_world_size") is not None:
            yield self._one(GaugeMetricFamily, "rally_nodes", "Nodes in the current round.", record["group_world_size"])
        for field, name, text in CHECKPOINT_GAUGES:
            if record.get(field) is not None:
                yield self._one(GaugeMetricFamily, name, text, record[field])
        if record.get("gpu_problems_total") is not None:
            yield self._one(
                CounterMetricFamily,
                "rally_gpu_problems",
                "GPU problems found on this node so far (ECC, XID, ...).",
                record["gpu_problems_total"],
            )
        yield from self._workers(record)
        yield from _preflight(record.get("preflight"))

    def _workers(self, record: dict) -> Iterator[Metric]:
        host = str(record.get("host", ""))
        labels = ["run_id", "rank", "local_rank", "host"]
        state = GaugeMetricFamily("rally_worker_state", "1 for the worker's current state.", labels=[*labels, "state"])
        straggler = GaugeMetricFamily(
            "rally_worker_straggler", "1 while the worker is named a straggler.", labels=labels
        )
        cpu = CounterMetricFamily(
            "rally_worker_cpu_seconds", "CPU time (user + system) of the worker process.", labels=labels
        )
        gauges = {
            key: GaugeMetricFamily(f"rally_worker_{name}", text, labels=labels) for name, key, text in WORKER_GAUGES
        }
        for w in record.get("workers") or []:
            ids = [self.run_id, str(w.get("rank")), str(w.get("local_rank")), host]
            for name in WORKER_STATES:
                state.add_metric([*ids, name], 1.0 if w.get("state") == name else 0.0)
            straggler.add_metric(ids, 1.0 if w.get("straggler") else 0.0)
            if isinstance(w.get("cpu_seconds"), (int, float)):
                cpu.add_metric(ids, float(w["cpu_seconds"]))
            for key, family in gauges.items():
                value = w.get(key)
                if isinstance(value, (int, float)):
                    family.add_metric(ids, float(value))
        yield state
        yield straggler
        yield from (family for family in (cpu, *gauges.values()) if family.samples)


def _preflight(last: object) -> Iterator[Metric]:
    """The status record's "preflight" (agent/checks/preflight.py): this node's numbers, and who was left out."""
    if not isinstance(last, dict):
        return
    probes = GaugeMetricFamily(
        "rally_preflight_seconds", "This node's last pre-flight probe, by probe.", labels=["probe"]
    )
    for probe in ("compute", "link", "allreduce"):
        if isinstance(last.get(probe), (int, float)):
            probes.add_metric([probe], float(last[probe]))
    yield probes
    left_out = GaugeMetricFamily(
        "rally_preflight_left_out", "Nodes the last pre-flight check left out of the round.", labels=["node"]
    )
    for node in last.get("left_out") or []:
        left_out.add_metric([str(node)], 1.0)
    yield left_out


class MetricsServer:
    """The /metrics endpoint: prometheus-client's WSGI app behind a one-thread server that drops
    idle and slow clients (agent/observe/metrics_http.py), so nobody who reaches the port can
    make the agent start threads or stop the scrapes."""

    def __init__(self, port: int, collector: Collector, addr: str = DEFAULT_ADDRESS):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.addr = addr
        self.server = BoundedHttpServer(addr, port, make_wsgi_app(self.registry))
        self.port: int = self.server.server_port

    @property
    def url(self) -> str:
        """Where to scrape: this host's name when listening everywhere, else the address itself."""
        host = socket.gethostname() if self.addr in WILDCARDS else self.addr
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.close(timeout=5)


def serve(
    port: int,
    snapshot: Callable[[], dict | None],
    round_ends: Callable[[], list[str]],
    run_id: str = "",
    addr: str = DEFAULT_ADDRESS,
    rally_version: str = "",
) -> MetricsServer:
    """Start serving; raises OSError with a one-line reason when the address cannot be bound."""
    try:
        return MetricsServer(port, AgentCollector(snapshot, round_ends, run_id, rally_version), addr)
    except OSError as exc:
        where = f"--metrics-port {port}" if addr == DEFAULT_ADDRESS else f"--metrics-addr {addr} --metrics-port {port}"
        raise OSError(
            f"{where}: cannot listen ({exc.strerror or exc}); pick a free port (0: any free one) and an "
            "address of this host"
        ) from None


def round_end_kinds(attempts: list[Any]) -> list[str]:
    """The end kind of each finished attempt in a JobReport's attempts."""
    return [a.end.get("kind", "") for a in list(attempts) if a.end]
