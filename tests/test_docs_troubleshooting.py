"""Every one-line error rally prints that a user can meet is on docs/troubleshooting.md,
so the page cannot fall behind the code.

The errors are found in the code itself: every call that turns text into an error a user sees
(`ConfigError(...)`, `console.error(...)`, `AgentExit(...)`, `click.UsageError(...)`, the store,
rendezvous, token and checkpoint errors, ... : USER_FACING), read with `ast`. A message is its
text with each placeholder as `{}`; it is on the page when its longest fixed part (KEY_MIN
characters or more) is, word for word. A call that only passes on text made elsewhere
(`console.error(str(exc))`: its fixed parts are shorter than KEY_MIN) is checked where that text
is made. What a user cannot meet is in EXEMPT, with the reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.helpers import run_rally

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "troubleshooting.md"
PACKAGES = ("launcher", "agent", "rendezvous")
USER_FACING = {
    # bad input and the commands
    "ConfigError", "UsageError", "BadParameter", "ClickException", "plain_error",
    # the agent's own lines and exits
    "AgentExit", "error",  # `error` only as console.error
    # the store, the rendezvous, tokens, etcd
    "RendezvousError", "JobClosed", "EndpointError", "TokenError", "EtcdError", "StoreError", "StoreSilent",
    "StoreTimeout", "StoreUnavailable", "UntrustedValue", "StoreTampered",
    # the Python API and rally.job in a training script
    "LaunchError", "CheckpointDirNotSet", "CheckpointRefused",
}  # fmt: skip
KEY_MIN = 16
# Messages a user cannot meet as a line of their own, by file and a part of the message.
EXEMPT = {
    ("agent/checkpoint/sharded/flush.py", "no checkpoint holder in the environment"): (
        "the sharded flush runs only in a worker that rally started with a holder; job.save checks first"
    ),
}


@dataclass(frozen=True)
class Message:
    path: str
    line: int
    kind: str
    text: str  # placeholders as {}

    @property
    def key(self) -> str:
        """Its longest fixed part: what the page must hold."""
        return max((part.strip() for part in self.text.split("{}")), key=len)


def _text(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)  # type: ignore[misc]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("clash_line",):
        return "{}"
    return "{}"


def messages() -> list[Message]:
    """Every user-facing error message made in rally's code."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if name not in USER_FACING:
                    continue
                if name == "error" and not (isinstance(func, ast.Attribute) and ast.unparse(func.value) == "console"):
                    continue
                text = max((_text(arg) for arg in node.args), key=len)
                found.append(Message(str(path.relative_to(REPO)), node.lineno, name, text))
    return found


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def exempt(message: Message) -> str | None:
    return next((why for (path, part), why in EXEMPT.items() if path == message.path and part in message.text), None)


@pytest.mark.timeout(60)
def test_every_error_a_user_can_meet_is_on_the_troubleshooting_page() -> None:
    page = _flat(PAGE.read_text())
    missing = [
        f"{m.path}:{m.line} ({m.kind}): {m.text}"
        for m in messages()
        if len(m.key) >= KEY_MIN and not exempt(m) and _flat(m.key) not in page
    ]
    assert not missing, (
        f"{len(missing)} error messages are not on docs/troubleshooting.md (add an entry with the line, "
        "its cause and the fix, or an EXEMPT item with the reason):\n" + "\n".join(missing)
    )


@pytest.mark.timeout(60)
def test_the_search_finds_the_errors_it_must() -> None:
    """The extraction is not vacuous: it finds errors of every kind, in every package."""
    found = messages()
    texts = [m.text for m in found]
    assert len(found) > 150
    assert {m.path.split("/")[0] for m in found} == set(PACKAGES)
    assert any(t.startswith("job failed: no restarts left") for t in texts)  # console.error
    assert any("training script '{}' does not exist" in t for t in texts)  # ConfigError
    assert any("rendezvous timed out after" in t for t in texts)  # RendezvousError
    for (path, part), _why in EXEMPT.items():
        assert any(m.path == path and part in m.text for m in found), f"EXEMPT names a message that is gone: {part}"


@pytest.mark.timeout(30)
def test_every_entry_has_an_anchor_and_the_index_links_them() -> None:
    text = PAGE.read_text()
    headings = re.findall(r"^### (.+)$", text, re.M)
    assert headings
    no_anchor = [h for h in headings if not re.search(r"\{#[a-z0-9-]+\}\s*$", h)]
    assert not no_anchor, f"entries without an explicit {{#anchor}}: {no_anchor}"
    anchors = {re.search(r"\{#([a-z0-9-]+)\}", h).group(1) for h in headings}  # type: ignore[union-attr]
    index = text.split("\n## ", 1)[0]
    unlinked = sorted(a for a in anchors if f"(#{a})" not in index)
    assert not unlinked, f"entries the index at the top does not link: {unlinked}"


@pytest.mark.timeout(60)
def test_rally_help_points_at_the_page() -> None:
    """`rally --help` names the page, which exists: an error's next stop is one command away."""
    done = run_rally(["--help"], cwd=REPO, timeout=50)  # the one way a test starts rally (tests/test_layout.py)
    assert done.returncode == 0, done.describe()
    assert "docs/troubleshooting.md" in done.stdout
    assert PAGE.exists()
