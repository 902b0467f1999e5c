"""rally's options, declared once: each is one field of `Options`, which carries its flag
names, default, help, help group, check, and the field of the agent's inputs it fills. From
these fields alone come:

* the click options of `rally` (`--nproc-per-node` and torchrun's `--nproc_per_node`, short
  names, metavars, choices, help grouped as in `rally --help`), in launcher/cli.py;
* the environment variables `PET_<NAME>` (as torchrun) and `RALLY_<NAME>`;
* the keys of a `--config` YAML file (either spelling) and the type each value must have
  (launcher/config_file.py);
* the keyword arguments of `rally.launch(...)` (launcher/api.py builds `Options` directly);
* the agent's `JobSpec` (agent/base/spec.py) and the rendezvous flags (`RendezvousOptions`), built by
  `Options.parse()` from what each option fills: there is no other path into them.

Adding a flag is one field below and, when the agent needs it, one field of `JobSpec`:

    preflight_factor: float = option(2.0, "Health", "Leave out a node ... (default 2).", check=checks.factor("2: ..."))

fills `JobSpec.preflight_factor` (the field of the same name; `fills=` names another, or
several when the check returns a tuple; `read_by=` says which option's check reads a value that
fills nothing itself). Defaults that the agent also needs live in the agent's own types
(`JobSpec`, `RendezvousSettings`) and are read from there with `spec_default`, so that each
exists once. Every check has one signature, (value, Parsing) -> the parsed value or
`ConfigError` (launcher/checks/option_checks.py). `Options.parse()` runs them in declaration order
(directories last: checking them creates them), tells every mistake in one run, and names the
config file and line when the bad value came from one.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rally.agent.base.spec import JobSpec, LearningSettings
from rally.launcher import __version__
from rally.launcher.checks import option_checks as checks
from rally.launcher.checks import validate
from rally.launcher.checks.option_checks import Check, Parsing, Unavailable
from rally.launcher.checks.validate import ConfigError, Mistakes
from rally.launcher.checks.worker_flags import NUMA_MODES
from rally.rendezvous.backends import HostPort

GROUPS = ("Job", "Rendezvous", "Restarts and shutdown", "Logs and output", "Entry point", "Health", "rally extras")
METADATA_KEY = "rally.option"
SAME = "same"  # `fills`: the field of the option's own name
# `read_by` of an option no check reads: torchrun's, accepted and ignored; or the command's own.
TORCHRUN_ONLY = "torchrun compatibility"
THE_COMMAND = "the command, before parsing"


@dataclass(frozen=True)
class RendezvousOptions:
    """The rendezvous flags, checked: what launcher/config.py plans the store and the membership
    rules from (the run id is `JobSpec.run_id`)."""

    nnodes: tuple[int, int] = (1, 1)
    standalone: bool = False
    rdzv_backend: str = "static"
    rdzv_endpoint: str | HostPort = ""
    rdzv_conf: dict[str, Any] = field(default_factory=dict)
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None


@dataclass(frozen=True)
class Parsed:
    """What `Options.parse()` gives: the agent's job, the rendezvous flags, lines to tell."""

    spec: JobSpec
    rendezvous: RendezvousOptions
    notes: list[str]
    warnings: list[str] = field(default_factory=list)


# JobSpec's fields that no option fills, and where they come from instead.
NOT_AN_OPTION = {
    "entrypoint": "the SCRIPT argument",
    "args": "the script's arguments",
    "python_exec": "$PYTHON_EXEC (option_checks.python_exec)",
    "rally_version": "launcher/__init__.py's __version__",
    "scheduler": "the scheduler's own environment (launcher/schedulers/)",
    "cwd": "the working directory (the agent's own)",
    "log_line_prefix_template": "$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (option_checks.log_line_prefix_template)",
    "checkpoint_dir_given": "--checkpoint-dir's name as given, kept by the agent beside the open directory",
}


