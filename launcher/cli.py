"""The `rally` command: torchrun's flags (both spellings, and PET_* variables) plus rally's own.

    rally [OPTIONS] SCRIPT [SCRIPT ARGS]...     run a training job (one rally per node)
    rally store --port PORT                     run a standalone rendezvous store
    rally status --rdzv-endpoint H:P --rdzv-id ID   show a running job

Precedence, highest first: command-line flags > environment (PET_<NAME>, as torchrun, or
RALLY_<NAME>) > the --config YAML file > SLURM (when inside a SLURM job) > defaults.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable

import click
from click.core import ParameterSource

from rally.launcher import __version__, console
from rally.launcher.config import ConfigError, build_launch, load_config_file

# Option declarations: (name, click kwargs, help group). The name's dashed and underscored
# spellings are both accepted, as torchrun accepts both.
GROUPS = ("Job", "Rendezvous", "Restarts and shutdown", "Logs and output", "Entry point", "Health", "rally extras")

OPTIONS: list[tuple[str, dict[str, Any], str]] = [
    ("nnodes", dict(default="1:1", metavar="N|MIN:MAX", help="Number of nodes, or MIN:MAX for an elastic job."), "Job"),
    ("nproc-per-node", dict(default="1", metavar="N|auto|cpu|gpu|xpu", help="Workers per node."), "Job"),
    ("role", dict(default="default", help="Worker role name (ROLE_NAME, log prefixes)."), "Job"),
    ("standalone", dict(is_flag=True, help="Single node: a private store on a free port, a random run id."), "Rendezvous"),
    ("rdzv-backend", dict(default="static", metavar="c10d|etcd|static", help="c10d: elastic rendezvous through a store; etcd (or etcd-v2): the same on an etcd cluster; static: fixed node ranks."), "Rendezvous"),
    ("rdzv-endpoint", dict(default="", metavar="HOST[:PORT]", help="The rendezvous store (c10d default port 29400), or etcd client endpoints HOST[:PORT],... (default port 2379)."), "Rendezvous"),
    ("rdzv-id", dict(default="none", metavar="ID", help="Job id shared by all nodes."), "Rendezvous"),
    ("rdzv-conf", dict(default="", metavar="K=V,...", help="join_timeout, last_call_timeout, read_timeout, is_host, keep_alive_interval, keep_alive_timeout, store_type, ..."), "Rendezvous"),
    ("node-rank", dict(type=int, default=None, help="This node's rank (static backend)."), "Rendezvous"),
    ("master-addr", dict(default=None, help="Address of node rank 0 (static backend)."), "Rendezvous"),
    ("master-port", dict(type=int, default=None, help="Port of the store on node rank 0 (static backend)."), "Rendezvous"),
    ("local-addr", dict(default=None, help="Address other nodes use to reach this one (default: FQDN)."), "Rendezvous"),
    ("max-restarts", dict(type=int, default=0, help="Job-wide restarts allowed after worker failures."), "Restarts and shutdown"),
    ("monitor-interval", dict(type=float, default=0.1, help="Accepted for torchrun compatibility; rally needs no polling."), "Restarts and shutdown"),
    ("shutdown-timeout", dict(type=float, default=None, help="Grace period between the stop signal and SIGKILL (default 30 s)."), "Restarts and shutdown"),
    ("signals-to-handle", dict(default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", help="Signals forwarded to workers before shutdown."), "Restarts and shutdown"),
    ("start-method", dict(default="spawn", type=click.Choice(["spawn", "fork", "forkserver"]), help="Accepted for torchrun compatibility."), "Restarts and shutdown"),
    ("preload", dict(default=None, metavar="MODULE,...", help="Modules a per-node template process imports once; workers are forked from it and start in milliseconds (default: torch, for Python entry points)."), "Restarts and shutdown"),
    ("no-preload", dict(is_flag=True, help="No template: start every worker as a fresh python process."), "Restarts and shutdown"),
    ("log-dir", dict(default=None, help="Base directory for per-rank log files and report.json."), "Logs and output"),
    ("redirects", dict(default="0", metavar="0-3|R:B,...", help="Send streams to log files only: 1 stdout, 2 stderr, 3 both."), "Logs and output"),
    ("tee", dict(default="0", metavar="0-3|R:B,...", help="Send streams to log files and the console."), "Logs and output"),
    ("local-ranks-filter", dict(default="", metavar="R,...", help="Show only these local ranks on the console."), "Logs and output"),
    ("duplicate-stdout-filters", dict(default="", metavar="S,...", help="Copy worker stdout lines containing any of these to attempt_<n>/filtered_stdout.log (,, is a comma)."), "Logs and output"),
    ("duplicate-stderr-filters", dict(default="", metavar="S,...", help="The same for stderr, to filtered_stderr.log."), "Logs and output"),
    ("logs-specs", dict(default=None, metavar="NAME", help="A LogsSpecs class from the torchrun.logs_specs entry points: where each worker's logs go."), "Logs and output"),
    ("event-log-handler", dict(default="null", metavar="NAME", help="Accepted for torchrun compatibility; rally writes events.jsonl."), "Logs and output"),
    ("virtual-local-rank", dict(is_flag=True, help="LOCAL_RANK=0 for every worker; CUDA_VISIBLE_DEVICES narrowed to its own GPU."), "Job"),
    ("numa-binding", dict(default=None, type=click.Choice(["node", "socket", "exclusive", "core-complex"]), help="torchrun's NUMA binding modes (applied only where GPUs exist)."), "Job"),
    ("module", dict(is_flag=True, help="Run SCRIPT as a module, like python -m."), "Entry point"),
    ("no-python", dict(is_flag=True, help="Run SCRIPT as an executable, not with python."), "Entry point"),
    ("run-path", dict(is_flag=True, help="Run SCRIPT with runpy.run_path."), "Entry point"),
    ("no-prefix", dict(is_flag=True, help="Do not prefix worker output lines with their rank."), "rally extras"),
    ("quiet", dict(is_flag=True, help="Show only rally's own lines on the console, not the workers' output."), "Logs and output"),
    ("checkpoint-dir", dict(default=None, help="Where workers save checkpoints (RALLY_CHECKPOINT_DIR)."), "rally extras"),
    ("heartbeat-timeout", dict(default=None, metavar="SECONDS|auto", help="Declare a worker hung after this many seconds without rally.job.heartbeat() (armed by its first beat); auto: learn it, and each job.section's, from the job."), "Health"),
    ("silence-timeout", dict(type=float, default=None, help="Declare a worker hung after this many seconds without output."), "Health"),
    ("resource-interval", dict(type=float, default=5.0, help="Seconds between samples of workers' CPU, memory and threads."), "Health"),
    ("startup-timeout", dict(type=float, default=None, help="Declare a worker hung when its first rally.job.heartbeat() has not come this many seconds after it started (default: off)."), "Health"),
    ("straggler-factor", dict(type=float, default=1.5, help="Name a rank a straggler when its step time exceeds this many times the median of the other ranks' (default 1.5)."), "Health"),
    ("straggler-window", dict(type=int, default=10, help="Steps a rank's step time is averaged over, and must stay slow for, before it is named (default 10)."), "Health"),
    ("metrics-port", dict(type=int, default=None, help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, printed)."), "Health"),
    ("preemption-signals", dict(default="SIGUSR1,SIGUSR2", help="Signals that warn of preemption or a time limit: forwarded to workers, which get --preemption-grace to checkpoint."), "rally extras"),
    ("preemption-grace", dict(type=float, default=60.0, help="Seconds workers get to checkpoint after a preemption signal."), "rally extras"),
    ("requeue", dict(is_flag=True, help="On a preemption signal, node 0 requeues the SLURM job (scontrol requeue)."), "rally extras"),
    ("crash-loop-limit", dict(type=int, default=3, help="Stop after this many restarts in a row without a newer checkpoint in --checkpoint-dir (0: never)."), "rally extras"),
    ("no-slurm", dict(is_flag=True, help="Ignore the SLURM environment even inside a SLURM job."), "rally extras"),
    # Issue 21: learned timeouts, GPU memory before a restart, quarantine, pre-flight (launcher/node_checks_options.py)
    ("timeout-safety-factor", dict(type=float, default=5.0, help="--heartbeat-timeout auto: this many times the longest interval seen (default 5)."), "Health"),
    ("timeout-samples", dict(type=int, default=20, help="--heartbeat-timeout auto: heartbeat intervals seen before the timeout is set (default 20)."), "Health"),
    ("timeout-floor", dict(type=float, default=30.0, help="--heartbeat-timeout auto: never below this many seconds (default 30)."), "Health"),
    ("gpu-reclaim-timeout", dict(type=float, default=30.0, help="Before a restart, wait up to this long for the old workers to leave every GPU and free its memory (NVML; default 30 s)."), "Restarts and shutdown"),
    ("quarantine-after", dict(type=int, default=2, help="Keep out of later rounds a node that was the root cause of this many failures within --quarantine-window, while the job can run without it (0: never; default 2)."), "Restarts and shutdown"),
    ("quarantine-window", dict(type=float, default=3600.0, help="Seconds within which --quarantine-after failures count (default 3600)."), "Restarts and shutdown"),
    ("preflight", dict(is_flag=True, help="Probe every node (compute, and a collective over the job's backend) when a round forms; keep out failing or slow nodes (default for multi-node jobs)."), "Health"),
    ("no-preflight", dict(is_flag=True, help="No pre-flight probe."), "Health"),
    ("preflight-factor", dict(type=float, default=2.0, help="A node slower than this many times the median in the pre-flight probe is left out (default 2)."), "Health"),
    ("preflight-every-round", dict(is_flag=True, help="Probe again when a round re-forms on the same nodes (default: only when the nodes change)."), "Health"),
]
SHORT_NAMES = {"module": "-m", "redirects": "-r", "tee": "-t"}
EARLY_BLOCKED_SIGNALS = {signal.SIGUSR1, signal.SIGUSR2}
CONFIG_KEYS = [name.replace("-", "_") for name, _, _ in OPTIONS]

EPILOG = """\b
Examples:
  rally --standalone --nproc-per-node 4 train.py --lr 0.1
  rally --nnodes 1:4 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint node1:29400 --rdzv-id job42 --max-restarts 3 train.py
  srun rally train.py                 (under SLURM nothing else is needed)
  rally --config job.yaml

