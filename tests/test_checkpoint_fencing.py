"""Fencing by round, end to end: a worker of an old round that was frozen (SIGSTOP) in
the middle of its copy, then continued (SIGCONT) after the job moved on, must not overwrite or
publish over the newer round's checkpoint, in memory or on disk.

Real processes and signals: the agent's side of a real holder (HolderProcess, as rally's agent
runs it), a stale worker in a subprocess that stops itself with SIGSTOP once its slot is reserved
(inside torch.save's pickling, before a byte of the copy is written), and the new round's worker
in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core import checkpoint_file
from rally.agent.checkpoint.core.client import MemoryTier
from rally.agent.checkpoint.core.shm import fd_path
from rally.agent.checkpoint.node_checkpoints import HolderProcess
from rally.agent.worker_side import job
from support.helpers import kill_group, wait_for

REPO = Path(__file__).resolve().parents[1]
LEASE = 60.0

STALE_WORKER = """
    import os, signal
    from rally import job
    from rally.agent.checkpoint.core.client import CheckpointRefused

    class Freeze:
        \"\"\"Stops this worker inside job.save, its slot reserved and mapped, nothing copied yet.\"\"\"
        def __reduce__(self):
            print("frozen", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            return (dict, ())

    import torch
    job.save({"w": torch.full((1000,), 1.0), "step": 1}, 1)
    print("saved 1", flush=True)
    try:
        job.save({"w": torch.full((1000,), 7.0), "step": 7, "freeze": Freeze()}, 7)
        print("saved 7", flush=True)
    except CheckpointRefused as refused:
        print(f"refused: {refused}", flush=True)
"""


def load(fd_and_length: tuple[int, int] | None) -> dict:
    import torch

    assert fd_and_length is not None
    fd = fd_and_length[0]
    try:
        return torch.load(fd_path(fd), weights_only=True)
    finally:
        os.close(fd)


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_frozen_worker_of_an_old_round_cannot_overwrite_or_publish_over_the_newer_rounds_checkpoint(
    tmp_path: Path,
) -> None:
    import torch

    ckpt = tmp_path / "ckpt"
    warnings: list[str] = []
    agent = HolderProcess.start(str(ckpt), EventLog(tmp_path / "events.jsonl"), warnings.append)
    assert isinstance(agent, HolderProcess)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env |= {**agent.env(), "RALLY_ROUND": "0", job.CHECKPOINT_DIR_ENV: str(ckpt)}
    stale = None
    try:
        agent.open_round(0, None, LEASE)
        stale = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(STALE_WORKER)], env=env, cwd=REPO,
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert stale.stdout is not None
        assert stale.stdout.readline().strip() == "saved 1"
        assert stale.stdout.readline().strip() == "frozen"
        wait_for(lambda: open(f"/proc/{stale.pid}/stat").read().split(") ")[1][0] == "T", 10, what="the worker to stop")  # type: ignore[union-attr]

        # The job moves on: round 0 is over, round 1's worker saves step 5 and it becomes durable.
        agent.close_round(0)
        agent.open_round(1, 1, LEASE)
        newer = MemoryTier(agent.address, 1)
        assert newer.save({"w": torch.full((1000,), 5.0), "step": 5}, "whole", 5, persist=True, keep=3)
        assert agent.flush(30)
        durable = ckpt / "step_000000000005.pt"
        before = durable.read_bytes()

        # The stale worker runs on: it copies into the slot it had mapped, then tries to commit.
        os.kill(stale.pid, signal.SIGCONT)
        out, _ = stale.communicate(timeout=60)
        assert "refused: rally: checkpoint refused" in out, out
        assert "saved 7" not in out

        mine = load(newer.slot("whole", 5))  # the newer round's copy in memory is untouched
        assert mine["step"] == 5 and torch.equal(mine["w"], torch.full((1000,), 5.0))
        assert agent.flush(30) and job.durable_steps(ckpt) == [1, 5]  # nothing of step 7 published
        assert durable.read_bytes() == before and checkpoint_file.is_intact(durable)
        assert agent.memory_steps() == [1, 5]
        newer.close()
    finally:
        if stale is not None and stale.poll() is None:
            kill_group(stale.pid)
            stale.wait(timeout=10)
        agent.stop()
    assert warnings == []
