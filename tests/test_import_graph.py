"""The house's arrows, read from the code (issue 20): launcher -> agent -> rendezvous, never back;
the display package is a leaf (tests/test_layout.py checks that no import circle exists). Every import counts,
also those inside functions (a lazy import is still a dependency) and under TYPE_CHECKING (a module
that needs another's type to be read depends on it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "agent", "rendezvous")
# A module may import from its own layer or any layer after it in this list, never before.
LAYERS = ("rally.launcher", "rally.agent", "rally.rendezvous")
LEAVES = ("rally.agent.display",)


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rally", *parts])


def imports_of(path: Path) -> set[str]:
    """rally modules `path` imports (`from rally.x import y` counts rally.x.y when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rally."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rally"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in ALL else node.module)
    return found & ALL.keys()


ALL: dict[str, Path] = {module_of(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}
GRAPH: dict[str, set[str]] = {name: imports_of(path) - {name} for name, path in ALL.items()}


def layer(module: str) -> int:
    return next(i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + "."))


@pytest.mark.timeout(30)
def test_arrows_point_from_launcher_to_agent_to_rendezvous_only() -> None:
    backwards = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if layer(b) < layer(a))
    assert backwards == []


@pytest.mark.timeout(30)
def test_the_display_package_is_a_leaf() -> None:
    leaking = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        if a.startswith(LEAVES)
        for b in targets
        if not b.startswith(LEAVES)
    )
    assert leaking == []