@dataclass(frozen=True)
class OptionInfo:
    """What a field of `Options` says about its option, besides its name and default."""

    group: str
    help: str
    kind: type  # bool (a flag), int, float or str: how click, YAML and the environment convert it
    metavar: str | None = None
    short: str | None = None  # e.g. "-m"
    choices: tuple[str, ...] | None = None
    check: Check = checks.as_is  # (value, Parsing) -> parsed value, or ConfigError
    late: bool = False  # checked after every other option (the check has an effect: a directory)
    fills: tuple[str, ...] = ()  # fields of JobSpec or RendezvousOptions its parsed value goes to
    read_by: str | None = None  # for an option that fills nothing: the option whose check reads it


def option(
    default: object,
    group: str,
    help: str,
    kind: type | None = None,
    *,
    metavar: str | None = None,
    short: str | None = None,
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    late: bool = False,
    fills: str | tuple[str, ...] = SAME,
    read_by: str | None = None,
) -> Any:
    """A field of `Options`: its default and what the option is (see OptionInfo). Without
    `read_by`, it fills the field of its own name (or those `fills` names)."""
    if group not in GROUPS:
        raise ValueError(f"unknown help group {group!r}; one of {GROUPS}")
    resolved = kind or (bool if isinstance(default, bool) else type(default) if default is not None else str)
    targets = () if read_by else (fills,) if isinstance(fills, str) else fills
    info = OptionInfo(
        group,
        help,
        resolved,
        metavar,
        short,
        choices,
        check or (checks.as_bool if resolved is bool else checks.as_is),
        late,
        targets,
        read_by,
    )
    return field(default=default, metadata={METADATA_KEY: info})


def spec_default(name: str) -> Any:
    """The agent's own default for a JobSpec field (one place for it: agent/base/spec.py)."""
    return JobSpec.__dataclass_fields__[name].default


TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
PREEMPTION_SIGNALS = "SIGUSR1,SIGUSR2"


