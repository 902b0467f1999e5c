"""Specification of overlapped saves: the copy of an optimizer's tensors runs during the next step.

A real holder and real shared memory (tests/test_memory_tier.py's harness), the worker's side in
this process with a real model and a real optimizer (small tensors: each a little over
SMALL_BYTES, so it is copied in the background), or in a subprocess where the test must kill it.
Every resumed state is compared bit for bit with a clone taken when it was saved.
"""

from __future__ import annotations

import hashlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rally.agent.checkpoint.core import parallel_copy
from rally.agent.checkpoint.core.overlap import overlap
from rally.agent.checkpoint.slots import NewestBusy, SlotTable
from rally.agent.worker_side import job
from support.helpers import eventually
from test_memory_tier import LEASE, REPO, Tier, load_slot

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

WIDTH = 600  # a 600 x 600 float32 weight: 1.44 MB, over SMALL_BYTES; its bias of 2.4 KB under it


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Tier]:
    overlap.install_fence()  # what job.save and job.load_latest do under rally
    t = Tier(tmp_path, tmp_path / "ckpt")
    t.agent.open_round(0, None, LEASE)
    try:
        yield t
    finally:
        overlap.settle(raise_errors=False)
        overlap.pending = None
        t.agent.stop()


class Training:
    """A model with a buffer the forward changes (BatchNorm's running mean) and an Adam optimizer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.BatchNorm1d(WIDTH))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def forward_backward(self) -> None:
        self.model(torch.randn(8, WIDTH)).square().mean().backward()

    def step(self) -> None:
        """One training step: every parameter and every Adam moment is changed in place."""
        self.opt.zero_grad()
        self.forward_backward()
        self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        """What a script saves (the step is in Adam's state: a plain value that changes would
        change the archive's layout, and such a save is copied whole before it returns)."""
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def clone(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone(v) for v in state]
    return state.clone() if isinstance(state, torch.Tensor) else state


def bits_equal(a: Any, b: Any) -> bool:
    """Equal structure and plain values, every tensor's bytes identical."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
        )
    return bool(a == b)


def resumed(tier: Tier, step: int, r: int = 1) -> Any:
    """What a restarted worker maps from the node's memory when the round agrees on ``step``."""
    tier.agent.open_round(r, step, LEASE)
    agreed, fd = tier.worker(r).resume("whole")
    assert agreed == step and fd is not None, f"step {step} is not in memory"
    return load_slot(fd)


def saved_twice(tier: Tier, training: Training) -> tuple[Any, dict[int, Any]]:
    """A worker that saved steps 1 (learning the layout) and 2 (overlapped, published by step 3's
    fence); the clones of what it saved."""
    worker, saved = tier.worker(), {}
    for step in (1, 2):
        training.step()
        saved[step] = clone(training.state(step))
        assert worker.save(training.state(step), "whole", step, persist=False, keep=3)
    training.step()
    return worker, saved


def overlapped_third_save(tier: Tier) -> tuple[Training, dict]:
    """Steps 1 and 2 saved, then step 3 saved with its copy still running in the background:
    the training and what each step held when it was saved."""
    training = Training()
    worker, saved = saved_twice(tier, training)
    training.forward_backward()
    saved[3] = clone(training.state(3))
    assert worker.save(training.state(3), "whole", 3, persist=False, keep=3)
    assert overlap.pending is not None and overlap.pending.step == 3, "the save did not overlap"
    return training, saved


@pytest.mark.timeout(60)
def test_the_next_optimizer_step_waits_for_the_copy_and_the_resume_is_the_saved_step_bit_for_bit(tier: Tier) -> None:
    training, saved = overlapped_third_save(tier)
    assert len(overlap.pending.watched) == 3, "the weight and its two Adam moments: copied in the background"
    training.opt.step()  # at once: every parameter and moment changed in place, the fence waits first
    assert overlap.pending is None, "the optimizer stepped before the copy was settled"
    job.wait_saved()  # the commit's round trip to the holder (the copy thread's) is done
    assert tier.agent.memory_steps() == [2, 3]
    assert not bits_equal(training.state(3), saved[3]), "the optimizer changed nothing: the test proves nothing"
    assert bits_equal(resumed(tier, 3), saved[3])


@pytest.mark.timeout(60)
def test_a_save_undecided_when_its_round_ends_is_dropped_and_never_reaches_the_next_round(
    tier: Tier, capsys: pytest.CaptureFixture[str]
) -> None:
    """rally.job.run between two entries (agent/worker_side/restartable.py): step 3's save is
    copied but undecided when the agent ends round 0 (it closes the round at the holder before
    it aborts the function). The worker's teardown drops it; before, it stayed pending into round
    1, where the first optimizer step's fence committed it with round 1's number, the holder
    refused it (its slot was voided with round 0) and round 1's next save raised that refusal.
    The holder never holds step 3, and round 1 resumes from and saves after step 2."""
    from rally.agent.worker_side import restartable

    training, saved = overlapped_third_save(tier)
    worker = overlap.pending.tier
    tier.agent.close_round(0)  # the agent's round_ending, before its "abort" reaches the worker
    assert restartable.teardown() is None  # what the worker does before it says "parked"
    assert bits_equal(resumed(tier, 2), saved[2])  # round 1 opens with step 2 as its resume step
    worker.round = 1  # the "enter" of round 1 (restartable._apply)
    training.step()  # round 1's first optimizer step: its fence has nothing of round 0 to decide
    assert worker.save(training.state(4), "whole", 4, persist=False, keep=3)  # raised CheckpointRefused before
    job.wait_saved()
    assert tier.agent.memory_steps() == [2, 4], "step 3, saved in round 0, was held in round 1"
    assert "discarded" not in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_copy_split_over_helper_threads_resumes_the_saved_step_bit_for_bit(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background copy cut into parts (agent/checkpoint/core/parallel_copy.py: here every
    copy, in 3 parts where 3 CPUs are allowed), the optimizer stepping at once after the save."""
    monkeypatch.setattr(parallel_copy, "SPLIT_BYTES", 0)
    monkeypatch.setenv(parallel_copy.COPY_THREADS_ENV, "3")
    assert parallel_copy.copy_threads() >= 2, "a single CPU: nothing is split"
    training, saved = overlapped_third_save(tier)
    training.opt.step()  # every parameter and moment changed in place right after the save
    job.wait_saved()
    assert parallel_copy._helpers._started >= 1, "no helper thread copied a part"
    assert not bits_equal(training.state(3), saved[3]), "the optimizer changed nothing: the test proves nothing"
    assert bits_equal(resumed(tier, 3), saved[3])
    assert bits_equal(resumed(tier, 2, r=2), saved[2])


@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_a_copy_is_split_into_parts_of_equal_bytes_in_order() -> None:
    data = [torch.arange(n, dtype=torch.uint8) for n in (10, 1, 0, 29)]  # 40 bytes
    places = [torch.zeros(d.numel(), dtype=torch.uint8) for d in data]
    parts = parallel_copy.split(places, data, 3)
    assert [sum(t.numel() for t in part[1]) for part in parts] == [14, 14, 12]
    assert torch.cat([t for part in parts for t in part[1]]).equal(torch.cat(data))
    for dst, src in parts:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    assert all(p.equal(d) for p, d in zip(places, data, strict=True)), "a part's place is not its data's"


@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_a_split_copy_returns_only_once_every_part_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calling thread's part done first must not let the copy return: the save would be
    committed (and the optimizer step) while a helper still copies."""
    monkeypatch.setattr(parallel_copy, "SPLIT_BYTES", 0)
    monkeypatch.setenv(parallel_copy.COPY_THREADS_ENV, "2")
    calling, copy_tensors = threading.get_ident(), parallel_copy.torch_internals.copy_tensors

    def helpers_slow(places: list[Any], data: list[Any]) -> None:
        if threading.get_ident() != calling:
            time.sleep(0.2)
        copy_tensors(places, data)

    monkeypatch.setattr(parallel_copy.torch_internals, "copy_tensors", helpers_slow)
    data = [torch.arange(1000, dtype=torch.uint8)]
    place = torch.zeros(1000, dtype=torch.uint8)
    parallel_copy.copy([place], data)
    assert place.equal(data[0]), "copy returned before a helper's part was copied"


@pytest.mark.same_under_load
@pytest.mark.timeout(20)
def test_a_forked_child_copies_on_helper_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork (a DataLoader's worker) keeps none of the parent's helper threads, and a lock the
    parent held at that moment: the child's copy must neither hang nor hand its parts to nobody."""
    monkeypatch.setattr(parallel_copy, "SPLIT_BYTES", 0)
    monkeypatch.setenv(parallel_copy.COPY_THREADS_ENV, "2")
    data = [torch.arange(1000, dtype=torch.uint8)]
    parallel_copy.copy([torch.zeros(1000, dtype=torch.uint8)], data)  # the parent's helpers run
    with parallel_copy._helpers._lock:  # held by another thread of the parent at the fork
        pid = os.fork()
        if pid == 0:
            place = torch.zeros(1000, dtype=torch.uint8)
            parallel_copy.copy([place], data)
            os._exit(0 if place.equal(data[0]) else 3)
    pidfd = os.pidfd_open(pid)
    try:
        finished = select.select([pidfd], [], [], 10)[0]
    finally:
        os.close(pidfd)
    if not finished:
        os.kill(pid, signal.SIGKILL)  # hung on the parent's lock: ended here, by its pid
    _, status = os.waitpid(pid, 0)
    assert finished, "the forked child's copy hung"
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.timeout(60)
def test_a_first_save_through_torch_save_overlaps_the_next_step_too(tier: Tier) -> None:
    """A restarted worker's first save learns the archive's layout through torch.save: its
    optimizer's tensors are still left to the copy thread."""
    training = Training()
    training.step()
    saved = clone(training.state(1))
    assert tier.worker().save(training.state(1), "whole", 1, persist=False, keep=3)
    assert overlap.pending is not None and overlap.pending.step == 1, "the first save did not overlap"
    training.step()
    job.wait_saved()
    assert tier.agent.memory_steps() == [1]
    assert bits_equal(resumed(tier, 1), saved)


@pytest.mark.timeout(60)
def test_an_in_place_change_outside_an_optimizer_discards_that_step_and_the_previous_one_resumes(
    tier: Tier, capsys: pytest.CaptureFixture[str]
) -> None:
    training = Training()
    worker, saved = saved_twice(tier, training)
    job.wait_saved()
    assert tier.agent.memory_steps() == [1, 2]
    assert worker.save(training.state(3), "whole", 3, persist=False, keep=3)
    with torch.no_grad():
        for p in training.model.parameters():
            p.mul_(0.5)  # a manual update, without job.wait_saved() first
    job.wait_saved()
    assert tier.agent.memory_steps() == [2], "a snapshot taken while its tensors changed was published"
    line = capsys.readouterr().err
    assert "checkpoint step 3 was discarded" in line and "'model'/'0.weight'" in line
    assert "rally.job.wait_saved()" in line and line.count("\n") == 1
    assert bits_equal(resumed(tier, 2), saved[2])


@pytest.mark.timeout(60)
def test_wait_saved_before_an_in_place_change_keeps_the_step(tier: Tier) -> None:
    training = Training()
    worker, _ = saved_twice(tier, training)
    saved = clone(training.state(3))
    assert worker.save(training.state(3), "whole", 3, persist=False, keep=3)
    job.wait_saved()
    with torch.no_grad():
        for p in training.model.parameters():
            p.mul_(0.5)
    assert tier.agent.memory_steps() == [2, 3]
    assert bits_equal(resumed(tier, 3), saved)


@pytest.mark.timeout(60)
def test_buffers_the_forward_changes_are_copied_before_save_returns(tier: Tier) -> None:
    training = Training()
    worker, _ = saved_twice(tier, training)
    saved = clone(training.state(3))
    assert worker.save(training.state(3), "whole", 3, persist=False, keep=3)
    training.step()  # the forward changes BatchNorm's running statistics in place, then the optimizer steps
    job.wait_saved()
    assert tier.agent.memory_steps() == [2, 3]
    assert bits_equal(resumed(tier, 3), saved)


@pytest.mark.timeout(60)
def test_without_overlap_every_save_copies_before_it_returns(tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLY_CKPT_OVERLAP", "0")
    training = Training()
    worker, _ = saved_twice(tier, training)
    assert worker.save(training.state(3), "whole", 3, persist=False, keep=3)
    assert overlap.pending is None and tier.agent.memory_steps() == [2, 3]


def test_a_copied_slot_no_longer_pauses_the_persister_but_is_not_readable_till_committed() -> None:
    table = SlotTable(os.urandom(8).hex())
    table.open_round(0, None, LEASE)
    try:
        table.reserve(1, "whole", 1, 4096, 0, None, 3)
        assert table.copying()
        table.copied(1, "whole", 1)
        assert not table.copying() and table.memory_steps() == []
        table.commit(1, "whole", 1, 100, 0)
        assert table.memory_steps() == [1]
    finally:
        table.release()


def test_an_overlapped_save_skips_rather_than_write_over_the_newest_step_while_the_other_persists() -> None:
    """Its slot stays written for a whole step: a worker killed then must still find the newest step."""
    table = SlotTable(os.urandom(8).hex())
    table.open_round(0, None, LEASE)
    try:
        table.reserve(1, "whole", 1, 4096, 0, "step_1.pt", 3)
        table.commit(1, "whole", 1, 100, 0)
        table.next_to_persist()  # the persister copies step 1 ...
        table.reserve(1, "whole", 2, 4096, 0, "step_2.pt", 3, spare_newest=True)  # ... 2 takes the other slot
        table.commit(1, "whole", 2, 100, 0)
        with pytest.raises(NewestBusy):  # the only free slot now holds the newest step
            table.reserve(1, "whole", 3, 4096, 0, "step_3.pt", 3, spare_newest=True)
        assert table.memory_steps() == [1, 2]
        table.reserve(1, "whole", 3, 4096, 0, "step_3.pt", 3)  # a synchronous save still may
    finally:
        table.release()


KILLED_DURING_THE_COPY = """
    import hashlib, os, signal, time, torch
    from rally import job
    from rally.agent.checkpoint.core.overlap import overlap

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4_000_000)) for _ in range(4)]  # 64 MB: a copy of milliseconds
    opt = torch.optim.SGD(params, lr=0.1)
    job.load_latest()  # installs the fence, as a script's start does

    def step(n):
        for p in params:
            p.grad = torch.full_like(p, float(n))
        opt.step()
        return {"params": [p.detach() for p in params]}

    for n in (1, 2):
        job.save(step(n), n)
        print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest(), flush=True)
    state = step(3)  # its optimizer step publishes step 2 first (the fence)
    while 2 not in job.durable_steps():  # the persister idle: step 3 takes step 1's slot, not step 2's
        time.sleep(0.01)
    job.save(state, 3)
    pending = overlap.pending
    print("in flight" if pending is not None and pending.step == 3 and not pending.copied.is_set() else "copied",
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(120)
def test_a_worker_killed_during_a_background_copy_leaves_no_half_written_checkpoint(tier: Tier) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env |= {**tier.agent.env(), "RALLY_ROUND": "0", job.CHECKPOINT_DIR_ENV: str(tier.checkpoint_dir)}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_DURING_THE_COPY)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=100, start_new_session=True,
    )  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stderr
    _, digest2, where = run.stdout.splitlines()
    assert where == "in flight", "killed after the copy ended: the test proves less than it says"
    assert eventually(lambda: tier.agent.memory_steps()[-1:] == [2], 10), f"step 3 published? {run.stderr}"
    assert tier.agent.flush(30)
    assert job.durable_steps(tier.checkpoint_dir)[-1:] == [2], "step 3, killed mid-copy, must never be on disk"
    state = resumed(tier, 2)
    assert hashlib.sha256(b"".join(p.numpy().tobytes() for p in state["params"])).hexdigest() == digest2
