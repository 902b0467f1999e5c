"""Specification of the memory tier: a real holder process, real shared memory, real files.

The agent's side (`HolderProcess`) starts the holder as rally's agent does; the worker's side
(`MemoryTier`, what `rally.job` uses) runs in this test process, or in a subprocess where the
test must kill it. Nothing is mocked: the slots are memfds passed over the holder's socket, the
durable checkpoints files on disk (a small tmpfs of the test's own where the disk must be full).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core import checkpoint_file
from rally.agent.checkpoint.core import client as ckpt_client
from rally.agent.checkpoint.core.client import CheckpointRefused, MemoryTier
from rally.agent.checkpoint.core.shm import fd_path, holders_of
from rally.agent.checkpoint.holder import DEFAULT_PERSIST_SHARE, PERSIST_SHARE_ENV
from rally.agent.checkpoint.node_checkpoints import MEMORY_LIMIT_ENV, HolderProcess
from rally.agent.checkpoint.slots import COMMITTED, SlotTable
from rally.agent.worker_side import job
from rally.rendezvous.base.membership import resume_step
from rally.rendezvous.base.records import NodeInfo
from support.helpers import eventually, stop_every_thread
from support.helpers import small_disk as mount_small_disk

REPO = Path(__file__).resolve().parents[1]
LEASE = 60.0


class Tier:
    """A running holder, its agent-side client, the lines it warned, and a worker-side client."""

    def __init__(self, tmp: Path, checkpoint_dir: Path) -> None:
        self.warnings: list[str] = []
        self.checkpoint_dir = checkpoint_dir
        self.events = tmp / "events.jsonl"
        self.agent = HolderProcess.start(str(checkpoint_dir), EventLog(self.events), self.warnings.append)
        assert isinstance(self.agent, HolderProcess)
        self.holder = self.agent.address

    def worker(self, r: int = 0) -> MemoryTier:
        return MemoryTier(self.holder, r)

    def copies(self, key: str = "whole") -> int:
        """How many distinct memfds (copies) of ``key`` the holder process holds (the persister's
        mapping holds a second descriptor of the one it reads)."""
        return len(memfd_inodes(self.agent.pid, f"-{key}."))


def memfd_inodes(pid: int, needle: str) -> set[int]:
    """The inodes of the memfds ``pid`` holds whose name contains ``needle`` (each copy once)."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if needle in os.readlink(fd):
                found.add(os.stat(fd).st_ino)
        except OSError:
            continue  # closed meanwhile
    return found


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Tier]:
    t = Tier(tmp_path, tmp_path / "ckpt")
    t.agent.open_round(0, None, LEASE)
    try:
        yield t
    finally:
        t.agent.stop()


def state(step: int, n: int = 100_000) -> dict:
    import torch

    return {"model": {"w": torch.full((n,), float(step)), "b": torch.arange(10.0) + step}, "step": step}


def same(a: dict, b: dict) -> bool:
    import torch

    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def load_slot(fd: int | None) -> dict:
    import torch

    assert fd is not None
    try:
        return torch.load(fd_path(fd), mmap=True, weights_only=True)
    finally:
        os.close(fd)


# --- save, persist, reload -------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_save_returns_with_the_state_in_memory_and_the_holder_makes_it_durable(tier: Tier) -> None:
    worker = tier.worker()
    assert worker.save(state(1), "whole", 1, persist=True, keep=3)
    assert tier.agent.flush(30)
    path = tier.checkpoint_dir / "step_000000000001.pt"
    with checkpoint_file.open_verified(path) as f:  # rally's format: footer, CRC, torch.load-able
        import torch

        assert same(torch.load(f, weights_only=True), state(1))
    assert job.durable_steps(tier.checkpoint_dir) == [1]
    assert eventually(lambda: tier.agent.last_saved == 1 and tier.agent.last_durable == 1, 10)
    events = tier.events.read_text()
    assert '"event": "checkpoint_saved"' in events and '"event": "checkpoint_durable"' in events


