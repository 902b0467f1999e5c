"""The live view: on a terminal, a table of this node's workers above their scrolling output.

Only used when both stdout and stderr are terminals (`LiveView.wanted`); off a terminal (CI,
SLURM logs, pipes) rally prints plain timestamped lines and no control codes. While the view is
up, worker lines are printed through rich's console so they scroll above the table instead of
tearing it; rich does all the terminal work.
"""

from __future__ import annotations

import sys
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

MIB = 1024 * 1024
REFRESH_PER_SECOND = 2


class ConsoleSink:
    """A binary stream look-alike that prints whole lines through a rich console.

    A progress redraw (a piece ending in '\r', see agent/output.py) cannot overwrite a line
    above the live table, so the latest redraw of each worker is shown below the table
    instead (`progress`, keyed by the worker's prefix) until that worker ends the line.
    """

    def __init__(self, console: Console):
        self.console = console
        self.progress: dict[str, str] = {}

    def write(self, data: bytes) -> int:
        text = data.decode(errors="replace")
        for piece in text.splitlines(keepends=True):
            line = piece.rstrip("\r\n")
            key = line.split(" ", 1)[0]
            if piece.endswith("\r"):
                self.progress[key] = line
                continue
            self.progress.pop(key, None)
            self.console.print(Text.from_ansi(line), soft_wrap=True, highlight=False)
        return len(data)

    def flush(self) -> None:
        pass


class LiveView:
    """A rich Live table fed by `snapshot()`, which returns this node's status record."""

    def __init__(self, console: Console, snapshot: Callable[[], dict | None]):
        self.console = console
        self.snapshot = snapshot
        self.sink = ConsoleSink(console)  # before Live, which renders once when it is built
        self.live = Live(
            get_renderable=self.render,
            console=console,
            refresh_per_second=REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    @staticmethod
    def wanted(console: Console) -> bool:
        return console.is_terminal and sys.stdout.isatty() and sys.stderr.isatty()

    def start(self) -> None:
        self.live.start()

    def stop(self) -> None:
        self.live.stop()

    def render(self) -> Group:
        """The table, then each worker's latest progress redraw (see ConsoleSink)."""
        progress = [Text.from_ansi(line, no_wrap=True, overflow="ellipsis") for line in list(self.sink.progress.values())]
        return Group(render_workers(self.snapshot() or {}), *progress)


def render_workers(record: dict) -> Table:
    """This node's workers as a table; the columns of GPUs, steps and sections only when there
    is something in them, and a caption naming the stragglers."""
    title = (
        f"rally · node {record.get('group_rank', '?')} · round {record.get('round', '?')} · "
        f"restarts {record.get('restart_count', 0)} · world {record.get('world_size', '?')}"
    )
    workers = record.get("workers", [])
    with_gpu = any(w.get("gpu_memory") is not None for w in workers)  # absent GPUs: no column
    with_steps = any(w.get("step") is not None for w in workers)
    with_sections = any(w.get("section") for w in workers)
    stragglers = [w for w in workers if w.get("straggler")]
    caption = "\n".join(straggler_line(w, record.get("host")) for w in stragglers) or None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left", expand=False)
    columns = ["rank", "pid", "state", "cpu %", "rss MiB"]
    columns += ["gpu MiB", "gpu %"] if with_gpu else []
    columns += ["step", "s/step"] if with_steps else []
    columns += ["heartbeat"] + (["section"] if with_sections else [])
    for column in columns:
        table.add_column(column, justify="right" if column.endswith(("%", "MiB", "step")) else "left")
    for w in workers:
        heartbeat = w.get("heartbeat_age")
        row = [str(w["rank"]), str(w["pid"]), w["state"], f"{w['cpu']:.0f}", f"{w['rss'] / MIB:.0f}"]
        if with_gpu:
            utilization = w.get("gpu_utilization")
            row += [f"{(w.get('gpu_memory') or 0) / MIB:.0f}", "-" if utilization is None else f"{utilization}"]
        if with_steps:
            row += ["-" if w.get("step") is None else str(w["step"]), step_time_cell(w)]
        row.append("-" if heartbeat is None else f"{heartbeat:.1f} s ago")
        if with_sections:
            row.append(w.get("section") or "")
        table.add_row(*row)
    return table


def step_time_cell(worker: dict) -> str:
    value = worker.get("step_time")
    if value is None:
        return "-"
    return f"{value:.3f} slow" if worker.get("straggler") else f"{value:.3f}"


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
