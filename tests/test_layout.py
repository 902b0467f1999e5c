"""The code's shape, kept by tests: very large modules flagged, one owner of the store's keys, leaf modules
that stay leaves, and an agent main loop that fits on one screen."""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import pytest

from support.package_graph import cycles, module_graph, rally_imports

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "agent", "rendezvous")
LARGE_MODULE_LINES = 800
# Methods of rendezvous.c10d.store.Store (and EtcdStore) that take a key name first.
KEYED_STORE_CALLS = {
    "set", "get", "get_str", "get_unsigned", "add", "check", "counter", "append", "set_once",
    "compare_set", "try_wait", "wait_deleted", "set_leased", "delete_key", "multi_set", "key",
}  # fmt: skip
# The protocol names the keys, each of its modules those of what it agrees on: forming
# (protocol.py, arrival.py), a running round (round_channel.py), the hang-stack exchange, the
# preemption barrier, the status board; the store implementations below it name their own few.
PROTOCOL = {
    "rendezvous/protocol.py", "rendezvous/arrival.py", "rendezvous/round_channel.py", "rendezvous/stack_exchange.py",
    "rendezvous/preemption_barrier.py", "rendezvous/status/board.py",
}  # fmt: skip
KEY_OWNERS = PROTOCOL | {"rendezvous/c10d/store.py", "rendezvous/etcd/store.py", "rendezvous/etcd/client.py"}


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


@pytest.mark.timeout(30)
def test_very_large_modules_are_flagged_not_failed() -> None:
    """A module's boundary is its concern, not a line count (a hard cap once cut modules in odd
    places): one well over the mark is named as a warning, for a reader to judge."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in modules()}
    for name, n in sorted(sizes.items()):
        if n > LARGE_MODULE_LINES:
            warnings.warn(f"{name} has {n} lines: does it hold more than one concern?", stacklevel=1)
    assert sizes, "no modules found"


def _names_a_key(call: ast.Call) -> bool:
    """`<...>store.<keyed method>("literal" or f"...", ...)`: a key spelled out at the call."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in KEYED_STORE_CALLS and call.args):
        return False
    receiver = func.value
    name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
    first = call.args[0]
    spelled = isinstance(first, ast.JoinedStr) or (isinstance(first, ast.Constant) and isinstance(first.value, str))
    if isinstance(first, (ast.List, ast.Tuple)):  # try_wait([keys], ...)
        spelled = any(
            isinstance(e, ast.JoinedStr) or (isinstance(e, ast.Constant) and isinstance(e.value, str))
            for e in first.elts
        )
    return name.endswith("store") and spelled


@pytest.mark.timeout(30)
def test_only_the_protocol_names_store_keys() -> None:
    offenders = []
    for path in modules():
        name = str(path.relative_to(REPO))
        if name in KEY_OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _names_a_key(node):
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert offenders == [], (
        f"store keys belong in the protocol's modules ({', '.join(sorted(PROTOCOL))}):\n" + "\n".join(offenders)
    )


def test_the_key_check_catches_a_key_spelled_out_elsewhere() -> None:
    """The check above would see the agent writing a key itself (so it can fail)."""
    calls = [
        n
        for n in ast.walk(ast.parse('rdzv.store.set(f"{r}/preempt_done", "1")\nself.store.try_wait(["x"], 1)'))
        if isinstance(n, ast.Call)
    ]
    assert [_names_a_key(c) for c in calls] == [True, True]
    harmless = [
        n for n in ast.walk(ast.parse('rnd.channel.publish_master("h", 1)\nd.get("x")')) if isinstance(n, ast.Call)
    ]
    assert not any(_names_a_key(c) for c in harmless)


@pytest.mark.timeout(30)
def test_console_and_the_worker_table_are_leaves_and_all_the_agent_takes_from_the_launcher() -> None:
    for leaf in ("agent/display/console.py", "agent/display/worker_table.py"):
        assert rally_imports(REPO / leaf) == set(), f"{leaf} must import nothing of rally"
    from_launcher = {
        m for p in (REPO / "agent").rglob("*.py") for m in rally_imports(p) if m.startswith("rally.launcher")
    }
    assert from_launcher <= {"rally.agent.display.console", "rally.agent.display.worker_table"}, from_launcher


