"""A bench run's scratch directory, removed however the run ends.

The checkpoint bench writes 400 MB per step into it, so a run that left it behind could fill /tmp
(killed runs once left ~60 GB there). :func:`scratch_dir` removes it on a normal finish, on an
exception, and on SIGINT, SIGTERM and SIGHUP (turned into ``KeyboardInterrupt`` so every
``finally`` on the way runs: the bench kills its jobs first). A SIGKILLed run cannot clean up:
its directory carries its pid (``rally_bench_<pid>_*``), and the next run removes every such
directory whose process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PREFIX = "rally_bench_"
_OWNED = re.compile(rf"^{PREFIX}(\d+)_")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that end a run the way Ctrl-C does (SIGINT raises KeyboardInterrupt already)."""


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def remove_abandoned(parent: Path | None = None) -> list[Path]:
    """Delete scratch directories of bench runs that died without cleaning up (their pid is gone)."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for path in parent.glob(f"{PREFIX}*"):
        match = _OWNED.match(path.name)
        if not match or not path.is_dir():
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # its run is alive (or the pid is someone else's now: leave it, never guess)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def scratch_dir(keep: bool, parent: Path | None = None) -> Iterator[Path]:
    """A fresh scratch directory for one run; deleted at the end unless ``keep`` (then its path is printed)."""
    for path in remove_abandoned(parent):
        print(f"removed the scratch directory of a bench run that died: {path}", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_", dir=parent))
    previous = {signum: signal.signal(signum, _interrupt) for signum in STOP_SIGNALS}
    try:
        yield root
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if keep:
            print(f"scratch kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
