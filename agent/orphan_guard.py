"""A tiny watchdog process that kills the workers' process groups if the agent is SIGKILLed.

PR_SET_PDEATHSIG already kills each worker when the agent dies, but not what the worker
started (a data loader, a shell pipeline): those are re-parented to init and would live on.
The agent starts this guard once, with a pipe on its stdin, and writes the process group
of every worker it starts. When the pipe reaches end-of-file, the agent is gone (however it
died), and the guard SIGKILLs every group it was told about, then exits. It imports nothing
heavy and ignores the terminal's and SLURM's signals, so it outlives the agent long enough
to do its one job. Run as `python -m agent.orphan_guard`.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin.buffer:  # returns at EOF: the agent closed the pipe or died
        word = line.strip()
        if word.startswith(b"-"):
            groups.discard(int(word[1:]))
        elif word:
            groups.add(int(word))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    main()