A script named like a command (store, status) runs as `rally ./store` or `rally -- store`.

Precedence: flags > PET_*/RALLY_* environment > --config file > defaults.
"""


SUBCOMMANDS = {
    "store": ("rally.launcher.store_command", "store_command"),
    "status": ("rally.launcher.status_command", "status_command"),
}


class Subcommands(click.Group):
    """`rally store` and `rally status`, loaded on first use (they import torch and rich)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        import importlib

        module, attribute = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module), attribute)


subcommands = Subcommands(name="rally", context_settings={"help_option_names": ["-h", "--help"]})


def _complete_script(ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
    """Shell completion of SCRIPT: the subcommands, then files."""
    from click.shell_completion import CompletionItem

    names = [CompletionItem(n) for n in SUBCOMMANDS if n.startswith(incomplete)]
    return [*names, CompletionItem(incomplete, type="file")]


class GroupedCommand(click.Command):
    """Help text with options grouped by purpose, as torchrun users look for them."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands besides running a job, from their own help, then the examples."""
        with formatter.section("Commands"):
            rows = []
            for name in subcommands.list_commands(ctx):
                command = subcommands.get_command(ctx, name)
                rows.append((f"rally {name}", command.get_short_help_str(80) if command else ""))
            formatter.write_dl(rows)
        super().format_epilog(ctx, formatter)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        by_group: dict[str, list[tuple[str, str]]] = {g: [] for g in ("General", *GROUPS)}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                by_group[getattr(param, "help_group", "General")].append(record)
        for group, records in by_group.items():
            if records:
                with formatter.section(f"{group} options"):
                    formatter.write_dl(records)


def _load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        try:
            ctx.default_map = load_config_file(value, CONFIG_KEYS)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
    return value


def _declare(fn: Callable) -> Callable:
    for name, kwargs, group in reversed(OPTIONS):
        dest = name.replace("-", "_")
        spellings = [f"--{name}"] + ([f"--{dest}"] if dest != name else [])
        if name in SHORT_NAMES:
            spellings.insert(0, SHORT_NAMES[name])
        env = [f"PET_{dest.upper()}", f"RALLY_{dest.upper()}"]
        option = click.Option([*spellings, dest], envvar=env, show_envvar=False, **kwargs)
        option.help_group = group  # type: ignore[attr-defined]
        fn.__click_params__ = getattr(fn, "__click_params__", [])  # type: ignore[attr-defined]
        fn.__click_params__.append(option)  # type: ignore[attr-defined]
    return fn


@click.command(
    cls=GroupedCommand,
    name="rally",
    epilog=EPILOG,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("--config", "config", is_eager=True, expose_value=True, callback=_load_config, metavar="FILE", help="YAML file with any of these options (plus script and args).")
@click.version_option(__version__, "--version", prog_name="rally")
@_declare
@click.argument("script", required=False, shell_complete=_complete_script)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, config: str | None, script: str | None, script_args: tuple[str, ...], **options: Any) -> int:
    """Launch SCRIPT on this node's workers, torchrun-compatible: same flags, same worker environment."""
    file_values = ctx.default_map or {}
    if script is None or ctx.get_parameter_source("script") == ParameterSource.DEFAULT_MAP:
        script = file_values.get("script")
        script_args = tuple(file_values.get("args", ()))
    _apply_slurm(ctx, options)
    launch = build_launch(options, script, list(script_args))
    for note in launch.notes:
        console.say(note)
    return _run_agent(launch, _slurm_requeue if options["requeue"] else None)


def _slurm_requeue() -> str:
    """Requeue this SLURM job (called by node 0's agent on a preemption signal)."""
    import subprocess

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise RuntimeError("--requeue: not inside a SLURM job (SLURM_JOB_ID is unset)")
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job_id} failed: {done.stderr.strip() or done.returncode}")
    return f"requeued SLURM job {job_id}; it will resume from the latest checkpoint"