@pytest.mark.torch
@pytest.mark.timeout(30)
def test_a_state_that_contains_itself_is_saved_to_memory_as_to_disk(tier: Tier) -> None:
    """torch.save (the disk path) handles a state that refers to itself; the memory tier's walk of
    its storages looped for ever on one (the job's save never returned)."""
    looped = state(1)
    looped["self"] = looped
    worker = tier.worker()
    began = time.monotonic()
    assert worker.save(looped, "whole", 1, persist=True, keep=3)
    assert tier.agent.flush(20)
    assert time.monotonic() - began < 15
    assert job.durable_steps(tier.checkpoint_dir) == [1]


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_copy_can_be_persisted_under_a_name_of_its_own(tier: Tier) -> None:
    for rank in (0, 1):  # e.g. each rank's shard: its own key, its own file
        tier.worker().save(state(rank), f"rank{rank}", 4, persist=f"step_4/rank{rank}.pt", keep=1)
    assert tier.agent.flush(30)
    for rank in (0, 1):
        with checkpoint_file.open_verified(tier.checkpoint_dir / "step_4" / f"rank{rank}.pt") as f:
            import torch

            assert same(torch.load(f, weights_only=True), state(rank))
    with pytest.raises(CheckpointRefused, match="not a relative file name"):
        tier.worker().save(state(1), "rank1", 5, persist="../outside.pt", keep=1)
    assert tier.agent.memory_steps() == [4]  # steps every key of this node holds


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_restarted_worker_maps_the_agreed_step_from_memory(tier: Tier) -> None:
    worker = tier.worker()
    for step in (1, 2):
        worker.save(state(step), "whole", step, persist=False, keep=3)
    assert tier.agent.memory_steps() == [1, 2]
    for agreed in (2, 1):  # the round's step, not simply the newest
        tier.agent.open_round(agreed, agreed, LEASE)
        step, fd = tier.worker(agreed).resume("whole")
        assert step == agreed and same(load_slot(fd), state(agreed))
    tier.agent.open_round(3, None, LEASE)
    assert tier.worker(3).resume("whole") == (None, None)  # no agreement: the script reads the disk


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_reloaded_copy_is_never_written_over(tier: Tier) -> None:
    worker = tier.worker()
    worker.save(state(1), "whole", 1, persist=False, keep=3)
    worker.save(state(2), "whole", 2, persist=False, keep=3)
    tier.agent.open_round(1, 1, LEASE)
    worker = tier.worker(1)
    _, fd = worker.resume("whole")
    reloaded = load_slot(fd)  # tensors mapped from the slot of step 1
    for step in (3, 4, 5):  # step 4 lands on step 1's slot: a fresh memfd, not the mapped one
        worker.save(state(step), "whole", step, persist=False, keep=3)
    assert same(reloaded, state(1))


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_shared_memory_holds_at_most_two_copies_per_key(tier: Tier) -> None:
    worker = tier.worker()
    for step in range(1, 7):
        worker.save(state(step), "whole", step, persist=True, keep=2)
        assert tier.copies() <= 2
    held = tier.agent.memory_steps()  # the newest, and the newest or the one being persisted
    assert len(held) == 2 and held[-1] == 6
    assert tier.agent.flush(30) and job.durable_steps(tier.checkpoint_dir)[-1] == 6
    assert len(job.durable_steps(tier.checkpoint_dir)) <= 2  # keep-K, as job.save keeps


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_state_that_outgrew_its_slot_is_sized_again_and_saved(tier: Tier) -> None:
    import torch

    worker, w = tier.worker(), torch.ones(1000)
    worker.save({"w": w, "note": "x"}, "whole", 1, persist=False, keep=3)
    worker.save({"w": w, "note": "x" * 300_000}, "whole", 2, persist=False, keep=3)  # same tensors, far larger pickle
    worker.save({"w": w, "note": "y"}, "whole", 3, persist=False, keep=3)  # and small again, in a roomy slot
    for step in (2, 3):
        tier.agent.open_round(step, step, LEASE)
        got, fd = tier.worker(step).resume("whole")
        assert got == step and load_slot(fd)["note"] == ("x" * 300_000 if step == 2 else "y")


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_saves_of_a_same_size_state_reuse_their_slots(tier: Tier) -> None:
    """The steady state of a training loop: no slot is allocated (and mapped) again after the first two."""

    def slot_inodes() -> set[int]:
        return memfd_inodes(tier.agent.pid, "rally-ckpt")

    worker = tier.worker()
    for step in (1, 2):
        worker.save(state(step), "whole", step, persist=True, keep=3)
    first = slot_inodes()
    for step in range(3, 7):
        worker.save(state(step), "whole", step, persist=True, keep=3)
        assert slot_inodes() == first
    assert len(first) == 2


