"""The house's arrows, read from the code: launcher -> agent -> rendezvous, never back;
the display package is a leaf; no circle between packages (tests/test_layout.py checks that
no module circle exists). Every import counts, also those inside functions (a lazy import is still a
dependency) and under TYPE_CHECKING (a module that needs another's type to be read depends on it).
The graph is tests/support/package_graph.py's: `python tests/support/package_graph.py` prints it."""

from __future__ import annotations

import ast

import pytest

from support.package_graph import (
    AGENT_LAYERS,
    RENDEZVOUS_LAYERS,
    REPO,
    agent_layer,
    cycles,
    describe,
    layer_in,
    modules,
    named_graph,
    package_graph,
    rooms_table,
)

# A module may import from its own layer or any layer after it in this list, never before.
LAYERS = ("rally.launcher", "rally.agent", "rally.rendezvous")
LEAVES = ("rally.agent.display",)
GRAPH = named_graph()


def layer(module: str) -> int:
    """`rally` itself (rally/__init__.py) is above the launcher: it re-exports the launcher's API."""
    if module == "rally":
        return -1
    return next(i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + "."))


@pytest.mark.timeout(30)
def test_arrows_point_from_launcher_to_agent_to_rendezvous_only() -> None:
    backwards = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if layer(b) < layer(a))
    assert backwards == []


def test_an_import_of_rally_itself_is_an_arrow_to_the_launcher() -> None:
    """`from rally import __version__` in the agent reaches the launcher through rally/__init__.py:
    the graph has `rally` as a module above the launcher, so the test above sees that arrow."""
    assert "rally.launcher" in GRAPH["rally"]
    assert layer("rally") < layer("rally.launcher") < layer("rally.agent.observe.metrics")


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


@pytest.mark.timeout(30)
def test_no_circle_between_packages() -> None:
    """Each package a layer: its modules never import, directly or round about, a package that
    imports it back. A sub-package's implied import of its parent's `__init__` is no arrow."""
    assert cycles(package_graph()) == [], describe()


def test_the_package_graph_sees_a_circle_through_sub_packages() -> None:
    """The fold to packages keeps the arrow a parent's module draws to its sub-package (so the test
    above can fail), and the circle check finds a circle through a parent and its child."""
    graph = package_graph()
    assert (
        "rally.agent.checkpoint.core" in graph["rally.agent.checkpoint"]
    )  # checkpoint/node_checkpoints.py imports core/
    assert cycles({"p": {"p.sub"}, "p.sub": {"p"}, "q": {"p"}}) == [["p", "p.sub"]]


@pytest.mark.timeout(30)
def test_the_agents_rooms_are_layers_in_the_documented_order() -> None:
    """Every package of agent/ has its row, and imports only its own row or rows before it."""
    graph = package_graph()
    rooms = sorted(p for p in graph if p == "rally.agent" or p.startswith("rally.agent."))
    assert sorted(p for row in AGENT_LAYERS for p in row) == rooms, "a new room needs its row in AGENT_LAYERS"
    upward = sorted(
        f"{a} -> {b}"
        for a in rooms
        for b in graph[a]
        if b.startswith("rally.agent") and agent_layer(b) > agent_layer(a)
    )
    assert upward == []


@pytest.mark.timeout(30)
def test_the_rendezvous_rooms_are_layers_in_the_documented_order() -> None:
    """Every package of rendezvous/ has its row, and imports only its own row or rows before it:
    the stores stand on the store interface, the round protocol at the root on both."""
    graph = package_graph()
    rooms = sorted(p for p in graph if p == "rally.rendezvous" or p.startswith("rally.rendezvous."))
    assert sorted(p for row in RENDEZVOUS_LAYERS for p in row) == rooms, "a new room needs its row in RENDEZVOUS_LAYERS"
    upward = sorted(
        f"{a} -> {b}"
        for a in rooms
        for b in graph[a]
        if b.startswith("rally.rendezvous") and layer_in(RENDEZVOUS_LAYERS, b) > layer_in(RENDEZVOUS_LAYERS, a)
    )
    assert upward == []


@pytest.mark.timeout(30)
def test_no_private_name_is_imported_from_another_module() -> None:
    """`from m import _x` couples the importer to m's insides: what two modules share is public."""
    private = sorted(
        f"{module} imports {node.module}.{alias.name}"
        for module, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rally.")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    )
    assert private == []


@pytest.mark.timeout(30)
def test_the_architecture_page_shows_the_rooms_as_the_code_has_them() -> None:
    """docs/architecture.md's room table is `python tests/support/package_graph.py --rooms`, verbatim."""
    page = (REPO / "docs" / "architecture.md").read_text()
    shown = page.split("<!-- rooms: generated by `python tests/support/package_graph.py --rooms` -->\n")[1].split(
        "\n<!-- /rooms -->"
    )[0]
    assert shown == rooms_table(), "regenerate it: python tests/support/package_graph.py --rooms"
    marker = "<!-- rendezvous rooms: generated by `python tests/support/package_graph.py --rooms rendezvous` -->\n"
    shown = page.split(marker)[1].split("\n<!-- /rendezvous rooms -->")[0]
    regenerate = "regenerate it: python tests/support/package_graph.py --rooms rendezvous"
    assert shown == rooms_table(RENDEZVOUS_LAYERS), regenerate