def _apply_slurm(ctx: click.Context, options: dict[str, Any]) -> None:
    """Inside a SLURM job, fill in what the user did not set from SLURM's environment.

    Only options still at their defaults are taken (a flag, a PET_/RALLY_ variable or the
    config file always wins), and one line says what was taken.
    """
    if options["no_slurm"]:
        return
    from rally.launcher.slurm import SlurmJob

    try:
        job = SlurmJob.from_env(os.environ)
    except ValueError as exc:
        raise ConfigError(f"cannot read the SLURM environment: {exc} (use --no-slurm to ignore it)") from None
    if job is None:
        return

    def unset(name: str) -> bool:
        return ctx.get_parameter_source(name) == ParameterSource.DEFAULT

    taken = []
    options["_preferred_rank"] = job.node_rank
    options["_slurm_job_id"] = job.job_id  # the job token derives from it (rendezvous/token.py)
    if unset("nnodes"):
        options["nnodes"] = str(job.nnodes)
        taken += ["nnodes", "node_rank"]
    rendezvous_set = (
        not all(unset(n) for n in ("rdzv_endpoint", "master_addr", "master_port"))
        or str(options["rdzv_backend"]).lower() in ("static", "etcd", "etcd-v2") and not unset("rdzv_backend")
    )
    if not options["standalone"] and not rendezvous_set:
        options["rdzv_backend"] = "c10d"
        options["rdzv_endpoint"] = f"{job.store_host}:{job.store_port}"
        taken.append("rdzv_endpoint")
    if unset("rdzv_id"):
        options["rdzv_id"] = job.run_id
        taken.append("rdzv_id")
    if unset("nproc_per_node"):
        options["nproc_per_node"] = "auto"
    if str(options["nproc_per_node"]).lower() == "auto":
        options["nproc_per_node"] = str(job.nproc_auto())
        taken.append("nproc_per_node")
    console.say(job.describe(taken))


