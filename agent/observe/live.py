"""The live view: on a terminal, a table of this node's workers above their scrolling output.

Only used when both stdout and stderr are terminals (`LiveView.wanted`); off a terminal (CI,
SLURM logs, pipes) rally prints plain timestamped lines and no control codes. While the view is
up, worker lines are printed through rich's console so they scroll above the table instead of
tearing it; rich does all the terminal work.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rally.agent.display.worker_table import hang_line, straggler_line, worker_table

REFRESH_PER_SECOND = 2


class ConsoleSink:
    """A binary stream look-alike that prints whole lines through a rich console.

    A progress redraw (a piece ending in '\r', see agent/rounds/output.py) cannot overwrite a line
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
        """The table, a hang the node reported (agent/observe/hang_watch.py: as wide as the terminal, not
        the table), then each worker's latest progress redraw (see ConsoleSink)."""
        record = self.snapshot() or {}
        progress = [
            Text.from_ansi(line, no_wrap=True, overflow="ellipsis") for line in list(self.sink.progress.values())
        ]
        hang = hang_line(record, time.time())
        return Group(render_workers(record), *([Text(hang, style="bold yellow")] if hang else []), *progress)


def render_workers(record: dict) -> Table:
    """This node's workers (agent/display/worker_table.py), with a caption naming the stragglers."""
    title = (
        f"rally · node {record.get('group_rank', '?')} · round {record.get('round', '?')} · "
        f"restarts {record.get('restart_count', 0)} · world {record.get('world_size', '?')}"
    )
    stragglers = [w for w in record.get("workers", []) if w.get("straggler")]
    caption = "\n".join(straggler_line(w, record.get("host")) for w in stragglers) or None
    return worker_table([record], title, caption=caption)
