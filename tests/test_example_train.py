"""examples/train.py under rally: a job whose workers are SIGKILLed at random steps loses nothing.

Each attempt starts two workers that import torch, so this file keeps to one job of two kills at
random steps, one of each rank in a random order, compared with the session's uninterrupted run
(tests/support/ddp_reference.py). It was two jobs (seeds 1 and 2) of one kill each, both at step 4,
of rank 1 and of rank 0: one job now kills both ranks, the first at step 4 (before the first
checkpoint) and the second at a later step (after one), so what the two proved is proved with one
job's start instead of two.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from support.ddp_reference import EVERY, STEPS, TRAIN, params_hash
from support.helpers import clean_env, read_events, start_rally

REPO = Path(__file__).resolve().parents[1]


def _rally(tmp: Path, name: str, max_restarts: int, step_time: float) -> subprocess.Popen:
    argv = [
        "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(max_restarts), "--log-dir", str(tmp / f"{name}-logs"),
        str(TRAIN), "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--step-time", str(step_time),
        "--checkpoint-dir", str(tmp / f"{name}-ckpt"), "--out", str(tmp / f"{name}.pt"),
    ]  # fmt: skip
    return start_rally(argv, cwd=REPO, env=clean_env(), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, lines: list[str], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode is not None, "\n".join(lines[-50:])


def _reader(proc: subprocess.Popen, lines: list[str]) -> threading.Thread:
    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip("\n"))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _start_point(line: str) -> int | None:
    """The step an attempt starts from, from rank 0's checkpoint-helper line (0: from scratch)."""
    if line.startswith("[0] rally: no checkpoint"):
        return 0
    match = re.match(r"\[0\] rally: resuming from step (\d+)", line)
    return int(match.group(1)) if match else None


def _worker_pid(log_dir: Path, rank: int) -> int | None:
    """The pid of `rank` in the newest round, from the agent's events.jsonl."""
    pid = None
    for record in read_events(log_dir):
        if record["event"] == "worker_started" and record["rank"] == rank:
            pid = record["pid"]
    return pid


@pytest.mark.torch
@pytest.mark.timeout(400)
def test_random_sigkills_of_workers_lose_nothing_and_end_bit_identical(tmp_path: Path, ddp_clean_hash: str):
    rng = random.Random(1)
    first, *later = range(4, STEPS - 4, EVERY + 1)
    kill_steps = [first, rng.choice(later)]  # before the first checkpoint (as both seeds did), then after one
    victims = rng.sample([0, 1], 2)  # each rank once
    count = len(kill_steps)
    proc = _rally(tmp_path, "killed", count, 0.08)
    lines: list[str] = []
    reader = _reader(proc, lines)
    kills: list[tuple[int, int]] = []  # (step at which it was killed, rank)
    deadline = time.monotonic() + 300
    seen = 0
    while kill_steps and proc.poll() is None and time.monotonic() < deadline:
        for line in lines[seen:]:
            match = re.search(r"\] step (\d+) loss", line)
            if match and kill_steps and int(match.group(1)) >= kill_steps[0]:
                pid = _worker_pid(tmp_path / "killed-logs", victims[0])
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    kills.append((int(match.group(1)), victims.pop(0)))
                    kill_steps.pop(0)
                    # wait for the restart before looking for the next kill step
                    lines_before = len(lines)
                    while proc.poll() is None and not any(
                        _start_point(line) is not None for line in lines[lines_before:]
                    ):
                        time.sleep(0.05)
                    seen = len(lines)
                    break
        else:
            seen = len(lines)
            time.sleep(0.02)
    code = _finish(proc, lines, 300)
    reader.join(10)
    text = "\n".join(lines)
    assert code == 0, text[-4000:]
    assert len(kills) == count, f"planned {count} kills, did {kills}\n{text[-3000:]}"
    starts = [p for p in map(_start_point, lines) if p is not None]
    assert starts[0] == 0 and len(starts) == count + 1, text[-3000:]
    resumed = starts[1:]
    for (killed_at, _rank), resumed_at in zip(kills, resumed, strict=False):
        assert killed_at - EVERY <= resumed_at <= killed_at, f"killed at {killed_at}, resumed at {resumed_at}"
    assert params_hash(text) == ddp_clean_hash
    assert "SIGKILL" in text  # the root cause names the signal
