"""A restart's first saves find their slot memory ready: made by the holder in the background,
mapped by the worker before it saves, or not needed at all when the writer let its copy go.

The table's rules run on a real `SlotTable` (real memfds); the worker's side on a real holder
process (`HolderProcess`, as the agent starts it) and `MemoryTier`, as `rally.job` uses it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core.client import MemoryTier
from rally.agent.checkpoint.core.overlap import SaveSkipped
from rally.agent.checkpoint.core.shm import SlotMaps
from rally.agent.checkpoint.node_checkpoints import HolderProcess
from rally.agent.checkpoint.slots import NewestBusy, SlotTable
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


def test_the_slot_every_rank_reloads_has_fresh_memory_made_once_training_is_back(table: SlotTable) -> None:
    """Reloaded, a slot is never written again. Its fresh memfd is not made while the workers
    restart (the node's cores are theirs) but from the round's first save on, handed out by
    `next_slots` for the worker to map, and taken by the save that lands on that slot."""
    save(table, 1)
    reloaded, _ = save(table, 2)
    table.close_round(0)
    table.open_round(1, 2, LEASE)
    step, index, _ = table.resume(WHOLE)
    assert (step, index) == (2, reloaded)
    assert table.fresh.held() == 0, "fresh memory made during the restart"
    other, _ = save(table, 3, round_no=1)  # the other slot, written in place; training is back
    assert other != reloaded
    made = eventually(lambda: table.fresh.ready_fd((WHOLE, reloaded)), timeout=10)
    assert made is not None, "no fresh memory made for the reloaded slot"
    assert (reloaded, made) in table.next_slots(WHOLE)
    index, fd = table.reserve(1, WHOLE, 4, SIZE, 1, None, 3)
    assert index == reloaded and fd == made


def test_an_overlapped_save_on_a_slot_whose_memory_is_being_made_is_skipped_not_stalled(table: SlotTable) -> None:
    """The newest step stays; the next save tries again. A synchronous save waits for the memory."""
    save(table, 1)
    reloaded, _ = save(table, 2)
    table.close_round(0)
    table.open_round(1, 2, LEASE)
    table.resume(WHOLE)
    with table.cond:  # the allocator thread needs the table's lock to finish: it is held here
        save(table, 3, round_no=1)
        with pytest.raises(NewestBusy, match="still being made"):
            table.reserve(1, WHOLE, 4, SIZE, 1, None, 3, spare_newest=True)
    assert table.memory_steps() == [2, 3]
    index, _ = table.reserve(1, WHOLE, 4, SIZE, 1, None, 3)
    assert index == reloaded


def test_memory_made_ahead_gives_way_to_a_copy_that_needs_the_room() -> None:
    """Made ahead, memory counts as the holder's; a real copy that finds no room otherwise has it
    given back rather than going to disk."""
    table = SlotTable(os.urandom(8).hex(), memory_limit=3 * SIZE)
    table.open_round(0, None, LEASE)
    try:
        save(table, 1)
        reloaded, _ = save(table, 2)
        table.close_round(0)
        table.open_round(1, 2, LEASE)
        table.resume(WHOLE)
        save(table, 3, round_no=1)
        assert eventually(lambda: table.fresh.ready_fd((WHOLE, reloaded)), timeout=10) is not None
        assert table.fresh.held() == SIZE
        table.reserve(2, "other", 1, SIZE, 1, None, 3)  # 3 x SIZE held already: only with the made memory given back
        assert table.fresh.held() == 0 and table.disk_only is None
    finally:
        table.release()


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_worker_maps_its_next_slots_before_it_saves(tmp_path: Path) -> None:
    """A restarted worker maps the memfd its saves will write into on a thread of its own, from the
    round's first save on (the resume prefetch asks for it): the save that lands on the reloaded
    slot finds its mapping made, faulted in already."""
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
        worker.premap_wanted.add(WHOLE)  # as the resume prefetch asks
        assert worker.save(state, WHOLE, 3, persist=False, keep=3)  # the other slot; starts the premap
        assert worker.premapping is not None and worker.premapping.join(30) is None
        premapped = {slot: mapped for slot, (_, mapped) in worker.maps._maps.items()}
        assert worker.save(state, WHOLE, 4, persist=False, keep=3)  # the reloaded one's fresh memfd
        assert worker.held(WHOLE).get(WHOLE) == [3, 4]
        assert {slot: mapped for slot, (_, mapped) in worker.maps._maps.items()} == premapped
    finally:
        agent.stop()


@pytest.mark.timeout(60)
def test_an_overlapped_save_is_skipped_while_a_restarts_premap_still_maps_its_slot(tmp_path: Path) -> None:
    """After a restart, an overlapped save (the copy thread's reserve, `spare_newest`) whose slot
    the premap thread is still mapping is skipped and its reservation let go, not stalled behind
    that mapping; once the premap is over, the same save is made. Not after a key's first save,
    whose premap maps the other slot for the first time: there the next save waits for it."""
    agent = HolderProcess.start(str(tmp_path / "ckpt"), EventLog(tmp_path / "events.jsonl"), print)
    assert isinstance(agent, HolderProcess)
    try:
        agent.open_round(0, None, LEASE)
        worker = MemoryTier(agent.address, 0)
        assert worker.reserve(WHOLE, 1, SIZE, False, 3) is not None  # the key's first save: a premap starts
        worker.commit(WHOLE, 1, SIZE // 2)
        waited: list[object] = []
        with worker.maps._lock:  # that premap's mapping, still under way
            second = threading.Thread(
                target=lambda: waited.append(worker.reserve(WHOLE, 2, SIZE, False, 3, spare_newest=True)), daemon=True
            )
            second.start()
            second.join(0.5)
            assert second.is_alive(), f"the key's second save did not wait for its slot's first mapping: {waited}"
        second.join(10)
        assert len(waited) == 1 and waited[0] is not None, waited
        worker.commit(WHOLE, 2, SIZE // 2)
        assert worker.premapping is not None and worker.premapping.join(30) is None
        agent.close_round(0)
        agent.open_round(1, 2, LEASE)
        worker.round = 1
        step, fd = worker.resume(WHOLE)
        assert step == 2 and fd is not None
        os.close(fd)
        worker.premap_wanted.add(WHOLE)  # as the resume prefetch asks
        outcome: list[object] = []

        def overlapped_save() -> None:
            try:
                outcome.append(worker.reserve(WHOLE, 3, SIZE, False, 3, spare_newest=True))
            except SaveSkipped as exc:
                outcome.append(exc)

        with worker.maps._lock:  # a mapping under way (the premap's, as it maps the reloaded slot's fresh memfd)
            copy = threading.Thread(target=overlapped_save, daemon=True)
            copy.start()
            copy.join(10)
            assert not copy.is_alive(), "the overlapped save waited for the premap's mapping"
            assert worker.premapping is not None and worker.premapping.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], SaveSkipped), outcome
        assert worker.premapping.join(30) is None and not worker.premapping.is_alive()
        target = worker.reserve(WHOLE, 3, SIZE, False, 3, spare_newest=True)  # the reservation was let go
        assert target is not None
        worker.commit(WHOLE, 3, SIZE // 2)
        assert worker.held(WHOLE).get(WHOLE) == [2, 3]
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


def test_memory_made_ahead_never_takes_the_room_of_the_save_that_asked_for_it() -> None:
    """A key's first save makes the other slot in the background, but only once its own copy has
    its memory: a node with room for one copy keeps that copy in memory, as before."""
    table = SlotTable(os.urandom(8).hex(), memory_limit=SIZE)
    table.open_round(0, None, LEASE)
    try:
        save(table, 1)
        assert table.disk_only is None and table.memory_steps() == [1]
        assert table.fresh.held() == 0  # no room for the other slot: not made
    finally:
        table.release()
