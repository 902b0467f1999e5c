"""rally: a torchrun-compatible launcher and elastic agent.

The package is installed as `rally` (distribution `torch-rally`) and nothing else, so a
user's own `agent.py`, `launcher/` or `job.py` is never shadowed by rally's modules:

* `from rally import job` -- the worker-side helper (checkpoints, heartbeat, preemption);
  cheap to import, never imports torch;
* `rally.run(argv) -> int` -- the `rally` command as a function that returns its exit code;
* `rally.launch(fn, ...)` -- run a Python callable on every worker and return per-rank results.

Attributes are loaded on first use, so `from rally import job` in a worker imports only the
standard library.
"""

from __future__ import annotations

import importlib
from typing import Any

from rally.launcher import __version__  # noqa: F401 - written once, in launcher/__init__.py

_LAZY = {
    "job": ("rally.agent.worker_side.job", None),
    "run": ("rally.launcher.api", "run"),
    "launch": ("rally.launcher.api", "launch"),
    "LaunchError": ("rally.launcher.api", "LaunchError"),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'rally' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
