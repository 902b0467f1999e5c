"""The `rally` command: torchrun's flags (both spellings, and PET_* variables) plus rally's own.

    rally [OPTIONS] SCRIPT [SCRIPT ARGS]...     run a training job (one rally per node)
    rally store --port PORT                     run a standalone rendezvous store
    rally status --rdzv-endpoint H:P --rdzv-id ID   show a running job

Precedence, highest first: command-line flags > environment (PET_<NAME>, as torchrun, or
RALLY_<NAME>) > the --config YAML file > SLURM (when inside a SLURM job) > defaults.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import click
from click.core import ParameterSource

from rally.agent.display import console
from rally.launcher import __version__, options
from rally.launcher.checks.validate import Mistakes, mistakes_of
from rally.launcher.command_errors import run_click
from rally.launcher.config import ConfigError, build_launch
from rally.launcher.config_file import FileMistakes, load_config_file
from rally.launcher.flag_prefixes import expand_prefixes
from rally.launcher.options import GROUPS, Options
from rally.launcher.schedulers import Scheduler, detect

if TYPE_CHECKING:
    from rally.launcher.schedulers.slurm import SlurmJob

EARLY_BLOCKED_SIGNALS = {signal.SIGUSR1, signal.SIGUSR2}

EPILOG = """\b
Examples:
  rally --standalone --nproc-per-node 4 train.py --lr 0.1
  rally --nnodes 1:4 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint node1:29400 --rdzv-id job42 --max-restarts 3 train.py
  srun rally train.py                 (under SLURM nothing else is needed)
  rally --config job.yaml

A script named like a command (store, status) runs as `rally ./store` or `rally -- store`.

Precedence: flags > PET_*/RALLY_* environment > --config file > defaults.

\b
Each error line rally prints, with its cause and fix: docs/troubleshooting.md
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

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Unambiguous prefixes of long flags are accepted, as torchrun's argparse accepts them."""
        return super().parse_args(ctx, expand_prefixes(args, self.get_params(ctx)))

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
            ctx.default_map, ctx.meta["rally.origins"] = load_config_file(value)
        except FileMistakes as exc:  # told with the other options' mistakes (run_command)
            ctx.default_map, ctx.meta["rally.origins"] = exc.values, exc.origins
            ctx.meta["rally.file_mistakes"] = exc.mistakes
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
    return value


def click_option(name: str, default: object, about: options.OptionInfo) -> click.Option:
    """The click option of one field of the options model (launcher/options.py)."""
    kwargs: dict[str, Any] = {"default": default, "help": about.help}
    if about.kind is bool:
        kwargs["is_flag"] = True
    elif about.choices:
        kwargs["type"] = click.Choice(list(about.choices))
    elif about.kind in (int, float):
        kwargs["type"] = about.kind
    if about.metavar:
        kwargs["metavar"] = about.metavar
    option = click.Option(
        [*options.spellings(name, about), name], envvar=options.env_names(name), show_envvar=False, **kwargs
    )
    option.help_group = about.group  # type: ignore[attr-defined]
    return option


def _declare(fn: Callable) -> Callable:
    """One click option per field of the options model, in its order."""
    for f in reversed(options.option_fields()):
        fn.__click_params__ = getattr(fn, "__click_params__", [])  # type: ignore[attr-defined]
        fn.__click_params__.append(click_option(f.name, f.default, options.info(f)))  # type: ignore[attr-defined]
    return fn


