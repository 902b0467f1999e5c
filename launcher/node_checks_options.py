"""The flags of issue 21, parsed and checked here so config.py stays about rally's core.

* `--heartbeat-timeout SECONDS|auto`: `auto` learns it (agent/observe/learned_timeouts.py), tuned by
  `--timeout-safety-factor`, `--timeout-samples` and `--timeout-floor`;
* `--gpu-reclaim-timeout`: how long a restart waits for the old workers' GPU memory (agent/observe/gpu_reclaim.py);
* `--quarantine-after K` / `--quarantine-window`: keep out a node that caused K failures (agent/checks/quarantine.py);
* `--preflight` / `--no-preflight`, `--preflight-factor`, `--preflight-every-round`: the probe
  every node runs when a round forms (agent/checks/preflight.py); on by default for multi-node jobs.
"""

from __future__ import annotations

import math
from typing import Any

from rally.agent.observe.learned_timeouts import LearningSettings
from rally.launcher.validate import ConfigError, seconds

AUTO = "auto"


def _factor(value: Any, flag: str, example: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 1:
        raise ConfigError(f"{flag} {value}: must be a number above 1 ({example})")
    return number


def _count(value: Any, flag: str, least: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {value!r}: expected a whole number, at least {least}") from None
    if number < least:
        raise ConfigError(f"{flag} {value}: must be at least {least}")
    return number


def heartbeat_timeout(value: Any) -> tuple[float | None, LearningSettings | None]:
    """`--heartbeat-timeout`: seconds, or `auto` (learned); a typo says what it takes."""
    if value is None:
        return None, None
    if str(value).strip().lower() == AUTO:
        return None, LearningSettings()
    try:
        return seconds(value, "--heartbeat-timeout", zero_ok=False), None
    except ConfigError:
        raise ConfigError(
            f"--heartbeat-timeout {value}: expected a number of seconds above 0, or 'auto' to learn it from the job"
        ) from None


def node_check_fields(o: Any, max_nodes: int) -> dict[str, Any]:
    """JobSpec fields from these flags (`o`: the raw options, launcher/options.py)."""
    timeout, learning = heartbeat_timeout(o.heartbeat_timeout)
    if learning is not None:
        learning = LearningSettings(
            factor=_factor(
                o.timeout_safety_factor, "--timeout-safety-factor", "5: five times the longest interval seen"
            ),
            samples=_count(o.timeout_samples, "--timeout-samples", 2),
            floor=seconds(o.timeout_floor, "--timeout-floor", zero_ok=True),
        )
    if o.preflight and o.no_preflight:
        raise ConfigError("--preflight and --no-preflight contradict each other; give one of them")
    preflight = bool(o.preflight) or (max_nodes > 1 and not o.no_preflight)
    return {
        "heartbeat_timeout": timeout,
        "timeout_learning": learning,
        "gpu_reclaim_timeout": seconds(o.gpu_reclaim_timeout, "--gpu-reclaim-timeout", zero_ok=True),
        "quarantine_after": _count(o.quarantine_after, "--quarantine-after", 0),
        "quarantine_window": seconds(o.quarantine_window, "--quarantine-window", zero_ok=False),
        "preflight": preflight,
        "preflight_factor": _factor(o.preflight_factor, "--preflight-factor", "2: twice as slow as the median node"),
        "preflight_every_round": bool(o.preflight_every_round),
    }