def test_a_save_while_the_previous_persists_takes_the_other_slot_and_keeps_the_newest() -> None:
    table = SlotTable(os.urandom(8).hex())
    table.open_round(0, None, LEASE)

    def save(step: int) -> None:
        table.reserve(1, "whole", step, 4096, 0, f"step_{step}.pt", 3)
        table.commit(1, "whole", step, 100, 0)

    save(1)
    key, busy, slot = table.next_to_persist()  # the persister copies step 1 ...
    assert slot.step == 1
    for step in (2, 3, 4):  # ... while saves keep coming: none waits, none touches step 1's slot
        save(step)
        assert table.keys["whole"].slots[busy].step == 1
        assert table.memory_steps() == [1, step]
    table.persisted(key, busy, ok=True)
    assert table.next_to_persist()[2].step == 4  # the newest is next; 2 and 3 were superseded
    assert {s.state for s in table.keys["whole"].slots} == {COMMITTED}
    table.release()


# --- how often the disk copy runs ---------------------------------------------------


def durable_events(tier: Tier) -> list[dict]:
    import json

    lines = tier.events.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "checkpoint_durable"]


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_the_disk_copy_rests_in_proportion_to_its_cpu_and_the_jobs_end_writes_the_newest_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RALLY_CKPT_PERSIST_SHARE=0.001: after a copy that took c s of the holder's CPU, no other
    for 999 c (a 20 MB state: tens of seconds). Saves go on into memory meanwhile; the flush of the
    job's end writes the newest at once, and only the newest."""
    monkeypatch.setenv(PERSIST_SHARE_ENV, "0.001")
    tier = Tier(tmp_path, tmp_path / "ckpt")
    tier.agent.open_round(0, None, LEASE)
    try:
        worker = tier.worker()
        assert worker.save(state(1, 5_000_000), "whole", 1, persist=True, keep=3)
        assert eventually(lambda: tier.agent.last_durable == 1, 30)
        first = eventually(lambda: durable_events(tier), 10)[0]
        assert first["step"] == 1 and first["cpu"] > 0
        assert first["rest"] == pytest.approx(first["cpu"] * 999, rel=0.01)
        assert first["rest"] > 5, f"a 20 MB copy took {first['cpu']} s of CPU: too little to show a rest"
        for step in (2, 3, 4, 5):
            assert worker.save(state(step, 5_000_000), "whole", step, persist=True, keep=3)
        time.sleep(1.0)
        assert tier.agent.last_saved == 5 and tier.agent.last_durable == 1, "the persister wrote while resting"
        assert job.durable_steps(tier.checkpoint_dir) == [1]
        began = time.monotonic()
        assert tier.agent.flush(30)
        assert time.monotonic() - began < first["rest"] / 2, "the job's end waited out the rest"
        assert job.durable_steps(tier.checkpoint_dir) == [1, 5]  # the newest only: 2-4 were superseded
    finally:
        tier.agent.stop()


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_persist_share_of_one_writes_every_save_as_it_comes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PERSIST_SHARE_ENV, "1")
    tier = Tier(tmp_path, tmp_path / "ckpt")
    tier.agent.open_round(0, None, LEASE)
    try:
        worker = tier.worker()
        for step in (1, 2, 3):
            assert worker.save(state(step, 5_000_000), "whole", step, persist=True, keep=3)
            assert eventually(lambda s=step: tier.agent.last_durable == s, 20), f"step {step} was not written unasked"
        assert [e["rest"] for e in durable_events(tier)] == [0, 0, 0]
    finally:
        tier.agent.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["0", "often", "1.5", "-0.1"])
def test_a_bad_persist_share_is_one_line_and_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(PERSIST_SHARE_ENV, bad)
    tier = Tier(tmp_path, tmp_path / "ckpt")
    try:
        assert eventually(lambda: tier.warnings, 10) == [
            f"{PERSIST_SHARE_ENV}={bad!r} is not a share of the time in (0, 1] (1: write every save to disk at "
            f"once); using {DEFAULT_PERSIST_SHARE}"
        ]
    finally:
        tier.agent.stop()


# --- fencing by round ---------------------------------------------------


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_worker_of_a_round_that_is_over_cannot_save(tier: Tier) -> None:
    tier.agent.close_round(0)
    with pytest.raises(CheckpointRefused, match="belongs to round 0, which is over"):
        tier.worker(0).save(state(1), "whole", 1, persist=True, keep=3)
    tier.agent.open_round(1, None, LEASE)
    with pytest.raises(CheckpointRefused, match="round 0, which is over"):
        tier.worker(0).save(state(1), "whole", 1, persist=True, keep=3)  # a straggler of round 0
    tier.agent.open_round(2, None, 0.3)  # an agent that stops renewing (frozen): its lease runs out
    time.sleep(0.5)
    with pytest.raises(CheckpointRefused, match="no longer confirmed by its agent"):
        tier.worker(2).save(state(1), "whole", 1, persist=True, keep=3)
    assert tier.agent.memory_steps() == [] and not tier.checkpoint_dir.exists()


