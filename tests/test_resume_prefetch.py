"""A restarted worker finds its resume step mapped before it asks (agent/checkpoint/core/resume_prefetch.py).

A real holder (started as the agent starts it) holds the copies; the worker is a real process
started through rally's bootstrap, as every worker is, with the environment the agent gives a
restarted worker. What the worker sees is read from inside it: whether the thread ran, how much
of the copy is mapped into it before ``load_latest`` (its /proc/self/smaps), what ``load_latest``
returns and from where.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core.client import MemoryTier
from rally.agent.checkpoint.node_checkpoints import HolderProcess
from rally.agent.worker_side import job

REPO = Path(__file__).resolve().parents[1]
BOOTSTRAP = REPO / "agent" / "worker_side" / "bootstrap.py"
LEASE = 60.0
ELEMENTS = 2_000_000  # 8 MB of float32: 2,000 pages to map


class Holder:
    """A holder with steps 1 and 2 of a whole state in memory, and round 1 resuming from step 2."""

    def __init__(self, tmp: Path, extra: dict | None = None, whole: bool = True) -> None:
        import torch

        self.checkpoint_dir = tmp / "ckpt"
        self.agent = HolderProcess.start(str(self.checkpoint_dir), EventLog(tmp / "events.jsonl"), print)
        assert isinstance(self.agent, HolderProcess)
        self.id = self.agent.address
        self.agent.open_round(0, None, LEASE)
        for step in (1, 2) if whole else ():
            state = {"w": torch.full((ELEMENTS,), float(step)), "step": step, **(extra or {})}
            assert MemoryTier(self.id, 0).save(state, job.WHOLE_STATE_KEY, step, persist=False, keep=3)
        self.agent.open_round(1, 2, LEASE)

    def run_worker(self, tmp: Path, script: str, restart_count: int = 1, **env: str) -> dict:
        """Run ``script`` as a restarted worker of round 1; what it printed last, as JSON."""
        path = tmp / "worker.py"
        path.write_text(textwrap.dedent(script))
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "TORCHELASTIC_", "RANK"))}
        clean |= {
            **self.agent.env(),
            "RALLY_ROUND": "1",
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            job.CHECKPOINT_DIR_ENV: str(self.checkpoint_dir),
            **env,
        }
        done = subprocess.run(
            [sys.executable, "-u", str(BOOTSTRAP), "script", str(path)], env=clean, cwd=tmp,
            capture_output=True, text=True, timeout=90, start_new_session=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    h = Holder(tmp_path)
    try:
        yield h
    finally:
        h.agent.stop()


# Inside the worker: {inode: kB mapped} of the memory tier's memfds of a key (whole: DDP's state).
MAPPED_KB = """
    def mapped_kb(key="whole"):  # the reload's mappings: private ones (a slot's own, to save into, is shared)
        found, inode = {}, None
        for line in open("/proc/self/smaps"):
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range perms offset dev inode path
                private = fields[1].endswith("p")
                inode = fields[4] if private and "memfd:rally-ckpt-" in line and f"-{key}." in line else None
            elif inode and line.startswith("Rss:"):
                found[inode] = found.get(inode, 0) + int(fields[1])
        return found
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_restarted_worker_finds_its_resume_step_mapped_before_it_asks(holder: Holder, tmp_path: Path) -> None:
    got = holder.run_worker(
        tmp_path,
        MAPPED_KB
        + """
    import json, torch
    from rally import job
    from rally.agent.checkpoint.core import resume_prefetch
    assert resume_prefetch._thread is not None, "no prefetch on a restart under the memory tier"
    resume_prefetch._thread.join(60)
    before = sum(mapped_kb().values())  # what the thread mapped while "the script was starting"
    first = job.load_latest()
    second = job.load_latest(map_location=lambda storage, location: storage)  # not the prepared one: loads anew
    print(json.dumps({
        "before_kb": before,
        "first": [first.step, first.source, first.state["step"], bool((first.state["w"] == 2.0).all())],
        "second": [second.step, second.source, second.state["step"], torch.equal(second.state["w"], first.state["w"])],
        "left": resume_prefetch._ready is not None,
    }))
""",
    )
    assert got["before_kb"] >= ELEMENTS * 4 // 1024, f"the copy was not mapped before load_latest: {got}"
    assert got["first"] == [2, "memory", 2, True]  # the round's step, not simply the newest in memory
    assert got["second"] == [2, "memory", 2, True]
    assert got["left"] is False  # given once


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_reentry_maps_the_new_rounds_resume_step_as_it_is_told_to_enter(holder: Holder, tmp_path: Path) -> None:
    """In `rally.job.run` a process re-enters without restarting (agent/worker_side/restartable.py):
    the agent's "enter" comes after it opened the round, so the resume step is mapped while the
    process group forms, not inside `load_latest` (a first start prepared nothing)."""
    got = holder.run_worker(
        tmp_path,
        MAPPED_KB
        + """
    import json, torch
    from rally import job
    from rally.agent.checkpoint.core import resume_prefetch
    from rally.agent.worker_side import restartable
    assert resume_prefetch._thread is None  # a first start: nothing prepared
    restartable._apply({"RALLY_ROUND": "1"})  # what a worker does with the agent's "enter"
    assert resume_prefetch._thread is not None, "no prefetch on a re-entry"
    resume_prefetch._thread.join(60)
    before = sum(mapped_kb().values())
    first = job.load_latest()
    print(json.dumps({"before_kb": before, "first": [first.step, first.source, first.state["step"]]}))
""",
        restart_count=0,
    )
    assert got["before_kb"] >= ELEMENTS * 4 // 1024, f"the copy was not mapped before load_latest: {got}"
    assert got["first"] == [2, "memory", 2]


