"""The live view: on a terminal, a table of this node's workers above their scrolling output.

Only used when both stdout and stderr are terminals (`LiveView.wanted`); off a terminal (CI,
SLURM logs, pipes) rally prints plain timestamped lines and no control codes. While the view is
up, worker lines are printed through rich's console so they scroll above the table instead of
tearing it; rich does all the terminal work.
"""

from __future__ import annotations

import sys
from typing import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

MIB = 1024 * 1024
REFRESH_PER_SECOND = 2


class ConsoleSink:
    """A binary stream look-alike that prints whole lines through a rich console."""

    def __init__(self, console: Console):
        self.console = console

    def write(self, data: bytes) -> int:
        text = data.decode(errors="replace")
        for line in text.splitlines():
            self.console.print(Text.from_ansi(line), soft_wrap=True, highlight=False)
        return len(data)

    def flush(self) -> None:
        pass


class LiveView:
    """A rich Live table fed by `snapshot()`, which returns this node's status record."""

    def __init__(self, console: Console, snapshot: Callable[[], dict | None]):
        self.console = console
        self.snapshot = snapshot
        self.live = Live(
            get_renderable=self.render,
            console=console,
            refresh_per_second=REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.sink = ConsoleSink(console)

    @staticmethod
    def wanted(console: Console) -> bool:
        return console.is_terminal and sys.stdout.isatty() and sys.stderr.isatty()

    def start(self) -> None:
        self.live.start()

    def stop(self) -> None:
        self.live.stop()

    def render(self) -> Table:
        record = self.snapshot() or {}
        title = (
            f"rally · node {record.get('group_rank', '?')} · round {record.get('round', '?')} · "
            f"restarts {record.get('restart_count', 0)} · world {record.get('world_size', '?')}"
        )
        table = Table(title=title, title_justify="left", expand=False)
        workers = record.get("workers", [])
        with_gpu = any(w.get("gpu_memory") is not None for w in workers)  # absent GPUs: no column
        columns = ["rank", "pid", "state", "cpu %", "rss MiB", *(["gpu MiB"] if with_gpu else []), "heartbeat"]
        for column in columns:
            table.add_column(column, justify="right" if column.endswith(("%", "MiB")) else "left")
        for w in workers:
            heartbeat = w.get("heartbeat_age")
            gpu = [f"{(w.get('gpu_memory') or 0) / MIB:.0f}"] if with_gpu else []
            table.add_row(
                str(w["rank"]),
                str(w["pid"]),
                w["state"],
                f"{w['cpu']:.0f}",
                f"{w['rss'] / MIB:.0f}",
                *gpu,
                "-" if heartbeat is None else f"{heartbeat:.1f} s ago",
            )
        return table
