"""rally's own messages: one `rally:` line each on stderr, timestamped when not on a terminal.

Worker output goes to stdout/stderr through the agent's line router; rally's lines go through
here so that they are recognisable and, off a terminal (CI, SLURM logs), carry a timestamp
and no control codes. rich decides whether stderr is a terminal.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.markup import escape

_console = Console(stderr=True, highlight=False, soft_wrap=True)


def console() -> Console:
    return _console


def _stamp() -> str:
    if _console.is_terminal:
        return ""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d} "


def say(message: str) -> None:
    """An ordinary progress line."""
    _console.print(f"{_stamp()}[bold cyan]rally:[/] {escape(message)}", markup=True, emoji=False)


def warn(message: str) -> None:
    _console.print(f"{_stamp()}[bold yellow]rally: warning:[/] {escape(message)}", markup=True, emoji=False)


def error(message: str) -> None:
    _console.print(f"{_stamp()}[bold red]rally: error:[/] {escape(message)}", markup=True, emoji=False)


def plain_error(message: str) -> None:
    """For bad input before anything else ran: one uncoloured line, as a shell user expects."""
    sys.stderr.write(f"rally: error: {message}\n")
    sys.stderr.flush()