def _run_agent(launch, requeue: Callable[[], str] | None = None) -> int:  # noqa: ANN001 - launcher.config.Launch
    from rally.rendezvous.store import quiet_torch_logs

    base_env = dict(os.environ)  # the workers' environment, before rally touches its own
    quiet_torch_logs()
    from rally.agent.agent import Agent

    global _AGENT_RAN
    _AGENT_RAN = True
    return Agent(launch.spec, launch.plan, base_env, requeue).run()


_AGENT_RAN = False  # main() ends a process that ran the agent with os._exit (see there)


def run(argv: list[str]) -> int:
    """The `rally` command as a function: returns the exit code instead of exiting.

    Bad input prints its one `rally: error:` line and returns 2. The agent runs in this
    process (it must be the main thread: it installs signal handlers); the handlers, the wake-up
    fd and the signal mask are put back when it returns.
    """
    saved_mask = signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_BLOCKED_SIGNALS)
    handled = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2]
    saved_handlers = {s: signal.getsignal(s) for s in handled}
    saved_wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(saved_wakeup)
    try:
        return _run_command(list(argv))
    finally:
        signal.set_wakeup_fd(saved_wakeup)
        for signum, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, saved_mask)


def _run_command(args: list[str]) -> int:
    # `rally store ...` and `rally status ...` are subcommands; anything else (options first,
    # a script, `./store`, `-- store`) is the run command, exactly as before.
    command: click.Command = subcommands if args and args[0] in SUBCOMMANDS else run_command
    try:
        code = command.main(args, prog_name="rally", standalone_mode=False)
    except ConfigError as exc:
        console.plain_error(str(exc))
        return 2
    except click.UsageError as exc:
        message = exc.format_message()
        if isinstance(exc, click.NoSuchOption):
            message = f"no such option {exc.option_name}; see rally --help"
            if exc.possibilities:
                message = f"no such option {exc.option_name}; did you mean {sorted(exc.possibilities)[0]}?"
        console.plain_error(message)
        return 2
    except click.ClickException as exc:
        console.plain_error(exc.format_message())
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of `rally` and `python -m rally`: one clear line and exit 2 on bad input."""
    # A preemption warning can arrive while torch is still importing; its default action would
    # kill rally before the agent can forward it. Blocked here, it stays pending until the agent
    # installs its handlers and unblocks it (threads started meanwhile inherit the block).
    signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_BLOCKED_SIGNALS)
    code = _run_command(list(sys.argv[1:] if argv is None else argv))
    if _AGENT_RAN:
        # Every process is stopped and every file written: skip the interpreter's teardown
        # (torch's takes 0.35 s on an idle node, seconds on a busy one), so a stop ends when
        # rally says so. `run()` (the Python API) returns instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
