"""The agent's one checkpoint object (agent/checkpoint/node_checkpoints.py): its docstring's call order
is the one agent/agent.py makes, and a node without a memory tier is a state of it (no holder), in
which every call does nothing. Cheap: no torch, no round; the holder's own behaviour is tested with
a real holder in tests/test_memory_tier.py, test_checkpoint_fencing.py and test_restart_share.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rally.agent.base.collaborator import Collaborator
from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint import node_checkpoints
from rally.agent.checkpoint.node_checkpoints import MEMORY_TIER_ENV, NodeCheckpoints

REPO = Path(__file__).resolve().parents[1]


def calls_of(path: Path, holder: str) -> set[str]:
    """The attributes of the checkpoint object that ``path`` uses (``self.ckpt.env()`` -> env)."""
    return set(re.findall(rf"{re.escape(holder)}\.(\w+)", path.read_text()))


@pytest.mark.timeout(30)
def test_the_docstring_names_every_call_the_agent_makes_and_no_other() -> None:
    documented = set(re.findall(r"^\s+ckpt\.(\w+)", node_checkpoints.__doc__ or "", re.M))
    made = calls_of(REPO / "agent/checkpoint/holdings.py", "self.ckpt")
    made.discard("checkpoint_dir")  # an attribute RoundHoldings reads, not a call
    hooks = {name for name in vars(Collaborator) if not name.startswith("_") and name in vars(NodeCheckpoints)}
    registered = re.search(r"self\.collaborators: [^=]*= \[(.*?)\]", (REPO / "agent/agent.py").read_text(), re.S)
    assert registered is not None and "NodeCheckpoints.for_agent(self)" in registered[1]  # its hooks are called
    assert made | hooks == documented


@pytest.mark.timeout(30)
def test_without_a_memory_tier_there_is_no_holder_and_every_call_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MEMORY_TIER_ENV, "0")
    lines: list[str] = []
    ckpt = NodeCheckpoints(str(tmp_path / "ckpt"), EventLog(tmp_path / "events.jsonl"), warn=lines.append)
    assert ckpt.holder is None and ckpt.pid is None
    assert ckpt.env() == {}  # the workers save to disk
    assert ckpt.memory_steps() == []
    assert ckpt.status_fields() == {}
    assert ckpt.exit() is None  # nothing in memory could have died with a holder
    assert lines == []
