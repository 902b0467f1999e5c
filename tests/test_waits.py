"""Every wait in rally's code has a bound and, when it can last more than a few seconds, a
progress line.

The code is read, not run: every call that can block (a store wait, `Event.wait`, a process or
thread wait, a `select`/`poll`, `sleep`, a blocking `flock`, `subprocess.run`, socket reads) is
found by its name in the syntax tree of every module of rally, and each one declares what bounds
it where it is written (a rename or a move takes the declaration along), in a comment
directly above the line of the call:

    # wait: KIND[, said by WHO]: why it is bounded
    # wait HEAD: KIND ...        (only for the call HEAD, when one line holds several waits)

KIND is one of
    short       its bound is a number or constant of at most SHORT_SECONDS
    bounded     a bound that can be long (a user's timeout): the progress line is named in `said by`
    slice       one bounded slice of a longer wait that loops and re-checks; `said by` names the
                function that announces the whole wait (or "the job": the wait *is* the running job)
    background  a thread or server of the agent waiting for work while the job runs; nobody
                waits on it, so no line; its slices are bounded unless it is a server's loop
    after_kill  a process wait with no bound right after SIGKILL (the kernel ends it)
    not_a_wait  a call with a waiting name that returns at once (WNOHANG, Popen.poll, ...)

WHO is a function of the same module (`Class.method`), one of another (`agent/x.py Class.method`) or
`the job`: that function must print something (console say/warn/error, `on_status`, `announce`, a
`progress` callback) - the line that tells the user what is awaited. The comment may go on over more
comment lines. A wait that is long and silent today is in KNOWN_SILENT too, with why it may stay so;
the last test keeps that list honest in both directions.

There is no list of waits here: the code is the list. A new wait fails the first test
with its place and what to write above it.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"launcher": "rally.launcher", "agent": "rally.agent", "rendezvous": "rally.rendezvous", "rally": "rally"}
SHORT_SECONDS = 10.0
# Names of calls that can block. `join` and `get` only count with a timeout or block keyword or
# on a thread (str.join and dict.get are everywhere); see `_blocking`.
WAIT_NAMES = {"sleep", "communicate", "select", "poll", "recv", "recv_into", "accept", "flock", "run_blocking"}
# `tick` is a wait's throttled progress line (rendezvous/status/waiting.py WaitProgress, rendezvous/status/long_wait.py
# LongWait), `wait_in_slices` a wait made in slices that ticks (rendezvous/status/long_wait.py).
ANNOUNCERS = {"say", "warn", "error", "on_status", "announce", "plain_error", "progress", "tick", "wait_in_slices"}

S, B, SL, BG, AK, NW = "short", "bounded", "slice", "background", "after_kill", "not_a_wait"
KINDS = (S, B, SL, BG, AK, NW)
# `# wait: KIND[, said by WHO]: why` or `# wait HEAD: ...` (the module docstring says what each part means)
MARKER = re.compile(
    r"#\s*wait(?:\s+(?P<head>[^:\s]+))?:\s*(?P<kind>[a-z_]+)"
    r"(?:,\s*said by (?P<says>the job|\S+\.py \S+|\S+))?:\s*(?P<why>.*)"
)
Declaration = tuple[str, tuple[str, str] | str | None, str]  # (kind, says or None, why)
# Long waits with no progress line yet (each also declared at its call, with its bound). Give one
# its line, then name it in the declaration's `said by` and drop it here; the last test says when.
# None is left: every long wait says what it waits for and until when.
KNOWN_SILENT: dict[tuple[str, str, str], str] = {}
# Calls whose callee applies its own bound (a default timeout or slices of one).
BOUND_INSIDE = {
    "work.wait",
    "self.loop.run_blocking",
    "stacks.wait_request",
    "channel.wait_end",
    "self.channel.wait_master",
    "connection.wait_ready",
    "self._wait_for_all_nodes",
    "self._wait_as_spare",
    "link.wait_for_enter",
}


def _qualname(stack: list[str]) -> str:
    return ".".join(stack)


def _is_thread_join(call: ast.Call) -> bool:
    receiver = call.func.value  # type: ignore[attr-defined]
    if isinstance(receiver, ast.Constant):
        return False  # "sep".join(...)
    text = ast.unparse(receiver)
    return "thread" in text.lower() or any(k.arg == "timeout" for k in call.keywords) or not call.args


def _blocking(call: ast.Call) -> str | None:
    """The call's text up to "(" when its name says it can block, else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    text = ast.unparse(func)
    if name in ("join",):
        return text if isinstance(func, ast.Attribute) and _is_thread_join(call) and "path" not in text else None
    if name == "get":
        return text if any(k.arg in ("block", "timeout") for k in call.keywords) else None
    if ("wait" in name and not name.endswith("_nowait")) or name in WAIT_NAMES:
        return text
    if name == "run" and text == "subprocess.run" or text.endswith(".run") and "Agent(" in text:
        return text
    if name == "run" and isinstance(func, ast.Name):
        return text  # bootstrap's run(): the worker's own program
    return None


