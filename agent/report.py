"""The root-cause report: the first failure, explained once, instead of a wall of secondary errors.

When a worker fails, its agent builds a `failure_info` (node, rank, pid, exit code or signal
name, the traceback from torch's `@record` error file, else the last lines of its stderr) and
publishes it as the round's end reason. Because the first reason to reach the store wins,
every node reports the same root cause. Each agent also keeps a record of every attempt and
writes it as `report.json` in its log directory.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from rally.agent.processes import describe_exit, exit_status_for_shell
from rally.agent.round_threads import StoreSilent
from rally.agent.workers import Worker, WorkerGroup
from rally.launcher.worker_table import worker_table
from rally.rendezvous.protocol import Assignment, EndKind, RoundEnd
from rally.rendezvous.store import StoreEndpoint, UntrustedValue

STDERR_LINES_IN_REPORT = 20
MAX_TRACEBACK_CHARS = 16_000


def read_error_file(path: str) -> str | None:
    """The traceback that torch's `@record` wrote, or None when there is no usable file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        text = extra.get("py_callstack") or message.get("message")
    else:
        text = message
    return str(text)[-MAX_TRACEBACK_CHARS:] if text else None


def failure_info(worker: Worker, assignment: Assignment) -> dict:
    """Everything a person needs about one failed worker, small enough for the store."""
    code = worker.returncode if worker.returncode is not None else 0
    return {
        "host": socket.gethostname(),
        "group_rank": assignment.group_rank,
        "rank": worker.global_rank,
        "local_rank": worker.local_rank,
        "pid": worker.pid,
        "returncode": code,
        "exit": describe_exit(code),
        "exit_status": exit_status_for_shell(code),
        "duration": round(worker.duration(), 3),
        "traceback": read_error_file(worker.error_file),
        "stderr_tail": worker.output.last_stderr_lines(STDERR_LINES_IN_REPORT),
        "error_file": worker.error_file,
        "time": time.time(),
    }


def failure_end(worker: Worker, assignment: Assignment, cause: str | None = None) -> RoundEnd:
    info = failure_info(worker, assignment)
    detail = (
        f"rank {info['rank']} (local rank {info['local_rank']}, pid {info['pid']}) on {info['host']} "
        f"failed with {info['exit']} after {info['duration']:.1f} s"
    )
    if cause:
        info["cause"] = cause
        detail += f": {cause}"
    return RoundEnd(EndKind.WORKER_FAILED, detail, info["host"], info)


def explain(end: RoundEnd) -> str:
    """The root cause as a few lines of text: what failed, then its traceback or stderr tail."""
    lines = [end.detail]
    info = end.info or {}
    if info.get("stacks"):
        lines += ["its Python stacks when it was found hung:", *("  " + line for line in info["stacks"])]
    if info.get("others"):  # a hang report (agent/hang_report.py): every other rank in one line
        lines += ["the other ranks:", *("  " + line for line in info["others"])]
    elif info.get("traceback"):
        lines += ["traceback (from its error file):", info["traceback"].rstrip()]
    elif info.get("stderr_tail"):
        lines += ["last lines of its stderr:", *("  " + line for line in info["stderr_tail"])]
    elif end.kind == EndKind.WORKER_FAILED:
        lines.append("it wrote nothing to stderr (no traceback: decorate main with torch's @record to get one)")
    return "\n".join(lines)


@dataclass
class AttemptRecord:
    """One round as this node saw it."""

    round: int
    restart_count: int
    group_rank: int
    group_world_size: int
    world_size: int
    started_at: float
    workers: list[dict] = field(default_factory=list)
    end: dict | None = None


@dataclass
class JobReport:
    """Every attempt of this node, written to `<run log dir>/report.json` after each round."""

    run_id: str
    host: str
    path: Path
    attempts: list[AttemptRecord] = field(default_factory=list)
    outcome: str = "running"
    exit_code: int | None = None
    quarantined: dict[str, str] = field(default_factory=dict)  # host -> why (agent/quarantine.py)

    def begin(self, assignment: Assignment) -> None:
        self.attempts.append(
            AttemptRecord(
                assignment.round,
                assignment.restart_count,
                assignment.group_rank,
                assignment.group_world_size,
                assignment.world_size,
                time.time(),
            )
        )

    def finish_attempt(self, group: WorkerGroup | None, end: RoundEnd) -> None:
        if not self.attempts:
            return
        attempt = self.attempts[-1]
        if group is not None:
            attempt.workers = [
                {
                    "host": self.host,
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state(),
                    "exit": w.describe_exit(),
                    "returncode": w.returncode,
                    "duration": round(w.duration(), 3),
                }
                for w in group.workers
            ]
        attempt.end = asdict(end)
        self.write()

    def write(self) -> None:
        data = {
            "run_id": self.run_id,
            "host": self.host,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "attempts": [asdict(a) for a in self.attempts],
            "quarantined": self.quarantined,
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.path)

    def workers_table(self) -> Table:
        """The last attempt's workers on this node, for the console (launcher/worker_table.py)."""
        rows = self.attempts[-1].workers if self.attempts else []
        return worker_table([{"host": self.host, "workers": rows}], f"workers on {self.host}")


def store_lost_line(exc: BaseException, endpoint: StoreEndpoint) -> str:
    """Why this node stops when its store is lost, silent or untrusted, and what to do next time."""
    if isinstance(exc, (StoreSilent, UntrustedValue)):
        return str(exc)
    if endpoint.etcd:
        return (
            f"{exc}; the job cannot go on without its rendezvous, so this node stops. Check the cluster: "
            f"etcdctl --endpoints {','.join(map(str, endpoint.etcd))} endpoint health"
        )
    return (
        f"{exc}; the rendezvous store at {endpoint} is gone, so this node stops. Its host "
        "was probably lost. To survive the loss of any compute node next time, run "
        "`rally store --port PORT` on a machine that does not train and point "
        "--rdzv-endpoint at it"
    )
