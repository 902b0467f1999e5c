"""Checks of raw user input at the edge, before anything starts: each failure is one line that fixes it.

The option checks (launcher/checks/option_checks.py) parse values into the agent's types; this module
holds the errors, and the checks of values that parse but cannot work (an infinite timeout,
SIGKILL as a signal to forward, a log directory nobody can write, a port above 65535, a config
file value of the wrong type), so that none of them turns into a traceback, a hang or a silently
wrong job later on.
"""

from __future__ import annotations

import math
import os
import reprlib
import shutil
import signal
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, SupportsFloat, SupportsIndex, SupportsInt

from rally.agent.display.untrusted_text import printable


class ConfigError(Exception):
    """A user error in flags, environment or config file. The message is shown as is."""


class Mistakes(ConfigError):
    """Several mistakes found in one run, as one error: the first on the error line, each other
    on a line of its own below it (one mistake stays exactly its one line)."""

    def __init__(self, mistakes: list[str]) -> None:
        self.mistakes = list(mistakes)
        first, others = mistakes[0], mistakes[1:]
        text = f"{first} ({len(mistakes)} mistakes, the others below)" if others else first
        super().__init__("\n  ".join([text, *others]))


def mistakes_of(exc: ConfigError) -> list[str]:
    return exc.mistakes if isinstance(exc, Mistakes) else [str(exc)]


MAX_SECONDS = 7 * 24 * 3600.0
"""Upper bound of every timeout and interval (7 days): beyond it torch's store timeouts overflow
a C int of milliseconds and time stamps leave the platform's range; no job needs more."""

MIN_INTERVAL = 0.01
"""Smallest sampling interval (--resource-interval, keep_alive_interval): below it rally would spin."""

MAX_NPROC_PER_NODE = 1024
"""More workers than this on one node is a typo (each is a process with its own interpreter)."""

MAX_NODES = 100_000
"""Largest --nnodes: far beyond any cluster, small enough to catch a slipped key."""

NAME_MAX = 255
"""The longest file or directory name Linux file systems take, in bytes."""

MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""A --config file larger than this is not a job file (a symlink to a device, say)."""

UNHANDLED_SIGNALS = {
    signal.SIGKILL: "it cannot be caught",
    signal.SIGSTOP: "it cannot be caught",
    signal.SIGCHLD: "rally uses it to see workers exit",
}

# Options whose value, in a config file, is a list of strings rather than a scalar.
LIST_OPTIONS = {"preload", "args"}

# How much of a value a message quotes: a few items, a few levels, 80 characters of a string.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 2, 4, 4, 80, 80


def quoted(value: object) -> str:
    """`repr(value)` for a message, bounded whatever the value (a 4 MB string, a list nested
    to the limit): reprlib looks at no more of it than it shows."""
    return printable(_QUOTE.repr(value), limit=200)


# ------------------------------------------------------------------ config file values
def check_config_values(path: str, data: Mapping[str, Any]) -> None:
    """Every value in a YAML job file has the shape its option takes (scalars; lists of scalars)."""
    for key, value in data.items():
        if key == "script":
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(
                    f"--config {path}: 'script' must be the path of the training script as text, "
                    f"got {quoted(value)} ({type(value).__name__}); write e.g. script: train.py (quote numbers)"
                )
        elif key in LIST_OPTIONS:
            items = value if isinstance(value, list) else [value]
            bad = [item for item in items if isinstance(item, (list, dict)) or item is None]
            if bad:
                raise ConfigError(
                    f"--config {path}: '{key}' must be a list of plain values, got the item {quoted(bad[0])}; "
                    f"e.g. {key}: [--lr, '0.1']"
                )
        elif isinstance(value, (list, dict)):
            raise ConfigError(
                f"--config {path}: '{key}' must be a single value, got a {type(value).__name__} "
                f"({quoted(value)}); write it as {key}: VALUE"
            )


# ------------------------------------------------------------------ individual values
def whole_number(value: object) -> int:
    """`int(value)` of a raw value, which may be anything (rally.launch passes what it is given):
    text, bytes, or a number (anything with `__int__` or `__index__`); for any other value, the
    TypeError int() raises, in its words."""
    if isinstance(value, (str, bytes, bytearray, memoryview, SupportsInt, SupportsIndex)):
        return int(value)
    raise TypeError(f"int() argument must be a string, a bytes-like object or a real number, not {type_name(value)}")


def real_number(value: object) -> float:
    """`float(value)` of a raw value, as `whole_number` (`__float__` or `__index__`)."""
    if isinstance(value, (str, bytes, bytearray, memoryview, SupportsFloat, SupportsIndex)):
        return float(value)
    raise TypeError(f"float() argument must be a string or a real number, not {type_name(value)}")


HEAP_TYPE = 1 << 9
"""Py_TPFLAGS_HEAPTYPE: a type created at run time (a class statement), which the interpreter's messages
quote by its bare name; one compiled into an extension module they quote as its C name, `datetime.date`."""


def type_name(value: object) -> str:
    """A value's type as int() and float() quote it: `'list'`, `'datetime.date'` (a YAML date), `'PosixPath'`."""
    kind = type(value)
    bare = kind.__module__ == "builtins" or kind.__flags__ & HEAP_TYPE
    return repr(kind.__name__ if bare else f"{kind.__module__}.{kind.__name__}")