class Interrupted(BaseException):
    """What rally.job.run's abort raises in a worker's main thread (RoundAborted), at any bytecode."""


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_request_interrupted_before_its_answer_leaves_no_answer_for_the_next_one(tier: Tier) -> None:
    """The agent's abort (rally.job.run) raises in the main thread wherever it is, also while it
    waits for the holder's answer (a reserve that allocates a large slot takes a while). That
    answer arrives later: on a connection kept, the next request, in the next round, read it as
    its own (here the resume of round 1 read the answer to `held`: no agreed step, so the round's
    checkpoint was not loaded from memory) and every later one the answer before its own."""
    worker = tier.worker()
    assert worker.save(state(1), "whole", 1, persist=False, keep=3)  # the connection is open
    stop_every_thread(tier.agent.pid)  # a holder that answers late

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            worker.held("")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.kill(tier.agent.pid, signal.SIGCONT)
    time.sleep(0.3)  # the late answer, if the connection is still open, is in its buffer by now
    tier.agent.close_round(0)
    tier.agent.open_round(1, 1, LEASE)
    worker.round = 1
    step, fd = worker.resume("whole")
    assert step == 1, f"round 1's resume read another answer (step {step})"
    assert same(load_slot(fd), state(1))
    assert worker.held("whole") == {"whole": [1]}


# --- the round agrees on a step --------------------------------------------------------------


def node(memory: str, durable: int | None) -> NodeInfo:
    return NodeInfo(node_id="n", host="h", addr="a", nproc=1, memory_steps=memory, durable_step=durable)


def test_the_round_resumes_from_the_newest_step_every_node_can_load() -> None:
    assert resume_step([node("20,30", 10), node("20,30", 10)]) == 30
    assert resume_step([node("20,30", 10), node("20", 10)]) == 20  # one node lost its step 30 mid-copy
    assert resume_step([node("20,30", 25), node("", 25)]) == 25  # a new node: memory only where all hold it
    assert resume_step([node("30", 30), node("", None)]) is None  # a node sees no disk: nothing agreed
    assert resume_step([node("", None)]) is None


