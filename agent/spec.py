"""What one node's agent runs: the validated job description the launcher hands to the agent."""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field

STDOUT = 1
STDERR = 2


@dataclass(frozen=True)
class JobSpec:
    """Everything the agent needs to start, watch and restart this node's workers.

    `redirects` and `tee` map a local rank to torchrun's stream bits (1 = stdout, 2 = stderr,
    3 = both), already expanded for every local rank.
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    run_id: str = "none"
    role: str = "default"
    max_restarts: int = 0
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    prefix_output: bool = True
    shutdown_timeout: float = 30.0
    signals_to_handle: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    checkpoint_dir: str | None = None
    python_exec: str = sys.executable
    cwd: str | None = None

    def command(self) -> list[str]:
        """The worker's argv, as torchrun builds it."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [self.python_exec, "-u", "-m", self.entrypoint, *self.args]
        if self.run_path:
            runner = (
                "import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')"
            )
            return [self.python_exec, "-u", "-c", runner, self.entrypoint, *self.args]
        return [self.python_exec, "-u", self.entrypoint, *self.args]

    def shows_on_console(self, local_rank: int) -> bool:
        return self.local_ranks_filter is None or local_rank in self.local_ranks_filter
