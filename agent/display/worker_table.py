"""The one renderer of worker tables: the live view, `rally status` and the final report.

Every table is built from the same records (agent/observe/status_record.py, and the report's per-worker
rows), so a column means the same thing wherever it appears. A column is shown only when some
worker has a value for it (no GPU column without GPUs, no step column before `heartbeat(step)`).
Imports only rich: the agent and the launcher may both use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.table import Table

MIB = 1024 * 1024

Cell = Callable[[dict], str]


def _has(key: str) -> Callable[[list[dict]], bool]:
    return lambda workers: any(w.get(key) is not None for w in workers)


def _heartbeat(worker: dict) -> str:
    age = worker.get("heartbeat_age")
    return "-" if age is None else f"{age:.1f} s ago"


def step_time_cell(worker: dict) -> str:
    value = worker.get("step_time")
    if value is None:
        return "-"
    return f"{value:.3f} slow" if worker.get("straggler") else f"{value:.3f}"


def _or_dash(key: str, fmt: Callable[[Any], str] = str) -> Cell:
    return lambda w: "-" if w.get(key) is None else fmt(w[key])


# (header, cell, shown when): in the order they appear.
WORKER_COLUMNS: list[tuple[str, Cell, Callable[[list[dict]], bool]]] = [
    ("rank", _or_dash("rank"), lambda _: True),
    ("local", _or_dash("local_rank"), _has("exit")),  # the final report: which process it was
    ("pid", _or_dash("pid"), lambda _: True),
    ("state", lambda w: w.get("state") or "-", lambda _: True),
    ("exit", _or_dash("exit"), _has("exit")),
    ("duration", _or_dash("duration", lambda v: f"{v:.1f} s"), _has("duration")),
    ("cpu %", _or_dash("cpu", lambda v: f"{v:.0f}"), _has("cpu")),
    ("rss MiB", _or_dash("rss", lambda v: f"{v / MIB:.0f}"), _has("rss")),
    ("gpu MiB", _or_dash("gpu_memory", lambda v: f"{v / MIB:.0f}"), _has("gpu_memory")),
    ("gpu %", _or_dash("gpu_utilization"), _has("gpu_utilization")),
    ("step", _or_dash("step"), _has("step")),
    ("s/step", step_time_cell, _has("step")),
    ("heartbeat", _heartbeat, lambda ws: any("heartbeat_age" in w for w in ws)),
    ("section", lambda w: w.get("section") or "", lambda ws: any(w.get("section") for w in ws)),
]

# Columns about the node, filled on its first row only (`rally status`: every node of the job).
NODE_COLUMNS: list[tuple[str, Callable[[dict, float], str]]] = [
    ("node", lambda n, _: str(n.get("group_rank", ""))),
    ("host", lambda n, _: str(n.get("host", ""))),
    ("round", lambda n, _: str(n.get("round", ""))),
    ("restarts", lambda n, _: str(n.get("restart_count", ""))),
    ("checkpoint", lambda n, _: _checkpoint(n)),
    ("keep-alive", lambda n, now: f"{now - n['updated']:.1f} s ago" if n.get("updated") else "-"),
]


def _checkpoint(node: dict) -> str:
    """The newest step this node saved (memory tier) and the newest durable one: "30 (25 on disk)"."""
    saved, durable = node.get("checkpoint_saved_step"), node.get("checkpoint_durable_step")
    if saved is None and durable is None:
        return "-"
    if saved is None or saved == durable:
        return f"{durable} on disk"
    return f"{saved} ({durable if durable is not None else 'none'} on disk)"


RIGHT_ALIGNED = ("cpu %", "rss MiB", "gpu MiB", "gpu %", "step", "s/step")


def worker_table(
    nodes: list[dict], title: str, *, caption: str | None = None, per_node: bool = False, now: float | None = None
) -> Table:
    """A row per worker of `nodes` (each a record with "workers"); with `per_node`, the node's
    own columns lead and a node without workers still gets a row."""
    now = time.time() if now is None else now
    workers = [w for n in nodes for w in n.get("workers") or []]
    shown = [(header, cell) for header, cell, wanted in WORKER_COLUMNS if wanted(workers)]
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left", expand=False)
    for header in [h for h, _ in NODE_COLUMNS] if per_node else []:
        table.add_column(header)
    for header, _ in shown:
        table.add_column(header, justify="right" if header in RIGHT_ALIGNED else "left")
    for node in sorted(nodes, key=_node_order) if per_node else nodes:
        rows = node.get("workers") or ([{}] if per_node else [])
        for i, w in enumerate(rows):
            lead = [cell(node, now) if i == 0 else "" for _, cell in NODE_COLUMNS] if per_node else []
            table.add_row(*lead, *(cell(w) if w else "" for _, cell in shown))
    return table


def _node_order(node: dict) -> tuple[int, str]:
    """Nodes by group rank, then host; a record without them (or with nulls: `rally status`
    shows records anyone may have written) sorts as rank 0, host ""."""
    rank = node.get("group_rank")
    return (rank if isinstance(rank, int) else 0, str(node.get("host") or ""))


def straggler_line(worker: dict, host: str | None) -> str:
    """One line about a straggling worker, for the live view and `rally status`."""
    s = worker["straggler"]
    ratio = s["step_time"] / s["median"] if s.get("median") else float("inf")
    others = "the job's" if s.get("scope") == "job" else "this node's"
    where = f" on {host}" if host else ""
    return (
        f"straggler: rank {worker['rank']}{where} takes {s['step_time']:.3f} s per step, "
        f"{ratio:.1f}x the median of {others} other ranks ({s['median']:.3f} s)"
    )


def hang_line(node: dict, now: float) -> str | None:
    """The hang a node reported while the job goes on (agent/observe/hang_watch.py), for the live view
    and `rally status`; None when it reports none."""
    hang = node.get("hang")
    if not isinstance(hang, dict) or not hang.get("detail"):
        return None
    at = hang.get("time")
    ago = f" (reported {max(0.0, now - at):.0f} s ago)" if isinstance(at, (int, float)) else ""
    return f"hang: {hang['detail']}{ago}"