@click.command(
    cls=GroupedCommand,
    name="rally",
    epilog=EPILOG,
    context_settings={
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@click.option(
    "--config",
    "config",
    is_eager=True,
    expose_value=True,
    callback=_load_config,
    metavar="FILE",
    help="YAML file with any of these options (plus script and args).",
)
@click.option(
    "--version",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=lambda ctx, _param, value: _print_version(ctx) if value else None,
    help="Show rally's, torch's and Python's versions and exit.",
)
@_declare
@click.argument("script", required=False, shell_complete=_complete_script)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(
    ctx: click.Context, config: str | None, script: str | None, script_args: tuple[str, ...], **values: Any
) -> int:
    """Launch SCRIPT on this node's workers, torchrun-compatible: same flags, same worker environment."""
    file_values = ctx.default_map or {}
    if script is None or ctx.get_parameter_source("script") == ParameterSource.DEFAULT_MAP:
        script = file_values.get("script")
        script_args = tuple(file_values.get("args", ()))
    from_file = {n for n in values if ctx.get_parameter_source(n) == ParameterSource.DEFAULT_MAP}
    origins = {n: where for n, where in ctx.meta.get("rally.origins", {}).items() if n in from_file}
    given = {n for n in values if ctx.get_parameter_source(n) != ParameterSource.DEFAULT}
    o = Options(**values, origins=origins)
    if file_mistakes := ctx.meta.get("rally.file_mistakes"):  # every mistake in one run, the file's first
        try:
            o.parse(script, act=False)
        except ConfigError as exc:
            raise Mistakes(file_mistakes + mistakes_of(exc)) from None
        raise Mistakes(file_mistakes)
    return launch_and_run(o, script, list(script_args), given).code


def version_line() -> str:
    """`rally 0.1.0 (torch 2.13.0+cpu, Python 3.11.2)`: what a bug report needs, without importing torch."""
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"rally {__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


def _print_version(ctx: click.Context) -> None:
    click.echo(version_line())
    ctx.exit(0)


@dataclass
class JobResult:
    """How a job ended on this node: the exit code and, when it failed, the root cause in one line."""

    code: int
    root_cause: str | None = None


def launch_and_run(options: Options, script: str | None, script_args: list[str], given: set[str]) -> JobResult:
    """Fill in from SLURM what `given` (the options the user set) leaves open, check everything,
    run the agent. Shared by the `rally` command and `rally.launch`."""
    scheduler = _scheduler(options.no_slurm)
    slurm_job = cast("SlurmJob | None", scheduler if scheduler.name == "slurm" else None)
    if slurm_job is not None:
        changes, taken = slurm_job.overrides(options, given)
        options = dataclasses.replace(options, **changes)
        console.say(slurm_job.describe(taken))
    launch = build_launch(options, script, script_args, slurm_job)
    launch.spec = dataclasses.replace(launch.spec, scheduler=scheduler.agent_view())
    for note in launch.notes:
        console.say(note)
    for line in launch.warnings:  # secrets and the store left open to other users (secret_warnings.py)
        console.warn(line)
    given_id = options.rdzv_id if "rdzv_id" in given else None  # binds the job's checkpoints (auth.job_identity)
    return _run_agent(launch, scheduler.requeue if options.requeue else None, given_id)


def _scheduler(no_slurm: bool) -> Scheduler:
    """The scheduler this node runs under (launcher/schedulers/): SLURM, Kubernetes' operator, none."""
    try:
        return detect(os.environ, no_slurm)
    except ValueError as exc:
        raise ConfigError(f"cannot read the SLURM environment: {exc} (use --no-slurm to ignore it)") from None


def _run_agent(  # launch: launcher.config.Launch
    launch, requeue: Callable[[], str] | None = None, given_id: str | None = None
) -> JobResult:
    from rally.agent.checkpoint.core import auth
    from rally.rendezvous.c10d.store import quiet_torch_logs

    if launch.checkpoint_token:  # the key, never the token, for the holder and the workers: in the environment
        os.environ[auth.KEY_ENV] = auth.derive(launch.checkpoint_token).hex()
    held = _held_checkpoint_dir(launch.spec)
    if held is not None:  # the job every save is bound to (auth.job_identity), for the holder and the workers
        try:
            identity = auth.job_identity(held.fd, given_id)
        except OSError as exc:
            raise ConfigError(f"--checkpoint-dir {held.given}: cannot read or make its job id: {exc}") from None
        os.environ[auth.JOB_ENV] = auth.job_tag_of(identity).hex()
    else:  # nothing of an earlier job run in this process (rally.launch, rally.cli.run)
        os.environ.pop(auth.JOB_ENV, None)
    base_env = dict(os.environ)  # the workers' environment, before rally touches its own
    quiet_torch_logs()
    from rally.agent.agent import Agent

    global _AGENT_RAN
    _AGENT_RAN = True
    try:
        agent = Agent(launch.spec, launch.plan, base_env, requeue, held)
        code = agent.run()
    finally:
        if held is not None:  # its writers (holder, workers, flush helper) are gone by now
            held.close()
    return JobResult(code, agent.report.root_cause() if code else None)


def _held_checkpoint_dir(spec):  # rally.agent.base.spec.JobSpec -> HeldDirectory | None
    """--checkpoint-dir opened (made 0700 when missing) once, for the agent to write through
    (agent/checkpoint/core/held_dir.py); what cannot be opened is one line, exit 2."""
    if not spec.checkpoint_dir:
        return None
    from rally.agent.checkpoint.core.held_dir import HeldDirectory
    from rally.rendezvous.base.path_trust import UnsafePath

    try:
        return HeldDirectory.open(spec.checkpoint_dir, spec.checkpoint_dir_shared)
    except UnsafePath as exc:  # changed since the launcher's check a moment ago
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {spec.checkpoint_dir}: cannot open or make it: {exc}") from None


_AGENT_RAN = False  # main() ends a process that ran the agent with os._exit (see there)


def run(argv: list[str]) -> int:
    """The `rally` command as a function: it returns the exit code instead of exiting.

    The job runs in this process, which must be its main thread (the agent installs signal
    handlers); the handlers, the wake-up fd and the signal mask are put back when it returns.

    Args:
        argv: The command's arguments, as after `rally` on a command line.

    Returns:
        The exit code the command would have exited with: 0, the failing worker's code, 75 when
        preempted, 2 for bad input (after its one `rally: error:` line), never `sys.exit`.

    Examples:
        >>> import rally
        >>> rally.run(["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "0.1"])
        0
    """
    return in_this_process(lambda: _run_command(list(argv)))


def in_this_process(fn: Callable[[], Any]) -> Any:
    """Run `fn` (the command, or `rally.launch`'s job) with the signal state put back afterwards."""
    saved_mask = signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_BLOCKED_SIGNALS)
    handled = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2]
    saved_handlers = {s: signal.getsignal(s) for s in handled}
    saved_wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(saved_wakeup)
    try:
        return fn()
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
    return run_click(command, args)


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