@pytest.mark.timeout(30)
def test_the_agents_main_loop_fits_on_one_screen() -> None:
    from rally.agent.agent import Agent

    assert len(inspect.getsource(Agent._run).splitlines()) <= 25


@pytest.mark.timeout(30)
def test_every_test_starts_rally_through_the_one_launch_helper() -> None:
    """`helpers.start_rally` (behind run_rally, LiveRally, OnTerminal and agents.start_agent)
    is the only place a test spells out how rally is started."""
    spelled = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "tests").rglob("*.py"))
        if p.relative_to(REPO).as_posix() not in ("tests/support/helpers.py", "tests/test_layout.py")
        and ('"-m", "rally"' in p.read_text() or "rally_argv(" in p.read_text())
    ]
    assert spelled == []


@pytest.mark.timeout(30)
def test_tests_say_what_they_check_not_which_issue_asked() -> None:
    """A test's name and text say the behaviour it pins; an issue number sends the reader to a
    tracker the repository does not carry. Support code lives in tests/support/, not beside the tests."""
    import re

    tests = sorted((REPO / "tests").rglob("*.py"))
    numbered = [
        f"{p.relative_to(REPO)}:{i}"
        for p in tests
        for i, line in enumerate(p.read_text().splitlines(), start=1)
        if re.search(r"\b[Ii]ssues? \d", line)
    ]
    assert numbered == []
    beside = [
        p.name for p in (REPO / "tests").glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py"
    ]
    assert beside == [], "support code goes in tests/support/"


@pytest.mark.timeout(30)
def test_no_import_circles() -> None:
    assert cycles(module_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Paths named as examples, or as files a command writes, not as files of the repository.
NAMED_BUT_NOT_FILES = {
    "agent/x.py", "agent/m.py", "agent/checkpoint/x.py",  # tests/test_waits.py's examples of its own syntax
}  # fmt: skip
REPO_PATH = r"(?<![\w./-])(?:agent|launcher|rendezvous|tests|bench|docs|examples|slurm)/[\w/.-]*\.(?:py|md|sh|yml)"


@pytest.mark.timeout(30)
def test_every_path_the_code_and_docs_name_exists() -> None:
    """A docstring or page that names a file by its path before a move sends its reader nowhere:
    every repository path named in code, docs and scripts is a file that exists (outputs of
    benchmarks under bench/results/ excepted: a run writes them)."""
    import re
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True, timeout=30)
    stale = sorted(
        f"{name}: {path}"
        for name in tracked.stdout.split()
        if name.endswith((".py", ".md", ".sh", ".yml")) and (REPO / name).is_file()
        for path in set(re.findall(REPO_PATH, (REPO / name).read_text(errors="replace")))
        if not (REPO / path).exists() and path not in NAMED_BUT_NOT_FILES and not path.startswith("bench/results/")
    )
    assert stale == []


# Parameters typed bare `Any` hide the coupling between rooms from mypy. What is left
# is honest (a torch object under a module that must not import torch, DCP's own signatures).
MAX_BARE_ANY_PARAMETERS = 40


@pytest.mark.timeout(30)
def test_few_parameters_are_typed_bare_any() -> None:
    """`python tests/support/bare_any.py -v` lists them: type a new parameter, or use `object` for a value
    not checked yet, instead of `Any`."""
    from support.bare_any import bare_any_parameters

    found = bare_any_parameters()
    assert len(found) <= MAX_BARE_ANY_PARAMETERS, "\n".join(found)


@pytest.mark.timeout(30)
def test_docstrings_use_one_markup() -> None:
    """Markdown's backticks only (the docs site renders docstrings as Markdown): no reST roles
    (:func:`x`) and no double backticks, which once lived beside them in three styles."""
    import re

    rst = re.compile(r"``|:(?:func|class|mod|meth|attr|data|exc|obj):`")
    found = sorted(
        f"{path.relative_to(REPO)}:{i}"
        for path in modules()
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if rst.search(line)
    )
    assert found == []
