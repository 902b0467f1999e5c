"""The tests' one import-graph walker: which rally modules each module imports, read from the code
(every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is still a
dependency), the same graph folded to packages, and its circles. tests/test_layout.py and
tests/test_import_graph.py check the house's rules against it.

Run it to see the package graph and its circles:

    python tests/support/package_graph.py            # packages, their arrows, the circles
    python tests/support/package_graph.py --modules  # the module-level circles too
    python tests/support/package_graph.py rendezvous # one package's rooms only (agent, rendezvous, launcher)
    python tests/support/package_graph.py --rooms    # agent/'s rooms as docs/architecture.md shows them
    python tests/support/package_graph.py --rooms rendezvous  # rendezvous/'s rooms, likewise
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "agent", "rendezvous")


def module_of(path: Path) -> str:
    """`agent/checkpoint/holder.py` -> `rally.agent.checkpoint.holder` (a package's `__init__` is the package)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rally", *parts])


@cache
def modules() -> dict[str, Path]:
    """Every module of rally's three packages, by its import name, and `rally` itself
    (rally/__init__.py, which imports the launcher: an import of `rally` is an import of the launcher)."""
    found = {module_of(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}
    return {"rally": REPO / "rally" / "__init__.py", **found}


def is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def package_of(module: str) -> str:
    """The package a module lives in (a package's `__init__` is in the package itself)."""
    return module if is_package(module) else module.rpartition(".")[0]


def rally_imports(path: Path) -> set[str]:
    """What `path` imports of rally, as written: `import a.b` gives a.b; `from a.b import c` gives
    a.b and a.b.c (c may be a module or a name in a.b). Not filtered to existing modules."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == "rally" or a.name.startswith("rally."))
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith("rally."):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def named_imports(path: Path) -> set[str]:
    """The rally modules `path` names: `import a.b` gives a.b; `from a.b import c` gives a.b.c when
    that is a module, else a.b."""
    known = modules()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith("rally."):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
    return found & known.keys()


@cache
def module_graph() -> dict[str, frozenset[str]]:
    """Module -> the rally modules it imports. Python runs a package's `__init__` before any module in
    it, so an import of a.b.c also counts a.b and a (that is how a circle through an `__init__` shows)."""
    known = modules()
    graph: dict[str, frozenset[str]] = {}
    for name, path in known.items():
        deps = set()
        for imported in named_imports(path):
            parts = imported.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[name] = frozenset(d for d in deps if d in known and d != name)
    return graph


@cache
def named_graph() -> dict[str, frozenset[str]]:
    """Module -> the rally modules it names in its imports (no implied parent packages)."""
    return {name: frozenset(named_imports(path) - {name}) for name, path in modules().items()}


@cache
def package_graph() -> dict[str, frozenset[str]]:
    """Package -> the other packages its modules name in their imports. A sub-package's implied
    import of its parent's (empty) `__init__` is no arrow; a named import of the parent's modules is."""
    graph: dict[str, set[str]] = {package_of(m): set() for m in modules()}
    for module, targets in named_graph().items():
        graph[package_of(module)].update(package_of(t) for t in targets)
    return {package: frozenset(targets - {package}) for package, targets in graph.items()}


def cycles(graph: dict[str, frozenset[str]] | dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def within(graph: dict[str, frozenset[str]], top: str) -> dict[str, frozenset[str]]:
    """The part of `graph` inside package `top` (e.g. rally.rendezvous): its packages, the arrows between them."""
    inside = {p for p in graph if p == top or p.startswith(top + ".")}
    return {p: frozenset(t & inside) for p, t in graph.items() if p in inside}


def describe(show_modules: bool = False, top: str = "rally") -> str:
    """The package graph (each package, the packages it imports), its circles and the arrows that
    make them; with `show_modules` the module-level circles as well. `top` keeps one package's rooms."""
    graph = package_graph() if top == "rally" else within(package_graph(), top)
    lines = [f"{top}'s package graph ({len(graph)} packages, {len(modules())} modules in rally):"]
    lines += [f"  {p} -> {', '.join(sorted(t)) or '(nothing)'}" for p, t in sorted(graph.items())]
    circles = cycles(graph)
    lines.append(f"package circles: {len(circles)}")
    for circle in circles:
        lines.append(f"  circle of {len(circle)}: {', '.join(circle)}")
        inside = set(circle)
        for module, targets in sorted(named_graph().items()):
            if package_of(module) in inside:
                for target in sorted(targets):
                    if package_of(target) in inside and package_of(target) != package_of(module):
                        lines.append(f"    {module} -> {target}")
    if show_modules:
        module_circles = cycles(module_graph())
        lines.append(f"module circles: {len(module_circles)}")
        lines += [f"  {', '.join(c)}" for c in module_circles]
    return "\n".join(lines)


# The agent's rooms from the bottom up. A package may import packages on its own row or a row
# before it, never after (tests/test_import_graph.py); docs/architecture.md shows `rooms_table()`.
AGENT_LAYERS: tuple[tuple[str, ...], ...] = (
    ("rally.agent.base", "rally.agent.display"),
    ("rally.agent.checkpoint.core",),
    ("rally.agent.checkpoint.sharded",),
    ("rally.agent.checkpoint", "rally.agent.guard"),
    ("rally.agent.template",),
    ("rally.agent.worker_side",),
    ("rally.agent.observe",),
    ("rally.agent.rounds", "rally.agent.checks"),
    ("rally.agent",),
)


# The rendezvous' rooms from the bottom up, kept the same way: the store interface and what every
# room stands on; what nodes say about themselves; the stores; the round protocol and the registry.
RENDEZVOUS_LAYERS: tuple[tuple[str, ...], ...] = (
    ("rally.rendezvous.base",),
    ("rally.rendezvous.status",),
    ("rally.rendezvous.c10d",),
    ("rally.rendezvous.etcd",),
    ("rally.rendezvous",),
)
LAYERS_OF = {"agent": AGENT_LAYERS, "rendezvous": RENDEZVOUS_LAYERS}


def layer_in(layers: tuple[tuple[str, ...], ...], package: str) -> int:
    return next(i for i, row in enumerate(layers) if package in row)


def agent_layer(package: str) -> int:
    return layer_in(AGENT_LAYERS, package)


def first_sentence(package: str) -> str:
    """What the package's `__init__` docstring says it holds: its first sentence."""
    init = REPO / Path(*package.split(".")[1:]) / "__init__.py"
    doc = " ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split())
    return doc.split(". ")[0].rstrip(".")


def folder_of(package: str, top: str) -> str:
    """`rally.rendezvous.c10d` -> `rendezvous/c10d/` inside `top`'s table, `rendezvous/` in another's
    (another package's rooms are its own table's business)."""
    parts = package.split(".")[1:]
    inside = package == top or package.startswith(top + ".")
    return "/".join(parts if inside else parts[:1]) + "/"


def rooms_table(layers: tuple[tuple[str, ...], ...] = AGENT_LAYERS) -> str:
    """A package's rooms (agent/'s unless told), bottom row first: what each holds (its docstring)
    and what it imports (the code). Generated, so that docs/architecture.md cannot drift from the code."""
    graph = package_graph()
    top = layers[-1][0]
    rows = ["| layer | package | holds | imports |", "|---|---|---|---|"]
    for level, row in enumerate(layers):
        for package in row:
            folder = "/".join(package.split(".")[1:]) + "/"
            imports = sorted({folder_of(t, top) for t in graph[package]})
            rows.append(f"| {level} | `{folder}` | {first_sentence(package)} | {', '.join(imports) or '-'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    named = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--rooms" in sys.argv[1:]:
        print(rooms_table(LAYERS_OF[named[0]] if named else AGENT_LAYERS))
    else:
        print(describe(show_modules="--modules" in sys.argv[1:], top=f"rally.{named[0]}" if named else "rally"))