# ------------------------------------------------------------------ the options
@dataclass(frozen=True)
class Options:
    """Every option of `rally` (and of `rally.launch`), with its default. Raw values as typed;
    `parse()` checks them and gives the parsed ones."""

    nnodes: str = option(
        "1:1",
        "Job",
        "Number of nodes, or MIN:MAX for an elastic job.",
        metavar="N|MIN:MAX",
        check=checks.nnodes,
    )
    nproc_per_node: str = option(
        "1", "Job", "Workers per node.", metavar="N|auto|cpu|gpu|xpu", check=checks.nproc_per_node
    )
    role: str = option(spec_default("role"), "Job", "Worker role name (ROLE_NAME, log prefixes).")
    standalone: bool = option(
        False, "Rendezvous", "Single node: a private store on a free port, a random run id.", check=checks.standalone
    )
    rdzv_backend: str = option(
        "static",
        "Rendezvous",
        "c10d: elastic rendezvous through a store; etcd (or etcd-v2): the same on an etcd cluster; static: "
        "fixed node ranks.",
        metavar="c10d|etcd|static",
        check=checks.backend,
    )
    rdzv_endpoint: str | HostPort = option(
        "",
        "Rendezvous",
        "The rendezvous store (c10d default port 29400), or etcd client endpoints HOST[:PORT],... (default port 2379).",
        str,
        metavar="HOST[:PORT]",
    )
    rdzv_id: str = option(
        spec_default("run_id"),
        "Rendezvous",
        "Job id shared by all nodes.",
        metavar="ID",
        check=checks.run_id,
        fills="run_id",
    )
    rdzv_conf: str = option(
        "",
        "Rendezvous",
        "join_timeout, last_call_timeout, read_timeout, is_host, keep_alive_interval, keep_alive_timeout, "
        "store_type, ...; etcd: protocol, cacert, cert, key, username, password_file",
        metavar="K=V,...",
        check=checks.rdzv_conf,
    )
    node_rank: int | None = option(
        None, "Rendezvous", "This node's rank (static backend).", int, check=checks.node_rank
    )
    master_addr: str | None = option(None, "Rendezvous", "Address of node rank 0 (static backend).")
    master_port: int | None = option(
        None,
        "Rendezvous",
        "Port of the store on node rank 0 (static backend).",
        int,
        check=checks.optional(checks.port),
    )
    local_addr: str | None = option(None, "Rendezvous", "Address other nodes use to reach this one (default: FQDN).")
    max_restarts: int = option(
        spec_default("max_restarts"),
        "Restarts and shutdown",
        "Job-wide restarts allowed after worker failures.",
        check=checks.not_negative,
    )
    monitor_interval: float = option(
        0.1,
        "Restarts and shutdown",
        "Accepted for torchrun compatibility; rally needs no polling.",
        check=checks.seconds(True, validate.MIN_INTERVAL),
        read_by=TORCHRUN_ONLY,
    )
    shutdown_timeout: float | None = option(
        None,
        "Restarts and shutdown",
        f"Grace period between the stop signal and SIGKILL (default {spec_default('shutdown_timeout'):g} s).",
        float,
        check=checks.shutdown_timeout,
    )
    signals_to_handle: str = option(
        TORCHRUN_SIGNALS,
        "Restarts and shutdown",
        "Signals forwarded to workers before shutdown.",
        check=checks.signals,
    )
    start_method: str = option(
        "spawn",
        "Restarts and shutdown",
        "Accepted for torchrun compatibility.",
        choices=("spawn", "fork", "forkserver"),
        read_by=TORCHRUN_ONLY,
    )
    preload: str | None = option(
        None,
        "Restarts and shutdown",
        "Modules a per-node template process imports once; workers are forked from it and start in "
        "milliseconds (default: torch, for Python entry points).",
        metavar="MODULE,...",
        check=checks.preload,
    )
    no_preload: bool = option(
        False,
        "Restarts and shutdown",
        "No template: start every worker as a fresh python process.",
        read_by="preload",
    )
    log_dir: str | None = option(
        None,
        "Logs and output",
        "Base directory for per-rank log files and report.json.",
        check=checks.optional(checks.writable_dir),
        late=True,
    )
    redirects: str = option(
        "0",
        "Logs and output",
        "Send streams to log files only: 1 stdout, 2 stderr, 3 both.",
        metavar="0-3|R:B,...",
        short="-r",
        check=checks.std_map,
    )
    tee: str = option(
        "0",
        "Logs and output",
        "Send streams to log files and the console.",
        metavar="0-3|R:B,...",
        short="-t",
        check=checks.std_map,
    )
    local_ranks_filter: str = option(
        "",
        "Logs and output",
        "Show only these local ranks on the console.",
        metavar="R,...",
        check=checks.ranks_filter,
    )
    duplicate_stdout_filters: str = option(
        "",
        "Logs and output",
        "Copy worker stdout lines containing any of these to attempt_<n>/filtered_stdout.log (,, is a comma).",
        metavar="S,...",
        check=checks.comma_list,
    )
    duplicate_stderr_filters: str = option(
        "", "Logs and output", "The same for stderr, to filtered_stderr.log.", metavar="S,...", check=checks.comma_list
    )
    logs_specs: str | None = option(
        None,
        "Logs and output",
        "A LogsSpecs class from the torchrun.logs_specs entry points: where each worker's logs go.",
        metavar="NAME",
        check=checks.logs_specs,
    )
    event_log_handler: str = option(
        "null",
        "Logs and output",
        "Accepted for torchrun compatibility; rally writes events.jsonl.",
        metavar="NAME",
        check=checks.event_log_handler,
        read_by=TORCHRUN_ONLY,
    )
    virtual_local_rank: bool = option(
        False,
        "Job",
        "LOCAL_RANK=0 for every worker; CUDA_VISIBLE_DEVICES narrowed to its own GPU.",
        check=checks.virtual_local_rank,
    )
    numa_binding: str | None = option(
        None,
        "Job",
        "torchrun's NUMA binding modes (applied only where GPUs exist).",
        choices=NUMA_MODES,
        check=checks.numa_binding,
    )
    module: bool = option(False, "Entry point", "Run SCRIPT as a module, like python -m.", short="-m")
    no_python: bool = option(False, "Entry point", "Run SCRIPT as an executable, not with python.")
    run_path: bool = option(False, "Entry point", "Run SCRIPT with runpy.run_path.")
    no_prefix: bool = option(
        False,
        "rally extras",
        "No [rank] prefix on the worker streams torchrun does not tee (--tee'd lines keep torchrun's [role0]:).",
        check=checks.no_prefix,
        fills="prefix_output",
    )
    torchrun_prefix: bool = option(
        False,
        "rally extras",
        "Deprecated: --tee'd lines carry torchrun's prefix by default; this now means --no-prefix.",
        check=checks.deprecated_torchrun_prefix,
        read_by="no_prefix",
    )
    quiet: bool = option(
        False, "Logs and output", "Show only rally's own lines on the console, not the workers' output."
    )
    checkpoint_dir: str | None = option(
        None,
        "rally extras",
        "Where workers save checkpoints (RALLY_CHECKPOINT_DIR); created 0700. Refused if another user "
        "owns it or may write it, unless --checkpoint-dir-shared.",
        check=checks.checkpoint_dir,
        late=True,
    )
    checkpoint_dir_shared: bool = option(
        False,
        "rally extras",
        "Accept a --checkpoint-dir that other users may write (a shared scratch directory): they can then "
        "delete or replace files there, but the job loads only checkpoints signed with your key "
        "(RALLY_JOB_TOKEN or ~/.rally/secret); unsigned older ones are not loaded.",
    )
    heartbeat_timeout: str | None = option(
        None,
        "Health",
        "Declare a worker hung after this many seconds without rally.job.heartbeat() (armed by its first "
        "beat); auto: learn it, and each job.section's, from the job.",
        str,
        metavar="SECONDS|auto",
        check=checks.heartbeat_timeout,
        fills=("heartbeat_timeout", "timeout_learning"),
    )
    silence_timeout: float | None = option(
        None,
        "Health",
        "Declare a worker hung after this many seconds without output.",
        float,
        check=checks.seconds(False),
    )
    hang_report_after: float = option(
        spec_default("hang_report_after"),
        "Health",
        "Report a rank that has made no progress (heartbeat, output, section) for this many seconds while other "
        "ranks wait for it in a collective, with its stacks; the job goes on (--heartbeat-timeout or "
        "--silence-timeout stop it). Half of it: how long a rank may live on once done (its rally.job.run "
        "function returned, or every other rank exited 0) before it is reported with its stacks (and, after a "
        f"return, stopped as a success). Default {spec_default('hang_report_after'):g}; 0: both off.",
        check=checks.always_seconds(True),
    )
    resource_interval: float = option(
        spec_default("resource_interval"),
        "Health",
        "Seconds between samples of workers' CPU, memory and threads.",
        check=checks.seconds(False, validate.MIN_INTERVAL, unset=spec_default("resource_interval")),
    )
    startup_timeout: float | None = option(
        None,
        "Health",
        "Declare a worker hung when its first rally.job.heartbeat() has not come this many seconds after it "
        "started (default: off).",
        float,
        check=checks.positive_seconds,
    )
    straggler_factor: float = option(
        spec_default("straggler_factor"),
        "Health",
        "Name a rank a straggler when its step time exceeds this many times the median of the other ranks' "
        f"(default {spec_default('straggler_factor'):g}).",
        check=checks.straggler_factor,
    )
    straggler_window: int = option(
        spec_default("straggler_window"),
        "Health",
        "Steps a rank's step time is averaged over, and must stay slow for, before it is named (default "
        f"{spec_default('straggler_window')}).",
        check=checks.straggler_window,
    )
    metrics_port: int | None = option(
        None,
        "Health",
        "Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, printed).",
        int,
        check=checks.metrics_port,
    )
    metrics_addr: str = option(
        spec_default("metrics_addr"),
        "Health",
        "Address the metrics endpoint listens on (default 127.0.0.1, this host only; 0.0.0.0, or one "
        "interface's address, lets a Prometheus on another machine scrape it).",
        metavar="ADDR",
        check=checks.metrics_addr,
    )
    # Issue 21: learned timeouts, GPU memory before a restart, quarantine, pre-flight.
    timeout_safety_factor: float = option(
        LearningSettings.factor,
        "Health",
        f"--heartbeat-timeout auto: this many times the longest interval seen (default {LearningSettings.factor:g}).",
        read_by="heartbeat_timeout",
    )
    timeout_samples: int = option(
        LearningSettings.samples,
        "Health",
        "--heartbeat-timeout auto: heartbeat intervals seen before the timeout is set (default "
        f"{LearningSettings.samples}).",
        read_by="heartbeat_timeout",
    )
    timeout_floor: float = option(
        LearningSettings.floor,
        "Health",
        f"--heartbeat-timeout auto: never below this many seconds (default {LearningSettings.floor:g}).",
        read_by="heartbeat_timeout",
    )
    gpu_reclaim_timeout: float = option(
        spec_default("gpu_reclaim_timeout"),
        "Restarts and shutdown",
        "Before a restart, wait up to this long for the old workers to leave every GPU and free its memory "
        f"(NVML; default {spec_default('gpu_reclaim_timeout'):g} s).",
        check=checks.always_seconds(True),
    )
    quarantine_after: int = option(
        spec_default("quarantine_after"),
        "Restarts and shutdown",
        "Keep out of later rounds a node that was the root cause of this many failures within "
        "--quarantine-window, while the job can run without it (0: never; default "
        f"{spec_default('quarantine_after')}).",
        check=checks.count(0),
    )
    quarantine_window: float = option(
        spec_default("quarantine_window"),
        "Restarts and shutdown",
        f"Seconds within which --quarantine-after failures count (default {spec_default('quarantine_window'):g}).",
        check=checks.always_seconds(False),
    )
    preflight: bool = option(
        False,
        "Health",
        "Probe every node (compute, and a collective over the job's backend) when a round forms; keep out "
        "failing or slow nodes (default for multi-node jobs).",
        check=checks.preflight,
    )
    no_preflight: bool = option(False, "Health", "No pre-flight probe.", read_by="preflight")
    preflight_factor: float = option(
        spec_default("preflight_factor"),
        "Health",
        "A node slower than this many times the median in the pre-flight probe is left out (default "
        f"{spec_default('preflight_factor'):g}).",
        check=checks.factor("2: twice as slow as the median node"),
    )
    preflight_every_round: bool = option(
        False, "Health", "Probe again when a round re-forms on the same nodes (default: only when the nodes change)."
    )
    preemption_signals: str = option(
        PREEMPTION_SIGNALS,
        "rally extras",
        "Signals that warn of preemption or a time limit: forwarded to workers, which get --preemption-grace "
        "to checkpoint.",
        check=checks.signals,
    )
    preemption_grace: float = option(
        spec_default("preemption_grace"),
        "rally extras",
        "Seconds workers get to checkpoint after a preemption signal.",
        check=checks.seconds(True),
    )
    requeue: bool = option(
        False, "rally extras", "On a preemption signal, node 0 requeues the SLURM job (scontrol requeue)."
    )
    crash_loop_limit: int = option(
        spec_default("crash_loop_limit"),
        "rally extras",
        "Stop after this many restarts in a row without a newer checkpoint in --checkpoint-dir (0: never).",
        check=checks.not_negative,
    )
    warm_spares: int = option(
        spec_default("warm_spares"),
        "rally extras",
        "Keep N extra processes per node that ran the script up to rally.job.run; one takes a dead rank's "
        "place in an in-process restart (docs/restartable.md).",
        check=checks.not_negative,
    )
    no_slurm: bool = option(
        False, "rally extras", "Ignore the SLURM environment even inside a SLURM job.", read_by=THE_COMMAND
    )

    # Where values came from, for messages: option name -> "--config job.yaml, line 3, 'nnodes'".
    origins: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def parse(self, script: str | None = None, args: tuple[str, ...] | list[str] = (), act: bool = True) -> Parsed:
        """Every option's value checked and parsed by its field's `check`, and the agent's JobSpec
        (running `script` with `args`) and the rendezvous flags filled from them. Bad values raise
        one ConfigError (`Mistakes`: all of them), each prefixed with the file and line it
        came from. `act=False` skips the late checks, which act (they make a directory): for a
        launch known to fail already."""
        p = Parsing(self, script)
        mistakes: list[str] = []  # every value is checked: all mistakes are told in one run
        for f in sorted(option_fields(), key=lambda f: info(f).late):
            if info(f).late and (mistakes or not act):
                break  # a late check acts (it makes a directory): not for a launch that fails anyway
            value = getattr(self, f.name)
            p.flag = flag(f.name)
            try:
                p.done[f.name] = info(f).check(value, p)
                continue
            except Unavailable:  # an option it needs failed, and that mistake is told
                pass
            except ConfigError as exc:
                origin = self.origins.get(getattr(exc, "option", f.name))  # a value another check read: its own
                mistakes.append(f"{origin}: {exc}" if origin else str(exc))
            except (TypeError, ValueError, OverflowError) as exc:  # a wrong type or inf, from rally.launch
                mistakes.append(f"{flag(f.name)} {value!r}: {exc}")
            p.failed.add(f.name)
        if mistakes:
            raise Mistakes(mistakes)
        spec, rendezvous = filled(p.done)
        job = JobSpec(
            entrypoint=script or "",
            args=tuple(args),
            python_exec=checks.python_exec(),
            log_line_prefix_template=checks.log_line_prefix_template(),
            rally_version=__version__,
            **spec,
        )
        return Parsed(job, RendezvousOptions(**rendezvous), p.notes, p.warnings)

    @classmethod
    def of(cls, given: Mapping[str, Any], where: str = "rally.launch") -> Options:
        """Options from keyword arguments by name (dashes allowed); an unknown name is one line."""
        return cls(**by_name(given, where))


