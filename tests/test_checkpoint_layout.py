"""The memory tier's save fast path (agent/checkpoint/core/layout.py): a state laid out as the last one
saved is copied tensor by tensor into the slot, and what torch.load reads back is exactly what a
full torch.save would have given. A real holder process and real slots; the copies are read back
from the holder with torch.load, as a restarted worker reads them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core import layout
from rally.agent.checkpoint.core.client import MemoryTier
from rally.agent.checkpoint.core.shm import fd_path
from rally.agent.checkpoint.tier import CheckpointTier

pytestmark = pytest.mark.torch


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[MemoryTier]:
    agent = CheckpointTier.start(str(tmp_path / "ckpt"), EventLog(tmp_path / "events.jsonl"), print)
    assert isinstance(agent, CheckpointTier)
    agent.open_round(0, None, 60.0)
    tier = MemoryTier(agent.address, 0)
    try:
        yield tier
    finally:
        tier.close()
        agent.stop()


def saved(tier: MemoryTier, step: int) -> dict:
    import torch

    found = tier.slot("whole", step)
    assert found is not None
    try:
        return torch.load(fd_path(found[0]), weights_only=True)
    finally:
        os.close(found[0])


def training_state(step: int) -> dict:
    """A model, its Adam state after ``step`` steps, shared views and plain values."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters())
    for _ in range(step):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    base = torch.arange(20.0) + step
    return {"model": model.state_dict(), "opt": opt.state_dict(), "views": [base[2:5], base], "name": "run", "lr": 0.5}


def assert_same(a: object, b: object) -> None:
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert type(a) is type(b) and a == b


@pytest.mark.timeout(120)
def test_saves_of_the_same_layout_replay_it_and_load_exactly_as_saved(worker: MemoryTier) -> None:
    for step in range(1, 5):
        state = training_state(step)
        if step > 1:  # the fast path: this state's signature is the learnt layout's
            assert layout.signature(state)[0] == worker._layouts["whole"].signature  # type: ignore[index]
        assert worker.save(state, "whole", step, persist=False, keep=3)
        assert "whole" in worker._layouts  # learnt at the first save, replayed from the second on
        back = saved(worker, step)
        assert_same(state, back)
        assert back["views"][0].untyped_storage().data_ptr() == back["views"][1].untyped_storage().data_ptr()


@pytest.mark.timeout(120)
def test_a_changed_value_or_shape_takes_torch_save_and_loads_right(worker: MemoryTier) -> None:
    import torch

    assert worker.save(training_state(1), "whole", 1, persist=False, keep=3)
    changed = training_state(2) | {"lr": 0.25}  # a scheduler changed a value: the pickle differs
    assert worker.save(changed, "whole", 2, persist=False, keep=3)
    assert_same(changed, saved(worker, 2))
    grown = changed | {"views": [torch.arange(50.0)]}
    assert worker.save(grown, "whole", 3, persist=False, keep=3)
    assert_same(grown, saved(worker, 3))


def test_states_torch_save_must_write_are_not_eligible() -> None:
    import torch

    class Opaque:
        pass

    assert layout.signature({"w": torch.zeros(3)}) is not None
    assert layout.signature({"w": torch.zeros(3), "o": Opaque()}) is None
    assert layout.signature({"w": torch.zeros(0)}) is None  # empty storage
    assert layout.signature({"w": torch.zeros(2, dtype=torch.complex64).conj()}) is None
    assert layout.signature({"w": torch.zeros(3)}) != layout.signature({"w": torch.zeros(3, dtype=torch.float64)})
    assert layout.signature({"x": 0.0})[0] != layout.signature({"x": -0.0})[0]  # type: ignore[index]