NO_PREFETCH = """
    import json
    from rally.agent.checkpoint.core import resume_prefetch
    print(json.dumps({"thread": resume_prefetch._thread is not None}))
"""


@pytest.mark.timeout(60)
def test_a_first_start_or_the_switch_off_prepares_nothing(holder: Holder, tmp_path: Path) -> None:
    assert holder.run_worker(tmp_path, NO_PREFETCH, restart_count=0) == {"thread": False}
    assert holder.run_worker(tmp_path, NO_PREFETCH, RALLY_RESUME_PREFETCH="0") == {"thread": False}


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_state_the_safe_loader_refuses_is_loaded_the_ordinary_way(tmp_path: Path) -> None:
    from fractions import Fraction

    holder = Holder(tmp_path, extra={"lr": Fraction(1, 3)})  # not among the types weights_only loads
    try:
        got = holder.run_worker(
            tmp_path,
            """
    import json, pickle, torch
    from rally import job
    from rally.agent.checkpoint.core import resume_prefetch
    resume_prefetch._thread.join(60)
    prepared = resume_prefetch._ready is not None
    try:
        job.load_latest()
        refused = ""
    except pickle.UnpicklingError as exc:  # as torch.load itself refuses it
        refused = type(exc).__name__
    ckpt = job.load_latest(weights_only=False)
    got = [ckpt.step, ckpt.source, str(ckpt.state["lr"])]
    print(json.dumps({"prepared": prepared, "refused": refused, "got": got}))
""",
        )
    finally:
        holder.agent.stop()
    assert got == {"prepared": False, "refused": "UnpicklingError", "got": [2, "memory", "1/3"]}


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_script_that_saves_before_it_loads_lets_go_of_the_prepared_copy(holder: Holder, tmp_path: Path) -> None:
    got = holder.run_worker(
        tmp_path,
        MAPPED_KB
        + """
    import gc, json, torch
    from rally import job
    from rally.agent.checkpoint.core import resume_prefetch
    resume_prefetch._thread.join(60)
    prepared = {inode for inode, kb in mapped_kb().items() if kb}
    before = sum(mapped_kb().values())
    job.save({"w": torch.zeros(10), "step": 3}, 3)  # a script that starts over instead of resuming
    gc.collect()
    after = sum(kb for inode, kb in mapped_kb().items() if inode in prepared)
    ckpt = job.load_latest()
    print(json.dumps({"before_kb": before, "after_kb": after, "prepared": resume_prefetch._ready is not None,
                      "got": [ckpt.step, ckpt.source]}))
""",
    )
    assert got["before_kb"] >= ELEMENTS * 4 // 1024
    assert got["prepared"] is False
    assert got["after_kb"] < ELEMENTS * 4 // 1024 // 2, f"the prepared mapping outlived the save: {got}"
    assert got["got"] == [2, "memory"]  # the round still resumes from its step, loaded anew


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_sharded_rank_finds_its_own_newest_copy_mapped_before_it_asks(tmp_path: Path) -> None:
    """A sharded job agrees on its step inside load_latest: the thread maps this rank's own newest
    copy (key dcp<rank>of<world>), which load_latest takes when that is the agreed step."""
    holder = Holder(tmp_path, whole=False)
    try:
        size, writer = 4 << 20, MemoryTier(holder.id, 1)
        for step in (3, 4):  # a rank's two copies (any bytes: the thread only maps them)
            slot = writer.reserve("dcp1of2", step, size, False, 3)
            assert slot is not None
            slot[:size] = bytes([step]) * size
            writer.commit("dcp1of2", step, size)
        got = holder.run_worker(
            tmp_path,
            MAPPED_KB
            + """
    import json
    from rally.agent.checkpoint.core import resume_prefetch
    resume_prefetch._thread.join(60)
    kb = sum(mapped_kb("dcp1of2").values())  # the mapping of this rank's copy
    view = resume_prefetch.take_slot("dcp1of2", 4)
    again = resume_prefetch.take_slot("dcp1of2", 4)
    print(json.dumps({"dcp_kb": kb, "first_byte": view[0] if view is not None else None, "again": again is not None}))
""",
            RANK="1",
            WORLD_SIZE="2",
        )
    finally:
        holder.agent.stop()
    assert got["dcp_kb"] >= 4 << 10, got  # a copy faulted in before load_latest asked
    assert got["first_byte"] == 4, got  # the newest one
    assert got["again"] is False, got  # given once
