"""What one node's agent runs: the validated job description the launcher hands to the agent."""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

STDOUT = 1
STDERR = 2
# The signal on which every Python worker dumps all its threads' stacks (see agent/worker_side/bootstrap.py).
# A real-time signal, so it never collides with a signal the training script uses.
STACK_SIGNAL = signal.SIGRTMIN + 2
BOOTSTRAP = str(Path(__file__).parent.parent / "worker_side" / "bootstrap.py")
# Seconds between samples of the workers' CPU, memory and threads (--resource-interval).
RESOURCE_INTERVAL_SECONDS = 5.0
# --straggler-factor and --straggler-window (agent/observe/stragglers.py says what they mean).
DEFAULT_FACTOR = 1.5
DEFAULT_WINDOW = 10


@dataclass(frozen=True)
class LearningSettings:
    """`--timeout-safety-factor`, `--timeout-samples`, `--timeout-floor` (agent/observe/learned_timeouts.py)."""

    factor: float = 5.0
    samples: int = 20
    floor: float = 30.0


@dataclass(frozen=True)
class SchedulerView:
    """What the scheduler this node runs under tells the agent (launcher/schedulers/: SLURM,
    Kubernetes' training operator, none), so that no module of the agent reads its variables."""

    name: str = "none"
    # How to keep this node out of the job when it runs again (SLURM: an `scontrol update ...
    # ExcNodeList=` command), "" when the scheduler offers no way; said when a node is quarantined.
    keep_node_out: str = ""
    # The scheduler tracks a job step by its own cgroups (SLURM): the job's own cgroup must be a v2
    # child, inside the step's, never a v1 one that would take the workers out of its list.
    tracks_cgroups: bool = False


@dataclass(frozen=True)
class JobSpec:
    """Everything the agent needs to start, watch and restart this node's workers.

    `redirects` and `tee` map a local rank to torchrun's stream bits (1 = stdout, 2 = stderr,
    3 = both), already expanded for every local rank.
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    rally_version: str = ""  # the launcher's (launcher/__init__.py): the agent reads no launcher module
    scheduler: SchedulerView = SchedulerView()  # what SLURM or Kubernetes says (launcher/schedulers/)
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
    # rally's "[rank] " on the worker streams torchrun does not tee (--no-prefix: none); --tee'd
    # lines always carry torchrun's header (agent/rounds/workers.py's tee_prefix)
    prefix_output: bool = True
    # $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, read as torchrun reads it: the header of --tee'd
    # lines from ${role_name}, ${rank}, ${local_rank} (None: torchrun's "[<role><local rank>]:")
    log_line_prefix_template: str | None = None
    quiet: bool = False  # --quiet: only rally's own lines on the console (log files unchanged)
    shutdown_timeout: float = 30.0
    signals_to_handle: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    preemption_signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGUSR2)
    preemption_grace: float = 60.0
    requeue: bool = False
    heartbeat_timeout: float | None = None
    timeout_learning: LearningSettings | None = None  # --heartbeat-timeout auto (agent/observe/learned_timeouts.py)
    gpu_reclaim_timeout: float = 30.0  # --gpu-reclaim-timeout (agent/observe/gpu_reclaim.py)
    quarantine_after: int = 2  # --quarantine-after, 0: never (agent/checks/quarantine.py)
    quarantine_window: float = 3600.0  # --quarantine-window
    preflight: bool = False  # --preflight (on by default for multi-node jobs; agent/checks/preflight.py)
    preflight_factor: float = 2.0  # --preflight-factor
    preflight_every_round: bool = False  # --preflight-every-round
    silence_timeout: float | None = None
    # --hang-report-after: report (never stop) a rank stuck while others wait for it in a collective; 0: off
    # (agent/observe/hang_watch.py, which says why 60 s); half of it bounds a rank alive once done (exit_watch.py)
    hang_report_after: float = 60.0
    resource_interval: float = RESOURCE_INTERVAL_SECONDS
    startup_timeout: float | None = None  # --startup-timeout: the first heartbeat is due within this
    straggler_factor: float = DEFAULT_FACTOR  # --straggler-factor: slower than this x the others' median step time
    straggler_window: int = DEFAULT_WINDOW  # --straggler-window: steps a step time is averaged over (and must persist)
    metrics_port: int | None = None  # --metrics-port: serve Prometheus /metrics (0: a free port)
    metrics_addr: str = "127.0.0.1"  # --metrics-addr: the address /metrics listens on (loopback; 0.0.0.0 opens it)
    checkpoint_dir: str | None = None
    # --checkpoint-dir as the user named it, once the agent holds it open and `checkpoint_dir` is
    # /proc/<agent pid>/fd/<n> (agent/checkpoint/core/held_dir.py); None before
    checkpoint_dir_given: str | None = None
    checkpoint_dir_shared: bool = False  # --checkpoint-dir-shared: other users may write it (signed checkpoints only)
    crash_loop_limit: int = 3  # stop after this many failures in a row without a newer checkpoint
    warm_spares: int = 0  # extra processes per node waiting in rally.job.run to take a dead rank's place
    python_exec: str = sys.executable
    cwd: str | None = None
    # Modules the worker template imports once (agent/template/client.py); workers are then forked
    # from it. None: every worker is started plainly (--no-preload, --no-python).
    preload: tuple[str, ...] | None = None
    virtual_local_rank: bool = False  # LOCAL_RANK=0, one GPU per worker (torchrun's flag)
    logs_specs: str | None = None  # torchrun.logs_specs entry point (agent/rounds/logs_specs.py)
    numa_binding: str | None = None  # torch's affinity mode; applied only where GPUs exist (agent/base/numa.py)
    # Lines containing any of these go to attempt_<n>/filtered_{stdout,stderr}.log as well.
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()

    @property
    def is_python(self) -> bool:
        return not self.no_python

    def command(self) -> list[str]:
        """The worker's argv: torchrun's `python -u script args`, through rally's bootstrap."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        mode = "module" if self.module else "path" if self.run_path else "script"
        return [self.python_exec, "-u", BOOTSTRAP, mode, self.entrypoint, *self.args]

    def shows_on_console(self, local_rank: int) -> bool:
        if self.quiet:
            return False
        return self.local_ranks_filter is None or local_rank in self.local_ranks_filter


def shared_worker_env(spec: JobSpec, base_env: dict[str, str]) -> dict[str, str]:
    """The part of every worker's environment that is the same for all ranks and rounds.

    The worker template (agent/template/client.py) starts with exactly this environment, so that
    what libraries read when they are loaded (OMP_NUM_THREADS by OpenMP and OpenBLAS) is what
    a worker started plainly would have read.
    """
    env = dict(base_env)
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base_env:
        env["OMP_NUM_THREADS"] = "1"
    return env