class _WaitFinder(ast.NodeVisitor):
    """Adds each blocking call of one module to `found`, keyed by the function (or class) it is in."""

    def __init__(self, module: str, found: dict[tuple[str, str, str], list[int]]) -> None:
        self.module = module
        self.found = found
        self.stack: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        head = _blocking(node)
        if head is not None:
            self.found.setdefault((self.module, _qualname(self.stack), head), []).append(node.lineno)
        self.generic_visit(node)


def _sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]


@cache
def find_waits() -> dict[tuple[str, str, str], list[int]]:
    """Every blocking call of rally: (module, function, the call up to "(") -> its lines."""
    found: dict[tuple[str, str, str], list[int]] = {}
    for path in _sources():
        _WaitFinder(str(path.relative_to(REPO)), found).visit(ast.parse(path.read_text()))
    return found


@cache
def _lines(module: str) -> list[str]:
    return (REPO / module).read_text().splitlines()


def _comment_block_above(lines: list[str], lineno: int) -> list[tuple[int, str]]:
    """The comment lines directly above line `lineno` (1-based), top first, with their numbers."""
    block: list[tuple[int, str]] = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        block.insert(0, (i + 1, lines[i].strip()))
        i -= 1
    return block


def _markers(module: str, block: list[tuple[int, str]]) -> list[tuple[int, str | None, Declaration]]:
    """The `# wait:` declarations in a comment block: (line, the call it names or None, declaration)."""
    found: list[tuple[int, str | None, list[str]]] = []
    for lineno, text in block:
        match = MARKER.match(text)
        if match:
            found.append((lineno, match["head"], [match["kind"], match["says"] or "", match["why"]]))
        elif found:
            found[-1][2][2] += " " + text.lstrip("#").strip()  # the why goes on
    result = []
    for lineno, head, (kind, says, why) in found:
        said: tuple[str, str] | str | None = None
        if says == "the job":
            said = "job"
        elif says:
            where, _, function = says.rpartition(" ")
            said = (where or module, function)
        result.append((lineno, head, (kind, said, why.strip())))
    return result


def declared_in_code(
    found: dict[tuple[str, str, str], list[int]],
) -> tuple[dict[tuple[str, str, str], Declaration], list[str]]:
    """Each found wait's `# wait:` declaration, and what is wrong with the declarations: an unknown
    kind, two that disagree for one call, a declaration with no such call under it."""
    declared: dict[tuple[str, str, str], Declaration] = {}
    used: set[tuple[str, int]] = set()
    problems: list[str] = []
    for key, lines in sorted(found.items()):
        module, _, head = key
        source = _lines(module)
        for lineno in lines:
            markers = [m for m in _markers(module, _comment_block_above(source, lineno)) if m[1] in (None, head)]
            if len(markers) > 1:
                problems.append(f"{module}:{lineno}: {len(markers)} `# wait:` comments for {head}(...): name the call")
            for marker_line, _, declaration in markers[:1]:
                used.add((module, marker_line))
                if declaration[0] not in KINDS:
                    problems.append(f"{module}:{marker_line}: unknown wait kind {declaration[0]!r} (one of {KINDS})")
                elif declared.setdefault(key, declaration) != declaration:
                    problems.append(f"{module}:{marker_line}: {head}(...) is declared differently elsewhere in it")
    for module in sorted({m for m, _, _ in found} | {str(p.relative_to(REPO)) for p in _sources()}):
        for i, line in enumerate(_lines(module), start=1):
            if MARKER.match(line.strip()) and (module, i) not in used:
                problems.append(f"{module}:{i}: a `# wait:` comment with no blocking call right under it")
    return declared, problems


@cache
def all_waits() -> dict[tuple[str, str, str], Declaration]:
    """Every wait's declaration, as written above it in the code."""
    declared, _ = declared_in_code(find_waits())
    return declared


def _function(module: str, qualname: str) -> ast.AST | None:
    tree = ast.parse((REPO / module).read_text())
    nodes: list[ast.AST] = [tree]
    for part in qualname.split("."):
        nodes = [n for parent in nodes for n in ast.iter_child_nodes(parent) if getattr(n, "name", None) == part]
    return nodes[0] if nodes else None


def announces(module: str, qualname: str) -> bool:
    """The function prints a progress line itself (console say/warn/error, on_status, ...)."""
    function = _function(module, qualname)
    if function is None:
        return False
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ANNOUNCERS:
                return True
    return False


def _bound_seconds(module: str, call: ast.Call) -> float | None:
    """The call's bound when it is a number or a module constant (else None: computed)."""
    candidates = [k.value for k in call.keywords if k.arg == "timeout"] + list(call.args[-1:])
    for expr in candidates:
        try:
            return float(ast.literal_eval(expr))
        except (ValueError, TypeError, SyntaxError):
            pass
        if isinstance(expr, ast.Name) and expr.id.isupper():
            package, _, name = module.partition("/")
            dotted = name[:-3].replace("/", ".")  # agent/checkpoint/x.py -> rally.agent.checkpoint.x
            value = getattr(importlib.import_module(f"{PACKAGES[package]}.{dotted}"), expr.id, None)
            if isinstance(value, (int, float)):
                return float(value)
    return None


