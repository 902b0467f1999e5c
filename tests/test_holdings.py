"""rally's share of a restart: what the agent reads on the way to the next round.

The newest checkpoint on disk after a failure is always one the agent has not checked yet (its
holder wrote it during the failed round), and checking it reads all of it (a CRC: ~0.5 s for a
400 MB state). A one-node job's round cannot resume from a file no newer than the newest step
in its memory, so those files are not read (agent/checkpoint/holdings.py). bench/goodput.py shows
the restart's phases; these tests pin what the descriptor says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rally.agent.checkpoint.checkpoint_dir import newest_checkpoint_step
from rally.agent.checkpoint.core import checkpoint_file


def _write(directory: Path, step: int, damaged: bool = False) -> Path:
    """A checkpoint file as rally writes it (payload, then the footer with its length, step, CRC
    and MAC); `damaged` flips a payload bit after the footer was made."""
    payload = f"the state of step {step}".encode() * 100
    sums = checkpoint_file.Sums(step)
    sums.update(payload)
    footer = sums.footer()
    if damaged:
        payload = payload[:-1] + bytes([payload[-1] ^ 1])
    path = directory / f"step_{step:012d}.pt"
    path.write_bytes(payload + footer)
    return path


def _read(path: Path) -> bool:
    """Whether this version of `path` was read (checked) in this process."""
    return any(key[0] == str(path) for key in checkpoint_file._verdicts)


# A file read or not read: no CPU load changes which.
@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_only_files_newer_than_the_memory_are_read(tmp_path: Path) -> None:
    old, held, newer = _write(tmp_path, 3), _write(tmp_path, 5), _write(tmp_path, 7, damaged=True)
    assert newest_checkpoint_step(tmp_path, above=5) is None  # step 7 is damaged; 3 and 5 not looked at
    assert _read(newer) and not _read(held) and not _read(old)
    assert newest_checkpoint_step(tmp_path, above=4) == 5  # a file newer than the memory counts
    assert not _read(old)
    assert newest_checkpoint_step(tmp_path) == 5  # without `above`, as before: the newest intact


@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_sharded_steps_count_alike(tmp_path: Path) -> None:
    (tmp_path / "step_000000000009.dcp").mkdir()  # published without its files: damaged
    _write(tmp_path, 4)
    assert newest_checkpoint_step(tmp_path, above=4) is None
    assert newest_checkpoint_step(tmp_path, above=3) == 4
    assert newest_checkpoint_step(tmp_path / "missing", above=3) is None


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_one_node_descriptor_does_not_read_the_file_its_memory_holds(tmp_path: Path) -> None:
    """A real holder (as the agent starts it) holds step 2 in memory and made it durable on disk:
    one node's descriptor says so without reading the file; with more nodes the file is checked."""
    import torch

    from rally.agent.base.event_log import EventLog
    from rally.agent.checkpoint.core.client import HolderAddress, MemoryTier
    from rally.agent.checkpoint.holdings import RoundHoldings
    from rally.agent.checkpoint.node_checkpoints import NodeCheckpoints

    directory = tmp_path / "ckpt"
    ckpt = NodeCheckpoints(str(directory), EventLog(tmp_path / "events.jsonl"), warn=print)
    assert ckpt.holder is not None
    try:
        ckpt.holder.open_round(0, None, 60.0)
        address = HolderAddress.from_env(ckpt.env())
        assert address is not None
        worker = MemoryTier(address, 0)
        for step in (1, 2):
            assert worker.save({"w": torch.full((1000,), float(step))}, "whole", step, persist=True, keep=3)
            assert ckpt.holder.flush(30)
        newest = directory / "step_000000000002.pt"
        assert newest.exists()

        one = RoundHoldings(ckpt, single_node=True)
        memory, durable = one.holdings()
        assert max(memory) == 2 and durable is None and one.progress() == 2
        assert not _read(newest)  # the restart's critical path did not read it

        many = RoundHoldings(ckpt, single_node=False)
        assert many.holdings() == (memory, 2) and many.progress() == 2
        assert _read(newest)  # another node may not hold step 2 in memory: the disk counts
    finally:
        ckpt.holder.stop()