def by_name(given: Mapping[str, Any], where: str = "rally.launch") -> dict[str, Any]:
    """`given` keyed by option name (`nproc-per-node` -> `nproc_per_node`); an unknown name is
    one ConfigError line with the nearest valid one."""
    known = names()
    out: dict[str, Any] = {}
    for raw, value in given.items():
        name = str(raw).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            raise ConfigError(f"{where}: unknown option '{raw}'" + (f"; did you mean '{close[0]}'?" if close else ""))
        out[name] = value
    return out


def option_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Options) if METADATA_KEY in f.metadata]


def info(option_field: dataclasses.Field) -> OptionInfo:
    return option_field.metadata[METADATA_KEY]


def names() -> list[str]:
    return [f.name for f in option_fields()]


def flag(name: str) -> str:
    """`nproc_per_node` -> `--nproc-per-node`."""
    return "--" + name.replace("_", "-")


def spellings(name: str, about: OptionInfo | None = None) -> list[str]:
    """Every flag of an option: its short name, the dashed name, and torchrun's underscored one."""
    about = about or info(Options.__dataclass_fields__[name])
    return ([about.short] if about.short else []) + [flag(name)] + ([f"--{name}"] if "_" in name else [])


def targets(name: str) -> list[tuple[type, str]]:
    """The fields an option fills: (JobSpec or RendezvousOptions, field name), in `fills` order."""
    found: list[tuple[type, str]] = []
    for target in info(Options.__dataclass_fields__[name]).fills:
        target = name if target == SAME else target
        owners = [kind for kind in (JobSpec, RendezvousOptions) if target in kind.__dataclass_fields__]
        if len(owners) != 1:
            raise TypeError(f"option {name} fills {target!r}, a field of {len(owners)} of JobSpec, RendezvousOptions")
        found.append((owners[0], target))
    return found


