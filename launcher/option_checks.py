"""The checks an option of launcher/options.py names: each takes (value, flag) and returns the
parsed value or raises `ConfigError` (one line, exit 2), so that a bad value is reported with the
flag, the environment variable or the config file line it came from (`Options.parse`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rally.launcher import validate, values
from rally.launcher.validate import ConfigError
from rally.rendezvous.backends import EndpointError, backend_named


def seconds(zero_ok: bool, minimum: float = 0.0) -> Callable[[Any, str], float | None]:
    def check(value: Any, flag: str) -> float | None:
        return None if value is None else validate.seconds(value, flag, zero_ok=zero_ok, minimum=minimum)

    return check


def positive_seconds(value: Any, flag: str) -> float | None:
    """A timeout that is off unless given; given, above 0 (and finite, as every timeout)."""
    if value is None:
        return None
    if float(value) <= 0:
        raise ConfigError(f"{flag} {value}: must be a positive number of seconds")
    return validate.seconds(value, flag, zero_ok=False)


def not_negative(value: Any, flag: str) -> int:
    number = int(value)
    if number < 0:
        raise ConfigError(f"{flag} {number}: cannot be negative")
    return number


def optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, flag: None if value is None else check(value, flag)


def non_empty_id(value: Any, flag: str) -> str:
    if not str(value).strip():
        raise ConfigError("--rdzv-id is empty; give the id every node of the job shares, e.g. --rdzv-id job42")
    return str(value)


def backend(value: Any, flag: str) -> Any:
    try:
        return backend_named(str(value))
    except EndpointError as exc:
        raise ConfigError(str(exc)) from None


def rdzv_conf(value: Any, flag: str) -> dict[str, Any]:
    conf = values.parse_rdzv_conf(value)
    validate.check_rdzv_conf(conf)
    return conf
