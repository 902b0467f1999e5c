"""--preload / --no-preload: what the per-node worker template imports before forking workers.

The default is torch for Python entry points that import beyond the standard library; a script
that imports nothing heavy gets no template (it would only pay an unused torch import).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rally.launcher.checks.validate import ConfigError


def imports_only_stdlib(script: str) -> bool:
    """True when a script imports nothing but the standard library (and rally's own `rally.job`).

    Such a script has nothing heavy to preload, so a template would only cost an import of
    torch that no worker uses. Read with `ast`, never executed; unreadable means "no".
    """
    import ast

    try:
        tree = ast.parse(Path(script).read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return False
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names <= set(sys.stdlib_module_names) | {"rally", "__future__"}


def parse_preload(
    value: object, no_preload: bool, no_python: bool, script: str | None = None, module: bool = False
) -> tuple[str, ...] | None:
    """What the worker template imports (agent/template/client.py); None: no template, plain starts.
    `value` is --preload as given: `A,B`, a list (YAML, rally.launch), or None (not given).

    Default: torch, when the entry point is Python, torch is importable, and the script imports
    something beyond the standard library (a script that does not has nothing to preload).
    --no-preload wins over --preload; --no-python always starts plainly.
    """
    if no_preload or no_python:
        return None
    if value is None:
        import importlib.util

        if script and not module and imports_only_stdlib(script):
            return None
        return ("torch",) if importlib.util.find_spec("torch") is not None else None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")  # a YAML list or A,B
    names = tuple(str(n).strip() for n in items if str(n).strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"--preload '{name}' is not a module name; write e.g. --preload torch,numpy")
    return names