@pytest.mark.timeout(60)
def test_every_blocking_call_in_the_code_declares_its_bound():
    found = find_waits()
    declared, problems = declared_in_code(found)
    new = [
        f"{m}:{lines[0]} in {f or '<module>'}: {head}(...)"
        for (m, f, head), lines in found.items()
        if (m, f, head) not in declared
    ]
    assert not new, (
        "blocking calls that do not say what bounds them - give each a bound and, if it can last more than a "
        "few seconds, a progress line, then write above the call `# wait: KIND[, said by WHO]: why` "
        "(tests/test_waits.py says how):\n" + "\n".join(new)
    )
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_short_waits_are_short_and_unbounded_ones_only_follow_a_kill():
    problems = []
    for (module, function, head), (kind, _says, why) in all_waits().items():
        node = _function(module, function) if function else ast.parse((REPO / module).read_text())
        assert node is not None, (module, function)
        calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and _blocking(n) == head]
        for call in calls:
            has_bound = bool(call.args) or any(k.arg == "timeout" for k in call.keywords)
            if kind == S and head not in ("time.sleep", "fcntl.flock", "os.waitpid", "subprocess.run"):
                seconds = _bound_seconds(module, call)
                if seconds is not None and seconds > SHORT_SECONDS:
                    problems.append(f"{module} {function}: {head} waits up to {seconds:g} s, not short ({why})")
            if kind == S and head == "subprocess.run" and not any(k.arg == "timeout" for k in call.keywords):
                problems.append(f"{module} {function}: subprocess.run without timeout=")
            if kind in (B, SL, BG) and head not in BOUND_INSIDE and not has_bound and "serve" not in function:
                problems.append(f"{module} {function}: {head}() has no bound")
            if kind == AK and not _follows_kill(node, call):
                problems.append(f"{module} {function}: {head}() has no bound and does not follow a kill")
    assert problems == []


def _follows_kill(function: ast.AST, call: ast.Call) -> bool:
    """An unbounded process wait is fine right after `.kill()` on the same process."""
    receiver = ast.unparse(call.func.value)  # type: ignore[attr-defined]
    kills = [n for n in ast.walk(function) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"{receiver}.kill"]
    return any(k.lineno < call.lineno for k in kills)


@pytest.mark.timeout(60)
def test_every_long_wait_prints_what_it_waits_for():
    """`says` names a function that prints; KNOWN_SILENT lists the long waits that do not yet,
    and each of those must still be silent (so the list shrinks as lines are added)."""
    unannounced, no_longer_silent = [], []
    waits = all_waits()
    for key, (kind, says, why) in waits.items():
        long = kind == B or (kind == SL and says not in (None, "job"))
        if not long:
            continue
        if key in KNOWN_SILENT:
            if announces(*(says if isinstance(says, tuple) else key[:2])):
                no_longer_silent.append(key)
            continue
        if not (isinstance(says, tuple) and announces(*says)):
            unannounced.append(f"{key}: {why}; says={says}")
    assert unannounced == [], "long waits without a progress line:\n" + "\n".join(unannounced)
    assert no_longer_silent == [], f"these now announce themselves: remove them from KNOWN_SILENT: {no_longer_silent}"
    assert set(KNOWN_SILENT) <= set(waits), set(KNOWN_SILENT) - set(waits)


def test_the_scan_finds_a_blocking_call_and_ignores_string_joins():
    """The scanner itself (so the tests above can fail)."""
    calls = [
        n
        for n in ast.walk(
            ast.parse("ev.wait(5)\n','.join(x)\nt.thread.join()\nd.get('k')\nq.get(timeout=1)\ntime.sleep(1)")
        )
        if isinstance(n, ast.Call)
    ]
    assert [_blocking(c) for c in calls] == ["ev.wait", None, "t.thread.join", None, "q.get", "time.sleep"]


def test_a_wait_comment_declares_the_call_under_it_and_a_stray_one_is_found():
    """The declaration reader itself (so the tests above can fail): a comment block's `# wait:`
    lines, one naming its call, the why going on over comment lines; `said by` in three forms."""
    source = [
        "# an ordinary comment",
        "# wait: slice, said by Waiter.run: slices of",
        "#   WAIT_SLICE_SECONDS",
        "# wait q.get: bounded, said by agent/x.py announce: a timeout",
        "# wait ev.wait: short, said by the job: 1 s",
        "x = ev.wait(1) or q.get(timeout=t)",
    ]
    markers = _markers("agent/m.py", _comment_block_above(source, 6))
    assert markers == [
        (2, None, (SL, ("agent/m.py", "Waiter.run"), "slices of WAIT_SLICE_SECONDS")),
        (4, "q.get", (B, ("agent/x.py", "announce"), "a timeout")),
        (5, "ev.wait", (S, "job", "1 s")),
    ]
    assert _markers("agent/m.py", _comment_block_above(["# wait: short: 1 s", "", "ev.wait(1)"], 3)) == []