# --- failures: shared memory too small, disk full, a worker killed mid-copy -----------------


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_too_little_shared_memory_is_one_line_and_saves_go_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "100000")
    t = Tier(tmp_path, tmp_path / "ckpt")
    try:
        t.agent.open_round(0, None, LEASE)
        for name, value in {
            **t.agent.env(),
            "RALLY_ROUND": "0",
            job.CHECKPOINT_DIR_ENV: str(t.checkpoint_dir),
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(ckpt_client, "_tier_resolved", False)
        for step in (1, 2):
            assert job.save(state(step), step) == t.checkpoint_dir / f"step_{step:012d}.pt"
        assert job.durable_steps() == [1, 2]  # written by the worker itself, at once
        assert eventually(lambda: len(t.warnings) == 1, 10)
        assert (
            t.warnings[0].startswith("not enough memory for in-memory checkpoints on this node")
            and "disk only" in t.warnings[0]
        )
        time.sleep(0.2)
        assert len(t.warnings) == 1  # one line, at the first save
    finally:
        t.agent.stop()
        monkeypatch.setattr(ckpt_client, "_tier_resolved", False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs of this test's own (tests/support/helpers.py)."""
    with mount_small_disk(tmp_path / "small-disk", "2m") as mount:
        yield mount


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_full_disk_is_one_line_and_keeps_the_memory_copy_and_the_last_durable_step(
    tmp_path: Path, small_disk: Path
) -> None:
    t = Tier(tmp_path, small_disk / "ckpt")
    try:
        t.agent.open_round(0, None, LEASE)
        worker = t.worker()
        worker.save(state(1, n=100_000), "whole", 1, persist=True, keep=3)  # 0.4 MB: fits
        assert t.agent.flush(30)
        worker.save(state(2, n=1_000_000), "whole", 2, persist=True, keep=3)  # 4 MB: does not
        assert t.agent.flush(30)
        assert eventually(lambda: t.warnings, 10)
        [line] = t.warnings
        assert line.startswith(
            f"checkpoint step 2 could not be written to {small_disk / 'ckpt'}: the disk is full (4.0 MB needed, "
        )
        assert "MB free)" in line and "\n" not in line
        assert job.durable_steps(small_disk / "ckpt") == [1] and checkpoint_file.is_intact(
            small_disk / "ckpt" / "step_000000000001.pt"
        )
        assert [p.name for p in (small_disk / "ckpt").iterdir()] == ["step_000000000001.pt"]  # no temp file left
        t.agent.open_round(1, 2, LEASE)
        step, fd = t.worker(1).resume("whole")
        assert step == 2 and same(load_slot(fd), state(2, n=1_000_000))
    finally:
        t.agent.stop()


KILLED_MID_COPY = """
    import sys
    from rally import job

    class Gate:
        \"\"\"Blocks inside job.save's copy into the slot (its tensors have the sizes of the last
        save, so job.save writes at once, without a sizing pass).\"\"\"
        def __reduce__(self):
            print("copying", flush=True)
            sys.stdin.readline()
            return (dict, ())

    import torch
    job.save({"w": torch.full((1000,), 1.0), "step": 1}, 1)
    print("saved 1", flush=True)
    job.save({"w": torch.full((1000,), 2.0), "step": 2, "gate": Gate()}, 2)
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_worker_killed_mid_copy_leaves_the_previous_step_usable(tier: Tier) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env |= {**tier.agent.env(), "RALLY_ROUND": "0", job.CHECKPOINT_DIR_ENV: str(tier.checkpoint_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_MID_COPY)], env=env, cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saved 1"
        assert proc.stdout.readline().strip() == "copying"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert eventually(lambda: tier.agent.memory_steps() == [1], 10)
    tier.agent.open_round(1, 1, LEASE)
    step, fd = tier.worker(1).resume("whole")
    assert step == 1 and load_slot(fd)["step"] == 1
    assert tier.agent.flush(30) and job.durable_steps(tier.checkpoint_dir) == [1]


# --- nothing leaks ---------------------------------------------------------------------------

FAKE_AGENT = """
    import sys, time
    from pathlib import Path
    from rally.agent.checkpoint.node_checkpoints import HolderProcess
    from rally.agent.checkpoint.core.client import MemoryTier
    from rally.agent.base.event_log import EventLog
    tier = HolderProcess.start(sys.argv[1], EventLog(Path(sys.argv[2])), print)
    tier.open_round(0, None, 60)
    MemoryTier(tier.address, 0).reserve("whole", 1, 1 << 20, False, 3)  # a slot: 1 MB of memfd
    print(tier.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_the_holders_memory_is_freed_when_its_agent_is_sigkilled(tmp_path: Path) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(FAKE_AGENT), str(tmp_path / "ckpt"), str(tmp_path / "events.jsonl")],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert agent.stdout is not None
        holder = int(agent.stdout.readline())
        assert holders_of(pids=[holder]), "the holder holds no slot"
        os.killpg(agent.pid, signal.SIGKILL)  # the agent's whole group: the holder has a session of its own
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
    assert eventually(lambda: not holders_of(pids=[holder]), 10), "the holder kept its memory after the agent died"


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_direct_save_to_a_full_disk_is_one_line_with_the_bytes_needed_and_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.delenv(ckpt_client.HOLDER_ENV, raising=False)  # the disk path: no memory tier,
    monkeypatch.setattr(ckpt_client, "_tier_resolved", False)  # whatever an earlier test of this process resolved
    with mount_small_disk(tmp_path / "disk", "1m") as disk:
        monkeypatch.setenv(job.CHECKPOINT_DIR_ENV, str(disk / "ckpt"))
        job.save({"w": torch.ones(1000)}, 1)
        with pytest.raises(OSError) as info:
            job.save({"w": torch.ones(500_000)}, 2)  # 2 MB
        line = str(info.value)
        assert f"checkpoint step_000000000002.pt could not be written to {disk / 'ckpt'}: the disk is full" in line
        assert (
            "at least 2.0 MB needed" in line and "MB free" in line and "\n" not in line and "unexpected pos" not in line
        )
        assert job.durable_steps() == [1] and sorted(p.name for p in (disk / "ckpt").iterdir()) == [
            "step_000000000001.pt"
        ]


def test_rally_status_and_metrics_show_the_last_saved_and_the_last_durable_step() -> None:
    from rich.console import Console

    from rally.agent.display.worker_table import worker_table
    from rally.agent.observe.metrics import AgentCollector

    record = {"host": "h", "group_rank": 0, "round": 1, "restart_count": 0, "workers": [],
              "checkpoint_saved_step": 30, "checkpoint_durable_step": 25}  # fmt: skip
    console = Console(width=200, record=True)
    console.print(worker_table([record], "job", per_node=True))
    assert "30 (25 on disk)" in console.export_text()
    metrics = {m.name: m.samples[0].value for m in AgentCollector(lambda: record, lambda: []).collect() if m.samples}
    assert metrics["rally_checkpoint_saved_step"] == 30 and metrics["rally_checkpoint_durable_step"] == 25