def seconds(value: object, option: str, *, zero_ok: bool, minimum: float = 0.0) -> float:
    """A finite number of seconds, > 0 (or >= 0 with `zero_ok`), at least `minimum`, at most MAX_SECONDS."""
    try:
        number = real_number(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{option} {quoted(value)}: expected a number of seconds, e.g. {option} 30") from None
    if math.isnan(number) or math.isinf(number) or number > MAX_SECONDS or number < 0 or (number == 0 and not zero_ok):
        lowest = "from 0" if zero_ok else f"from {minimum:g}" if minimum else "above 0 and"
        raise ConfigError(f"{option} {value}: must be a number of seconds {lowest} up to {MAX_SECONDS:g} (7 days)")
    if number and number < minimum:
        raise ConfigError(f"{option} {value}: must be at least {minimum:g} s (smaller values make rally spin)")
    return number


def port(value: object, option: str) -> int:
    try:
        number = whole_number(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{option} {quoted(value)}: expected a port number from 0 to 65535") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{option} {value}: port {number} is out of range; use a port from 0 to 65535")
    return number


def handled_signals(signums: tuple[int, ...], option: str) -> tuple[int, ...]:
    """Signals rally installs handlers for: none that cannot be caught or that rally needs itself."""
    for signum in signums:
        reason = UNHANDLED_SIGNALS.get(signal.Signals(signum))
        if reason:
            name = signal.Signals(signum).name
            raise ConfigError(
                f"{option}: {name} cannot be handled ({reason}); remove it, e.g. {option} SIGTERM,SIGUSR1"
            )
    return signums


def writable_dir(value: object, option: str) -> str:
    """Create `value` (with parents) if needed and prove a file can be written there."""
    text = str(value)
    if not text.strip():
        raise ConfigError(f"{option} is empty; give a directory, or leave the option out")
    path = Path(text)
    names_fit(path, option)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {text}: exists and is not a directory; give a directory")
    if not _trusted(path, option):
        return text
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {text}: cannot write there ({exc.strerror}); give a writable directory") from None
    return text


def _trusted(path: Path, option: str) -> bool:
    """Whether the rule of rendezvous/base/path_trust.py lets rally make `path`; when it does not,
    nothing is made here and launcher/checks/path_checks.py refuses it (or, for --checkpoint-dir-shared,
    warns), knowing the other options."""
    from rally.rendezvous.base.path_trust import UnsafePath, check_directory

    try:
        check_directory(path, option, [])
    except (UnsafePath, OSError):
        return False
    return True


def private_dir(value: object, option: str) -> str:
    """`writable_dir`, but a directory it creates is 0700 (only the user may read its checkpoints)."""
    text = str(value)
    try:
        if text.strip() and not os.path.lexists(text) and _trusted(Path(text), option):
            os.makedirs(text, mode=0o700, exist_ok=True)
    except (OSError, ValueError):
        pass  # writable_dir says what is wrong, in one line
    return writable_dir(value, option)


def config_text(path: str) -> str:
    """The text of a --config file: a regular file only (a FIFO would hang the read, /dev/zero
    fill memory), at most MAX_CONFIG_BYTES, read without blocking (agent/base/untrusted_files.py)."""
    from rally.agent.base.untrusted_files import UntrustedFile, read_capped

    try:
        return read_capped(path, MAX_CONFIG_BYTES, whole=True, follow=True).decode("utf-8")
    except UntrustedFile as exc:
        raise ConfigError(f"--config {path}: {str(exc).removeprefix(str(path) + ' ')}; give a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None


def names_fit(path: Path, option: str) -> None:
    """Every component of `path` fits the file system's NAME_MAX (255 bytes on Linux), which
    would otherwise surface as ENAMETOOLONG from deep inside a start."""
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            raise ConfigError(
                f"{option}: the name '{part[:24]}...' in that path is {size} bytes long; a file or directory "
                f"name can be at most {NAME_MAX}"
            )


def runnable_program(script: str) -> None:
    """--no-python: the program is an executable file, or a command found on PATH. A bare name is
    looked up on PATH only, as a shell does (and as the worker's exec will): one in the working
    directory is named with its `./` instead of failing later with a traceback."""
    path = Path(script)
    if os.sep not in script and path.exists() and not shutil.which(script):
        raise ConfigError(
            f"--no-python: '{script}' is not a program on PATH; did you mean ./{script} (the one in {os.getcwd()})?"
        )
    if os.sep in script or path.exists():
        if path.is_dir():
            raise ConfigError(f"--no-python: '{script}' is a directory, not a program")
        if not path.is_file():
            raise ConfigError(f"--no-python: '{script}' does not exist")
        if not os.access(path, os.X_OK):
            raise ConfigError(
                f"--no-python: '{script}' is not executable; chmod +x it, or drop --no-python for a Python script"
            )
    elif not shutil.which(script):
        raise ConfigError(f"--no-python: '{script}' is not a program on PATH or a file")


def python_script(script: str, module: bool) -> None:
    if module:
        if not all(part.isidentifier() for part in script.split(".")):
            raise ConfigError(f"-m/--module '{script}' is not a module name; write e.g. -m mypackage.train")
    elif Path(script).is_dir():
        raise ConfigError(
            f"training script '{script}' is a directory; give the script file, e.g. {Path(script) / 'train.py'}"
        )


# ------------------------------------------------------------------ --rdzv-conf
def check_rdzv_conf(conf: dict[str, Any]) -> None:
    """--rdzv-conf numbers are finite seconds within range; keep_alive_max_attempt a whole count."""
    for key, value in conf.items():
        if key in ("is_host", "store_type") or value is None or isinstance(value, str):  # not numbers
            continue
        if key == "keep_alive_max_attempt":
            if not math.isfinite(value) or value != int(value) or not 1 <= value <= 1_000_000:
                raise ConfigError(
                    f"--rdzv-conf keep_alive_max_attempt={value:g}: must be a whole number from 1 to 1000000"
                )
            conf[key] = int(value)
            continue
        minimum = MIN_INTERVAL if key == "keep_alive_interval" else 0.0
        seconds(value, f"--rdzv-conf {key}", zero_ok=False, minimum=minimum)
