"""A restart's first saves find their slot memory ready: made by the holder in the background,
mapped by the worker before it saves, or not needed at all when the writer let its copy go.

The table's rules run on a real `SlotTable` (real memfds); the worker's side on a real holder
process (`HolderProcess`, as the agent starts it) and `MemoryTier`, as `rally.job` uses it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core.client import MemoryTier
from rally.agent.checkpoint.core.shm import SlotMaps
from rally.agent.checkpoint.node_checkpoints import HolderProcess
from rally.agent.checkpoint.slots import SlotTable
from support.helpers import eventually

LEASE = 60.0
SIZE = 64 << 10
WHOLE = "whole"


def inode(fd: int) -> int:
    return os.fstat(fd).st_ino


@pytest.fixture
def table() -> Iterator[SlotTable]:
    t = SlotTable(os.urandom(8).hex())
    t.open_round(0, None, LEASE)
    try:
        yield t
    finally:
        t.release()


def save(table: SlotTable, step: int, round_no: int = 0, conn: int = 1, key: str = WHOLE) -> tuple[int, int]:
    """A committed save of `step`: (slot index, the slot memfd's inode)."""
    index, fd = table.reserve(conn, key, step, SIZE, round_no, None, 3)
    table.commit(conn, key, step, SIZE // 2, round_no)
    return index, inode(fd)


def test_a_copy_a_round_end_voided_is_written_again_once_its_writer_says_the_copy_ended(table: SlotTable) -> None:
    """rally.job.run's survivor aborts its overlapped copy once the copy has ended: the slot keeps
    its memory, which the worker has mapped already. A plain abort (a thread interrupted while
    others may still copy) or another connection's frees nothing: the next save gets a fresh memfd."""
    save(table, 1)
    index, fd = table.reserve(1, WHOLE, 2, SIZE, 0, None, 3)  # an overlapped copy under way ...
    voided = inode(fd)
    table.close_round(0)  # ... when the round ends
    table.abort(2, WHOLE, 2, ended=True)  # not its writer
    table.abort(1, WHOLE, 2)  # its writer, not saying the copy ended
    table.open_round(1, 1, LEASE)
    again, fd = table.reserve(1, WHOLE, 2, SIZE, 1, None, 3)
    assert again == index and inode(fd) != voided
    table.commit(1, WHOLE, 2, SIZE // 2, 1)

    index, fd = table.reserve(1, WHOLE, 3, SIZE, 1, None, 3)
    voided = inode(fd)
    table.close_round(1)
    table.abort(1, WHOLE, 3, ended=True)  # the survivor's copy thread, its copy over
    table.open_round(2, 2, LEASE)
    again, fd = table.reserve(1, WHOLE, 3, SIZE, 2, None, 3)
    assert again == index and inode(fd) == voided


def test_the_slot_every_rank_reloads_has_fresh_memory_made_before_the_save_that_needs_it(table: SlotTable) -> None:
    """Reloaded, a slot is never written again. Its fresh memfd is made once the round ends (the
    newest step of `whole` is the likely resume step), handed out by `next_slots` for the worker
    to map, and taken by the save that lands on that slot."""
    save(table, 1)
    reloaded, _ = save(table, 2)
    table.close_round(0)
    made = eventually(lambda: table.fresh.ready_fd((WHOLE, reloaded)), timeout=10)
    assert made is not None, "no fresh memory made for the slot the round's resume reloads"
    table.open_round(1, 2, LEASE)
    step, index, _ = table.resume(WHOLE)
    assert (step, index) == (2, reloaded)
    assert (reloaded, made) in table.next_slots(WHOLE)
    other, _ = save(table, 3, round_no=1)  # the other slot, written in place
    assert other != reloaded
    index, fd = table.reserve(1, WHOLE, 4, SIZE, 1, None, 3)
    assert index == reloaded and fd == made


def test_memory_made_ahead_gives_way_to_a_copy_that_needs_the_room() -> None:
    """Made ahead, memory counts as the holder's; a real copy that finds no room otherwise has it
    given back rather than going to disk."""
    table = SlotTable(os.urandom(8).hex(), memory_limit=3 * SIZE)
    table.open_round(0, None, LEASE)
    try:
        save(table, 1)
        reloaded, _ = save(table, 2)
        table.close_round(0)
        assert eventually(lambda: table.fresh.ready_fd((WHOLE, reloaded)), timeout=10) is not None
        table.open_round(1, 2, LEASE)
        assert table.fresh.held() == SIZE
        table.reserve(2, "other", 1, SIZE, 1, None, 3)  # 3 x SIZE held already: only with the made memory given back
        assert table.fresh.held() == 0 and table.disk_only is None
    finally:
        table.release()


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_worker_maps_its_next_slots_before_it_saves(tmp_path: Path) -> None:
    """`premap` (the resume prefetch's, after the reload is prepared) maps the memfd the next save
    will write into: that save finds its mapping made, faulted in already."""
    agent = HolderProcess.start(str(tmp_path / "ckpt"), EventLog(tmp_path / "events.jsonl"), print)
    assert isinstance(agent, HolderProcess)
    try:
        agent.open_round(0, None, LEASE)
        worker = MemoryTier(agent.address, 0)
        import torch

        state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
        for step in (1, 2):
            assert worker.save(state, WHOLE, step, persist=False, keep=3)
        agent.close_round(0)
        agent.open_round(1, 2, LEASE)
        worker.round = 1
        step, fd = worker.resume(WHOLE)  # the reload: slot of step 2, never written again
        assert step == 2 and fd is not None
        os.close(fd)
        worker.premap(WHOLE)
        premapped = dict(worker.maps._maps)
        assert worker.save(state, WHOLE, 3, persist=False, keep=3)  # the other slot
        assert worker.save(state, WHOLE, 4, persist=False, keep=3)  # the reloaded one's fresh memfd
        assert any(worker.maps._maps[slot][1] is mapped for slot, (_, mapped) in premapped.items())
        assert {slot: m for slot, (_, m) in worker.maps._maps.items()} == {s: m for s, (_, m) in premapped.items()}
    finally:
        agent.stop()


def test_a_slots_mapping_is_faulted_in_at_once() -> None:
    """Every page mapped when the mapping is made (MADV_POPULATE_WRITE in chunks, the GIL let go),
    not one fault at a time inside the save's copy."""
    fd = os.memfd_create("rally-test-slot")
    os.posix_fallocate(fd, 0, 8 * SIZE)
    ident = str(inode(fd))
    mapped = SlotMaps().mapping("k.0", fd)
    rss, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = "rally-test-slot" in line and fields[4] == ident
        elif inside and line.startswith("Rss:"):
            rss = int(fields[1])
    assert rss == 8 * SIZE // 1024
    mapped.close()
