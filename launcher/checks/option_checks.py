"""The checks the options of launcher/options.py name, all of one signature:
`check(value, p: Parsing) -> parsed value`, raising `ConfigError` (one line, exit 2).

`p.flag` is the option's flag for messages; `p.options` the raw value of every option, for a
check that reads another's (--preflight reads --no-preflight); `p.parsed(name)` an option checked
before it (declaration order: --redirects needs --nproc-per-node's count); `p.notes` lines to tell
the user. `Options.parse` prefixes a message with the config file and line the value came from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rally.agent.base.spec import JobSpec, LearningSettings
from rally.launcher.checks import validate, values, worker_flags
from rally.launcher.checks.preload import parse_preload
from rally.launcher.checks.validate import ConfigError
from rally.rendezvous.backends import EndpointError, backend_named

# torchrun's variable for the workers' grace period, read when --shutdown-timeout is not given.
SHUTDOWN_TIMEOUT_VARIABLE = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
AUTO = "auto"


class Unavailable(Exception):
    """An option this check needs failed its own check (that mistake is told): skip this one."""


class RawOptions(Protocol):
    """The raw values the checks read besides their own: launcher.options.Options, which imports
    this module (so it is named here by what is read of it, not imported)."""

    @property
    def nnodes(self) -> object: ...
    @property
    def rdzv_backend(self) -> object: ...
    @property
    def rdzv_endpoint(self) -> object: ...
    @property
    def rdzv_id(self) -> object: ...
    @property
    def master_port(self) -> object: ...
    @property
    def no_preload(self) -> object: ...
    @property
    def no_python(self) -> object: ...
    @property
    def module(self) -> object: ...
    @property
    def checkpoint_dir_shared(self) -> object: ...
    @property
    def no_preflight(self) -> object: ...
    @property
    def torchrun_prefix(self) -> object: ...


@dataclass
class Parsing:
    """What a check sees besides its value (see the module docstring)."""

    options: RawOptions  # every raw value (another option's: through `other`)
    script: str | None = None
    flag: str = ""
    done: dict[str, Any] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # told as `rally: warning:` lines; the job runs

    def parsed(self, name: str) -> Any:
        """The checked value of an option declared before this one."""
        if name in self.failed:
            raise Unavailable(name)
        if name not in self.done:
            raise RuntimeError(f"{self.flag}'s check reads {name}, which is checked after it: declare {name} first")
        return self.done[name]

    def other(self, name: str, check: Check) -> Any:
        """Another option's raw value through `check`; a mistake in it is that option's (its
        message names where that value came from)."""
        try:
            return check(getattr(self.options, name), dataclasses.replace(self, flag="--" + name.replace("_", "-")))
        except ConfigError as exc:
            exc.option = name  # type: ignore[attr-defined]
            raise

    @functools.cached_property
    def gpus(self) -> int:
        return values.visible_gpu_count()


# A raw value comes from click, a YAML file, the environment or rally.launch: not yet checked, so
# `object`, which each check narrows (launcher/checks/validate.py's whole_number and real_number, or str()).
Check = Callable[[object, Parsing], Any]


# ------------------------------------------------------------------ shapes many options share
def given_text(value: object) -> str | None:
    """A raw value as text for a check that parses text; None for one not given (None, '', or
    another false value, which those checks read as their default)."""
    return str(value) if value else None


def as_is(value: object, parsing: Parsing) -> object:
    return value


def as_bool(value: object, parsing: Parsing) -> bool:
    return bool(value)


def no_prefix(value: object, parsing: Parsing) -> bool:
    """--no-prefix (or the deprecated --torchrun-prefix, which meant the same console) fills
    JobSpec.prefix_output."""
    return not (value or parsing.options.torchrun_prefix)


def deprecated_torchrun_prefix(value: object, parsing: Parsing) -> bool:
    """--torchrun-prefix asked for torchrun's header on --tee'd lines and nothing on the other
    streams. The header is now the default, so it is kept only as --no-prefix under its old name:
    scripts and config files that give it still run and print exactly what they printed."""
    if value:
        parsing.notes.append(
            "--torchrun-prefix is deprecated: --tee'd lines carry torchrun's prefix by default; "
            "it now means --no-prefix (no [rank] on the other streams)"
        )
    return bool(value)


def seconds(zero_ok: bool, minimum: float = 0.0, unset: float | None = None) -> Check:
    """A number of seconds (validate.seconds); None (not given) is `unset`."""

    def check(value: object, parsing: Parsing) -> float | None:
        return unset if value is None else validate.seconds(value, parsing.flag, zero_ok=zero_ok, minimum=minimum)

    return check


def always_seconds(zero_ok: bool) -> Check:
    """A number of seconds that must be there (an option with a default of its own)."""
    return lambda value, p: validate.seconds(value, p.flag, zero_ok=zero_ok)


def positive_seconds(value: object, parsing: Parsing) -> float | None:
    """A timeout that is off unless given; given, above 0 (and finite, as every timeout)."""
    if value is None:
        return None
    if validate.real_number(value) <= 0:
        raise ConfigError(f"{parsing.flag} {value}: must be a positive number of seconds")
    return validate.seconds(value, parsing.flag, zero_ok=False)


def not_negative(value: object, parsing: Parsing) -> int:
    number = validate.whole_number(value)
    if number < 0:
        raise ConfigError(f"{parsing.flag} {number}: cannot be negative")
    return number


def count(least: int) -> Check:
    """A whole number, at least `least`."""

    def check(value: object, parsing: Parsing) -> int:
        try:
            number = validate.whole_number(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{parsing.flag} {value!r}: expected a whole number, at least {least}") from None
        if number < least:
            raise ConfigError(f"{parsing.flag} {value}: must be at least {least}")
        return number

    return check


def factor(example: str) -> Check:
    """A finite number above 1."""

    def check(value: object, parsing: Parsing) -> float:
        try:
            number = validate.real_number(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number <= 1:
            raise ConfigError(f"{parsing.flag} {value}: must be a number above 1 ({example})")
        return number

    return check


def optional(check: Check) -> Check:
    return lambda value, p: None if value is None else check(value, p)


def port(value: object, parsing: Parsing) -> int:
    return validate.port(value, parsing.flag)


def writable_dir(value: object, parsing: Parsing) -> str:
    return validate.writable_dir(value, parsing.flag)


def signals(value: object, parsing: Parsing) -> tuple[int, ...]:
    """`SIGTERM,USR1,10`: each read by preemption_flag.to_signal, rally's one reading of a signal's name."""
    from rally.agent.worker_side.preemption_flag import to_signal

    out = []
    for name in str(value).split(","):
        name = name.strip().upper()
        if not name:
            continue
        full = name if name.startswith("SIG") else "SIG" + name
        try:
            out.append(int(to_signal(name)))
        except (KeyError, ValueError):
            raise ConfigError(
                f"{parsing.flag}: unknown signal '{name}'{values.suggest(full, signal.Signals.__members__)}"
            ) from None
    return validate.handled_signals(tuple(out), parsing.flag)


# ------------------------------------------------------------------ the job's size
def nnodes(value: object, parsing: Parsing) -> tuple[int, int]:
    """`N` or `MIN:MAX` with 0 < MIN <= MAX <= MAX_NODES."""
    low, high = values.parse_nnodes(str(value))
    if high > validate.MAX_NODES:
        raise ConfigError(f"--nnodes {high}: at most {validate.MAX_NODES} nodes")
    return low, high


def nproc_per_node(value: object, parsing: Parsing) -> int:
    nproc = values.parse_nproc(str(value))
    if nproc > validate.MAX_NPROC_PER_NODE:
        raise ConfigError(f"--nproc-per-node {nproc}: at most {validate.MAX_NPROC_PER_NODE} workers per node")
    return nproc


def node_rank(value: object, parsing: Parsing) -> int | None:
    if value is None:
        return None
    rank = not_negative(value, parsing)
    max_nodes = parsing.parsed("nnodes")[1]
    if rank >= max_nodes:
        raise ConfigError(f"--node-rank {rank} is not below --nnodes {max_nodes}; node ranks are 0 to {max_nodes - 1}")
    return rank


# ------------------------------------------------------------------ rendezvous
def standalone(value: object, parsing: Parsing) -> bool:
    """--standalone runs one node on a private store (as torchrun's does): the rendezvous flags it
    replaces are named in one note, never dropped in silence."""
    o = parsing.options
    if not value:
        return False
    replaced = [f"--nnodes {o.nnodes}"] if parsing.parsed("nnodes") != (1, 1) else []
    replaced += [f"--rdzv-endpoint {o.rdzv_endpoint}"] if o.rdzv_endpoint else []
    replaced += [f"--rdzv-backend {o.rdzv_backend}"] if o.rdzv_backend not in ("static", "c10d") else []
    replaced += [f"--rdzv-id {o.rdzv_id}"] if o.rdzv_id != JobSpec.run_id else []
    if replaced:
        parsing.notes.append(
            f"--standalone overrides {', '.join(replaced)}: it runs one node on a private store at a free port, "
            "with a random run id; drop --standalone to use them"
        )
    return True


def backend(value: object, parsing: Parsing) -> str:
    try:
        backend_named(str(value))
    except EndpointError as exc:
        raise ConfigError(str(exc)) from None
    return str(value)


def private_store(parsing: Parsing) -> bool:
    """A single-node static job without an address runs on a private store at a free port, as
    torchrun 2.13's does (--standalone always does)."""
    o = parsing.options
    static = backend_named(parsing.parsed("rdzv_backend")).static_ranks
    return static and not o.rdzv_endpoint and o.master_port is None and parsing.parsed("nnodes")[1] == 1


def run_id(value: object, parsing: Parsing) -> str:
    """--rdzv-id: the id every node shares; a private store's job gets a random one."""
    if not str(value).strip():
        raise ConfigError("--rdzv-id is empty; give the id every node of the job shares, e.g. --rdzv-id job42")
    if parsing.parsed("standalone") or (str(value) == JobSpec.run_id and private_store(parsing)):
        return str(uuid.uuid4())
    return str(value)


def rdzv_conf(value: object, parsing: Parsing) -> dict[str, Any]:
    conf = values.parse_rdzv_conf(given_text(value) or "", parsing.warnings)
    validate.check_rdzv_conf(conf)
    return conf


# ------------------------------------------------------------------ workers and their output
def std_map(value: object, parsing: Parsing) -> dict[int, int]:
    """torchrun's -r/-t, expanded for every local rank."""
    return values.parse_std_map(str(value), parsing.flag, parsing.parsed("nproc_per_node"))


def ranks_filter(value: object, parsing: Parsing) -> frozenset[int] | None:
    return values.parse_ranks_filter(str(value))


def comma_list(value: object, parsing: Parsing) -> tuple[str, ...]:
    return worker_flags.comma_separated_list(given_text(value))


def virtual_local_rank(value: object, parsing: Parsing) -> bool:
    worker_flags.check_virtual_local_rank(bool(value), parsing.parsed("nproc_per_node"))
    return bool(value)


def logs_specs(value: object, parsing: Parsing) -> str | None:
    name = given_text(value)
    worker_flags.logs_specs_note(name)
    return name


def event_log_handler(value: object, parsing: Parsing) -> str:
    if note := worker_flags.event_log_note(given_text(value)):
        parsing.notes.append(note)
    return str(value)


def numa_binding(value: object, parsing: Parsing) -> str | None:
    """Bound only where GPUs exist; every worker's CPUs worked out now, so a node where torch
    cannot is one line at launch."""
    if value is None:
        return None
    mode = str(value)
    if note := worker_flags.numa_note(mode, parsing.gpus):
        parsing.notes.append(note)
    if not parsing.gpus:
        return None
    worker_flags.check_numa_binding(mode, parsing.parsed("nproc_per_node"))
    return mode


def preload(value: object, parsing: Parsing) -> tuple[str, ...] | None:
    """--preload, given --no-preload, --no-python, -m and the script (launcher/checks/preload.py)."""
    o = parsing.options
    return parse_preload(value, bool(o.no_preload), bool(o.no_python), parsing.script, bool(o.module))


def shutdown_timeout(value: object, parsing: Parsing) -> float:
    """--shutdown-timeout, else torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else JobSpec's default."""
    if value is not None:
        return validate.seconds(value, parsing.flag, zero_ok=True)
    from_env = os.environ.get(SHUTDOWN_TIMEOUT_VARIABLE, "")
    if from_env.strip():
        return validate.seconds(from_env, SHUTDOWN_TIMEOUT_VARIABLE, zero_ok=True)
    return JobSpec.shutdown_timeout


def checkpoint_dir(value: object, parsing: Parsing) -> str | None:
    """Created 0700; refused with one line if another user may plant checkpoints in it (unless
    --checkpoint-dir-shared); a key to sign checkpoints with must exist (agent/checkpoint/core/auth.py)."""
    if value is None:
        return None
    validate.private_dir(value, parsing.flag)
    from rally.agent.checkpoint.core import auth

    path = Path(str(value)).resolve()
    problem = auth.directory_problem(path)
    if problem is not None and not parsing.options.checkpoint_dir_shared:
        raise ConfigError(auth.refusal_line(path, problem).removeprefix("rally: "))
    try:
        auth.job_keys()
    except auth.NoKey as exc:
        raise ConfigError(str(exc).removeprefix("rally: ")) from None
    return str(path)


# ------------------------------------------------------------------ health
def heartbeat_timeout(value: object, parsing: Parsing) -> tuple[float | None, LearningSettings | None]:
    """Seconds, or `auto` (learned, tuned by --timeout-safety-factor, --timeout-samples and
    --timeout-floor); a typo says what it takes."""
    if value is None:
        return None, None
    if str(value).strip().lower() != AUTO:
        try:
            return validate.seconds(value, parsing.flag, zero_ok=False), None
        except ConfigError:
            raise ConfigError(
                f"{parsing.flag} {value}: expected a number of seconds above 0, or 'auto' to learn it from the job"
            ) from None
    return None, LearningSettings(
        factor=parsing.other("timeout_safety_factor", factor("5: five times the longest interval seen")),
        samples=parsing.other("timeout_samples", count(2)),
        floor=parsing.other("timeout_floor", always_seconds(True)),
    )


def preflight(value: object, parsing: Parsing) -> bool:
    """On when asked, and by default for multi-node jobs unless --no-preflight."""
    if value and parsing.options.no_preflight:
        raise ConfigError("--preflight and --no-preflight contradict each other; give one of them")
    return bool(value) or (parsing.parsed("nnodes")[1] > 1 and not parsing.options.no_preflight)


def straggler_factor(value: object, parsing: Parsing) -> float:
    number = validate.real_number(value)
    if not math.isfinite(number) or number <= 1:
        raise ConfigError(f"{parsing.flag} {value}: must be a number above 1 (1.5: 50% slower than the others' median)")
    return number


def straggler_window(value: object, parsing: Parsing) -> int:
    window = validate.whole_number(value)
    if window < 2:
        raise ConfigError(f"{parsing.flag} {value}: must be at least 2 steps")
    return window


def metrics_port(value: object, parsing: Parsing) -> int | None:
    if value is None:
        return None
    number = validate.whole_number(value)
    if not 0 <= number <= 65535:
        raise ConfigError(f"{parsing.flag} {value}: must be a port number 0-65535 (0: any free port)")
    return number


def metrics_addr(value: object, parsing: Parsing) -> str:
    return str(value or "127.0.0.1").strip("[]")


def log_line_prefix_template() -> str | None:
    """JobSpec.log_line_prefix_template: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, which torchrun
    reads (torch/distributed/run.py) instead of a flag; empty is unset, as there."""
    return os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None


def python_exec() -> str:
    """The interpreter workers run (JobSpec.python_exec): $PYTHON_EXEC, as torchrun, else this one."""
    return os.environ.get("PYTHON_EXEC", sys.executable)