def filled(parsed: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields of JobSpec and of RendezvousOptions, from the parsed options."""
    out: dict[type, dict[str, Any]] = {JobSpec: {}, RendezvousOptions: {}}
    for name, value in parsed.items():
        where = targets(name)
        if not where:
            continue  # read by another option's check
        for (kind, target), part in zip(where, value if len(where) > 1 else [value], strict=True):
            out[kind][target] = part
    return out[JobSpec], out[RendezvousOptions]


def env_names(name: str) -> list[str]:
    """The environment variables of an option: torchrun's PET_<NAME>, then RALLY_<NAME>."""
    return [f"PET_{name.upper()}", f"RALLY_{name.upper()}"]


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The options PET_<NAME> / RALLY_<NAME> set, converted as click converts them for the
    command (the first variable set wins; an empty one is unset). For `rally.launch`, which
    builds `Options` without click."""
    import click

    types_by_kind: dict[type, Any] = {bool: click.BOOL, int: click.INT, float: click.FLOAT, str: click.STRING}
    found: dict[str, Any] = {}
    for f in option_fields():
        for variable in env_names(f.name):
            text = environ.get(variable)
            if not text:
                continue
            try:
                found[f.name] = types_by_kind[info(f).kind].convert(text, None, None)
            except click.BadParameter as exc:
                raise ConfigError(f"{variable}={text!r}: {exc.format_message()}") from None
            break
    return found
