"""rally's options, declared once: each is one field of `Options`, which carries its flag
names, default, help, help group and check. From these fields alone come:

* the click options of `rally` (`--nproc-per-node` and torchrun's `--nproc_per_node`, short
  names, metavars, choices, help grouped as in `rally --help`), in launcher/cli.py;
* the environment variables `PET_<NAME>` (as torchrun) and `RALLY_<NAME>`;
* the keys of a `--config` YAML file (either spelling) and the type each value must have
  (launcher/config_file.py);
* the keyword arguments of `rally.launch(...)` (launcher/api.py builds `Options` directly).

Adding a flag is a one-place edit: one field below, for example

    preflight_factor: float = option(2.0, "Health", "Fail a node whose ... (default 2.0).", check=above_one)
    # --preflight/--no-preflight:
    preflight: bool = option(True, "Health", "Check each node before it joins.", negative=True)

then read `parsed.preflight_factor` where launcher/config.py builds the job. Defaults that the
agent also needs live in the agent's own types (`JobSpec`, `RendezvousSettings`) and are read
from there with `spec_default`, so that each exists once. A check takes (value, flag) and
returns the parsed value or raises `ConfigError` (the shared ones: launcher/option_checks.py);
`Options.parse()` runs every check, in declaration order (directories last: checking them
creates them), and names the config file and line when the bad value came from one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rally.agent.observe.learned_timeouts import LearningSettings
from rally.agent.spec import JobSpec
from rally.launcher import node_checks_options, validate, values
from rally.launcher.option_checks import (
    backend,
    non_empty_id,
    not_negative,
    optional,
    positive_seconds,
    rdzv_conf,
    seconds,
)
from rally.launcher.validate import ConfigError, Mistakes
from rally.launcher.worker_flags import NUMA_MODES
from rally.rendezvous.backends import HostPort

GROUPS = ("Job", "Rendezvous", "Restarts and shutdown", "Logs and output", "Entry point", "Health", "rally extras")
METADATA_KEY = "rally.option"


@dataclass(frozen=True)
class OptionInfo:
    """What a field of `Options` says about its option, besides its name and default."""

    group: str
    help: str
    kind: type  # bool (a flag), int, float or str: how click, YAML and the environment convert it
    metavar: str | None = None
    short: str | None = None  # e.g. "-m"
    choices: tuple[str, ...] | None = None
    check: Callable[[Any, str], Any] | None = None  # (value, flag) -> parsed value, or ConfigError
    late: bool = False  # checked after every other option (the check has an effect: a directory)
    negative: bool = False  # a flag that also has its --no-<name> form (default True, say)


def option(
    default: Any,
    group: str,
    help: str,
    kind: type | None = None,
    *,
    metavar: str | None = None,
    short: str | None = None,
    choices: tuple[str, ...] | None = None,
    check: Callable[[Any, str], Any] | None = None,
    late: bool = False,
    negative: bool = False,
) -> Any:
    """A field of `Options`: its default and what the option is (see OptionInfo)."""
    if group not in GROUPS:
        raise ValueError(f"unknown help group {group!r}; one of {GROUPS}")
    resolved = kind or (bool if isinstance(default, bool) else type(default) if default is not None else str)
    info = OptionInfo(group, help, resolved, metavar, short, choices, check, late, negative)
    return field(default=default, metadata={METADATA_KEY: info})


def spec_default(name: str) -> Any:
    """The agent's own default for a JobSpec field (one place for it: agent/spec.py)."""
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
        check=lambda v, f: values.parse_nnodes(v),
    )
    nproc_per_node: str = option(
        "1", "Job", "Workers per node.", metavar="N|auto|cpu|gpu|xpu", check=lambda v, f: values.parse_nproc(v)
    )
    role: str = option(spec_default("role"), "Job", "Worker role name (ROLE_NAME, log prefixes).")
    standalone: bool = option(False, "Rendezvous", "Single node: a private store on a free port, a random run id.")
    rdzv_backend: str = option(
        "static",
        "Rendezvous",
        "c10d: elastic rendezvous through a store; etcd (or etcd-v2): the same on an etcd cluster; static: "
        "fixed node ranks.",
        metavar="c10d|etcd|static",
        check=backend,
    )
    rdzv_endpoint: str | HostPort = option(
        "",
        "Rendezvous",
        "The rendezvous store (c10d default port 29400), or etcd client endpoints HOST[:PORT],... (default port 2379).",
        str,
        metavar="HOST[:PORT]",
    )
    rdzv_id: str = option(
        spec_default("run_id"), "Rendezvous", "Job id shared by all nodes.", metavar="ID", check=non_empty_id
    )
    rdzv_conf: str = option(
        "",
        "Rendezvous",
        "join_timeout, last_call_timeout, read_timeout, is_host, keep_alive_interval, keep_alive_timeout, "
        "store_type, ...; etcd: protocol, cacert, cert, key, username, password_file",
        metavar="K=V,...",
        check=rdzv_conf,
    )
    node_rank: int | None = option(
        None, "Rendezvous", "This node's rank (static backend).", int, check=optional(not_negative)
    )
    master_addr: str | None = option(None, "Rendezvous", "Address of node rank 0 (static backend).")
    master_port: int | None = option(
        None, "Rendezvous", "Port of the store on node rank 0 (static backend).", int, check=optional(validate.port)
    )
    local_addr: str | None = option(None, "Rendezvous", "Address other nodes use to reach this one (default: FQDN).")
    max_restarts: int = option(
        spec_default("max_restarts"),
        "Restarts and shutdown",
        "Job-wide restarts allowed after worker failures.",
        check=not_negative,
    )
    monitor_interval: float = option(
        0.1,
        "Restarts and shutdown",
        "Accepted for torchrun compatibility; rally needs no polling.",
        check=seconds(True, validate.MIN_INTERVAL),
    )
    shutdown_timeout: float | None = option(
        None,
        "Restarts and shutdown",
        f"Grace period between the stop signal and SIGKILL (default {spec_default('shutdown_timeout'):g} s).",
        float,
        check=seconds(True),
    )
    signals_to_handle: str = option(
        TORCHRUN_SIGNALS,
        "Restarts and shutdown",
        "Signals forwarded to workers before shutdown.",
        check=values.parse_signals,
    )
    start_method: str = option(
        "spawn",
        "Restarts and shutdown",
        "Accepted for torchrun compatibility.",
        choices=("spawn", "fork", "forkserver"),
    )
    preload: str | None = option(
        None,
        "Restarts and shutdown",
        "Modules a per-node template process imports once; workers are forked from it and start in "
        "milliseconds (default: torch, for Python entry points).",
        metavar="MODULE,...",
    )
    no_preload: bool = option(
        False, "Restarts and shutdown", "No template: start every worker as a fresh python process."
    )
    log_dir: str | None = option(
        None,
        "Logs and output",
        "Base directory for per-rank log files and report.json.",
        check=optional(validate.writable_dir),
        late=True,
    )
    redirects: str = option(
        "0",
        "Logs and output",
        "Send streams to log files only: 1 stdout, 2 stderr, 3 both.",
        metavar="0-3|R:B,...",
        short="-r",
    )
    tee: str = option(
        "0", "Logs and output", "Send streams to log files and the console.", metavar="0-3|R:B,...", short="-t"
    )
    local_ranks_filter: str = option(
        "",
        "Logs and output",
        "Show only these local ranks on the console.",
        metavar="R,...",
        check=lambda v, f: values.parse_ranks_filter(v),
    )
    duplicate_stdout_filters: str = option(
        "",
        "Logs and output",
        "Copy worker stdout lines containing any of these to attempt_<n>/filtered_stdout.log (,, is a comma).",
        metavar="S,...",
    )
    duplicate_stderr_filters: str = option(
        "", "Logs and output", "The same for stderr, to filtered_stderr.log.", metavar="S,..."
    )
    logs_specs: str | None = option(
        None,
        "Logs and output",
        "A LogsSpecs class from the torchrun.logs_specs entry points: where each worker's logs go.",
        metavar="NAME",
    )
    event_log_handler: str = option(
        "null", "Logs and output", "Accepted for torchrun compatibility; rally writes events.jsonl.", metavar="NAME"
    )
    virtual_local_rank: bool = option(
        False, "Job", "LOCAL_RANK=0 for every worker; CUDA_VISIBLE_DEVICES narrowed to its own GPU."
    )
    numa_binding: str | None = option(
        None,
        "Job",
        "torchrun's NUMA binding modes (applied only where GPUs exist).",
        choices=NUMA_MODES,
    )
    module: bool = option(False, "Entry point", "Run SCRIPT as a module, like python -m.", short="-m")
    no_python: bool = option(False, "Entry point", "Run SCRIPT as an executable, not with python.")
    run_path: bool = option(False, "Entry point", "Run SCRIPT with runpy.run_path.")
    no_prefix: bool = option(False, "rally extras", "Do not prefix worker output lines with their rank.")
    quiet: bool = option(
        False, "Logs and output", "Show only rally's own lines on the console, not the workers' output."
    )
    checkpoint_dir: str | None = option(
        None,
        "rally extras",
        "Where workers save checkpoints (RALLY_CHECKPOINT_DIR); created 0700. Refused if another user "
        "owns it or may write it, unless --checkpoint-dir-shared.",
        check=optional(validate.private_dir),
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
        check=lambda v, f: node_checks_options.heartbeat_timeout(v),
    )
    silence_timeout: float | None = option(
        None, "Health", "Declare a worker hung after this many seconds without output.", float, check=seconds(False)
    )
    resource_interval: float = option(
        spec_default("resource_interval"),
        "Health",
        "Seconds between samples of workers' CPU, memory and threads.",
        check=seconds(False, validate.MIN_INTERVAL),
    )
    startup_timeout: float | None = option(
        None,
        "Health",
        "Declare a worker hung when its first rally.job.heartbeat() has not come this many seconds after it "
        "started (default: off).",
        float,
        check=positive_seconds,
    )
    straggler_factor: float = option(
        spec_default("straggler_factor"),
        "Health",
        "Name a rank a straggler when its step time exceeds this many times the median of the other ranks' "
        f"(default {spec_default('straggler_factor'):g}).",
        check=lambda v, f: values.parse_straggler_factor(v),
    )
    straggler_window: int = option(
        spec_default("straggler_window"),
        "Health",
        "Steps a rank's step time is averaged over, and must stay slow for, before it is named (default "
        f"{spec_default('straggler_window')}).",
        check=lambda v, f: values.parse_straggler_window(v),
    )
    metrics_port: int | None = option(
        None,
        "Health",
        "Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, printed).",
        int,
        check=lambda v, f: values.parse_metrics_port(v),
    )
    metrics_addr: str = option(
        spec_default("metrics_addr"),
        "Health",
        "Address the metrics endpoint listens on (default every interface, as node_exporter; 127.0.0.1 keeps "
        "it on this host).",
        metavar="ADDR",
        check=lambda v, f: str(v or "0.0.0.0").strip("[]"),
    )
    # Issue 21: learned timeouts, GPU memory before a restart, quarantine, pre-flight; parsed
    # together in launcher/node_checks_options.py (whether pre-flight is on depends on --nnodes).
    timeout_safety_factor: float = option(
        LearningSettings.factor,
        "Health",
        f"--heartbeat-timeout auto: this many times the longest interval seen (default {LearningSettings.factor:g}).",
    )
    timeout_samples: int = option(
        LearningSettings.samples,
        "Health",
        "--heartbeat-timeout auto: heartbeat intervals seen before the timeout is set (default "
        f"{LearningSettings.samples}).",
    )
    timeout_floor: float = option(
        LearningSettings.floor,
        "Health",
        f"--heartbeat-timeout auto: never below this many seconds (default {LearningSettings.floor:g}).",
    )
    gpu_reclaim_timeout: float = option(
        spec_default("gpu_reclaim_timeout"),
        "Restarts and shutdown",
        "Before a restart, wait up to this long for the old workers to leave every GPU and free its memory "
        f"(NVML; default {spec_default('gpu_reclaim_timeout'):g} s).",
    )
    quarantine_after: int = option(
        spec_default("quarantine_after"),
        "Restarts and shutdown",
        "Keep out of later rounds a node that was the root cause of this many failures within "
        "--quarantine-window, while the job can run without it (0: never; default "
        f"{spec_default('quarantine_after')}).",
    )
    quarantine_window: float = option(
        spec_default("quarantine_window"),
        "Restarts and shutdown",
        f"Seconds within which --quarantine-after failures count (default {spec_default('quarantine_window'):g}).",
    )
    preflight: bool = option(
        False,
        "Health",
        "Probe every node (compute, and a collective over the job's backend) when a round forms; keep out "
        "failing or slow nodes (default for multi-node jobs).",
    )
    no_preflight: bool = option(False, "Health", "No pre-flight probe.")
    preflight_factor: float = option(
        spec_default("preflight_factor"),
        "Health",
        "A node slower than this many times the median in the pre-flight probe is left out (default "
        f"{spec_default('preflight_factor'):g}).",
    )
    preflight_every_round: bool = option(
        False, "Health", "Probe again when a round re-forms on the same nodes (default: only when the nodes change)."
    )
    preemption_signals: str = option(
        PREEMPTION_SIGNALS,
        "rally extras",
        "Signals that warn of preemption or a time limit: forwarded to workers, which get --preemption-grace "
        "to checkpoint.",
        check=values.parse_signals,
    )
    preemption_grace: float = option(
        spec_default("preemption_grace"),
        "rally extras",
        "Seconds workers get to checkpoint after a preemption signal.",
        check=seconds(True),
    )
    requeue: bool = option(
        False, "rally extras", "On a preemption signal, node 0 requeues the SLURM job (scontrol requeue)."
    )
    crash_loop_limit: int = option(
        spec_default("crash_loop_limit"),
        "rally extras",
        "Stop after this many restarts in a row without a newer checkpoint in --checkpoint-dir (0: never).",
        check=not_negative,
    )
    no_slurm: bool = option(False, "rally extras", "Ignore the SLURM environment even inside a SLURM job.")

    # Where values came from, for messages: option name -> "--config job.yaml, line 3, 'nnodes'".
    origins: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def parse(self, act: bool = True) -> types.SimpleNamespace:
        """Every option's value checked and parsed (by its field's `check`; unchecked values as
        they are). Bad values raise one ConfigError (:class:`Mistakes`: all of them), each prefixed
        with the file and line it came from. ``act=False`` skips the late checks, which act (they
        make a directory): for a launch known to fail already."""
        parsed = types.SimpleNamespace()
        mistakes: list[str] = []  # every value is checked: all mistakes are told in one run
        for f in sorted(option_fields(), key=lambda f: info(f).late):
            value = getattr(self, f.name)
            check = info(f).check
            if info(f).late and (mistakes or not act):
                break  # a late check acts (it makes a directory): not for a launch that fails anyway
            try:
                setattr(parsed, f.name, check(value, flag(f.name)) if check else value)
            except ConfigError as exc:
                origin = self.origins.get(f.name)
                mistakes.append(f"{origin}: {exc}" if origin else str(exc))
            except (TypeError, ValueError) as exc:  # a value of the wrong type, from rally.launch
                mistakes.append(f"{flag(f.name)} {value!r}: {exc}")
        if mistakes:
            raise Mistakes(mistakes)
        return parsed

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


def info(f: dataclasses.Field) -> OptionInfo:
    return f.metadata[METADATA_KEY]


def names() -> list[str]:
    return [f.name for f in option_fields()]


def flag(name: str) -> str:
    """`nproc_per_node` -> `--nproc-per-node`."""
    return "--" + name.replace("_", "-")


def spellings(name: str, about: OptionInfo | None = None) -> list[str]:
    """Every flag of an option: its short name, the dashed name, and torchrun's underscored one
    (with a `negative` flag, each as click's `--x/--no-x` pair)."""
    about = about or info(Options.__dataclass_fields__[name])
    out = [flag(name)] + ([f"--{name}"] if "_" in name else [])
    if about.negative:
        out = [f"{f}/--no{'-' if f == flag(name) else '_'}{f[2:]}" for f in out]
    return ([about.short] if about.short else []) + out


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
