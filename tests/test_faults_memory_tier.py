"""Fault matrix, memory tier: a DDP job under rally loses nothing to a SIGKILL, from
memory or from disk, and the agent's death frees the node's copies.

Each rally run starts two workers that import torch (examples/train.py, forked from the agent's
template), so this file keeps to five runs: a SIGKILLed rank resumed from memory, the same from
disk (memory tier off), the same on two nodes (two agents on 127.0.0.1, one worker each), a
SIGKILLed agent, and a job whose disk is full (one worker). The reference hash is the session's
uninterrupted run of the same job (tests/support/ddp_reference.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from rally.agent.checkpoint.core.shm import holders_of
from rally.agent.worker_side import job
from support.agents import c10d_args, start_agent, stop_all
from support.ddp_reference import EVERY, STEPS, TRAIN, params_hash
from support.helpers import (  # noqa: F401 - procs is a fixture
    clean_env,
    eventually,
    free_port,
    kill_group,
    procs,
    read_events,
    run_rally,
    small_disk,
    start_rally,
    write_probe,
)

KILL_AT = 17


def train(tmp: Path, name: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 240):
    args = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        str(tmp / f"{name}-logs"),
        "--checkpoint-dir",
        str(tmp / f"{name}-ckpt"),
        str(TRAIN),
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        *extra,
    ]
    return run_rally(args, cwd=tmp, env=env or clean_env(), timeout=timeout)


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_ddp_job_resumes_bit_identical_from_memory_after_a_sigkill(tmp_path: Path, ddp_clean_hash: str) -> None:
    result = train(tmp_path, "memory", "--fail-at-step", str(KILL_AT), "--fail-rank", "1")
    assert result.returncode == 0, result.describe()
    assert "[0] rally: resuming from step 15 (from memory)" in result.stderr, result.describe()
    assert params_hash(result.stdout) == ddp_clean_hash
    # The newest step became durable in the background (and at the job's end at the latest) ...
    assert job.durable_steps(tmp_path / "memory-ckpt")[-1] == STEPS
    # ... and the agent said so: events.jsonl, as `rally status` and /metrics show it.
    seen = read_events(tmp_path / "memory-logs")
    assert max(e["step"] for e in seen if e["event"] == "checkpoint_saved") == STEPS
    assert max(e["step"] for e in seen if e["event"] == "checkpoint_durable") == STEPS


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_the_same_job_resumes_bit_identical_from_disk_without_the_memory_tier(
    tmp_path: Path, ddp_clean_hash: str
) -> None:
    result = train(
        tmp_path, "disk", "--fail-at-step", str(KILL_AT), "--fail-rank", "1", env=clean_env(RALLY_MEMORY_TIER="0")
    )
    assert result.returncode == 0, result.describe()
    assert f"[0] rally: resuming from step 15 ({tmp_path / 'disk-ckpt' / 'step_000000000015.pt'})" in result.stderr, (
        result.describe()
    )
    assert params_hash(result.stdout) == ddp_clean_hash


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_sigkill_of_the_agent_frees_the_nodes_copies(tmp_path: Path, procs) -> None:
    args = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        str(TRAIN),
        "--steps",
        "100000",
        "--checkpoint-every",
        "5",
        "--step-time",
        "0.02",
    ]
    proc = start_rally(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.track_group(proc.pid)
    try:
        assert eventually(lambda: any(e["event"] == "checkpoint_saved" for e in read_events(tmp_path / "logs")), 120)
        agent = psutil.Process(proc.pid)
        everything = agent.children(recursive=True)
        holders = [p.pid for p in everything if any("checkpoint/holder.py" in part for part in p.cmdline())]
        assert len(holders) == 1 and holders_of(pids=holders), "no holder holding a copy"
        procs.track(*(p.pid for p in everything))
        os.kill(proc.pid, signal.SIGKILL)  # the agent alone: its guard stops the workers, the holder sees it go
        proc.wait(timeout=10)
        assert eventually(lambda: not holders_of(pids=[p.pid for p in everything]), 15), holders_of(
            pids=[p.pid for p in everything]
        )
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()


FAILS_AFTER_SAVING = """
    import torch
    from rally import job

    ckpt = job.load_latest()
    step = ckpt.step + 1 if ckpt else 1
    size = 100_000 if step == 1 else 400_000  # step 1 fits the 1 MB disk, the others do not
    job.save({"w": torch.full((size,), float(step))}, step)
    raise SystemExit(f"fails after saving step {step}")
"""


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_the_crash_loop_guard_counts_steps_saved_in_memory_as_progress(tmp_path: Path) -> None:
    write_probe(tmp_path / "train.py", FAILS_AFTER_SAVING)
    with small_disk(tmp_path / "disk", "1m") as disk:
        result = run_rally(
            ["--standalone", "--max-restarts", "4", "--crash-loop-limit", "2", "--checkpoint-dir", str(disk / "ckpt"),
             "--log-dir", str(tmp_path / "logs"), "train.py"],
            cwd=tmp_path, timeout=240,
        )  # fmt: skip
    out = result.stdout + result.stderr
    # The disk never got past step 1, but every attempt saved a newer step in memory: no crash loop.
    assert "crash loop" not in out and "no restarts left" in out, result.describe()
    assert "rally: resuming from step 4 (from memory)" in result.stderr, result.describe()
    assert f"checkpoint step 5 could not be written to {disk / 'ckpt'}: the disk is full" in out, result.describe()


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_two_nodes_resume_from_the_same_step_in_memory_bit_identical(tmp_path: Path, ddp_clean_hash: str) -> None:
    port = free_port()
    work = [
        "--nproc-per-node", "1", "--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), str(TRAIN),
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--fail-at-step", str(KILL_AT), "--fail-rank", "1",
    ]  # fmt: skip
    agents = [
        start_agent(f"n{i}", tmp_path, [*c10d_args(port, "2"), "--log-dir", str(tmp_path / f"logs{i}"), *work])
        for i in range(2)
    ]
    try:
        codes = [agent.wait(timeout=240) for agent in agents]
        text = "\n".join(agent.output() for agent in agents)
        assert codes == [0, 0], text[-5000:]
        # Each node held its own copy (local rank 0 of each node saves); the round agreed on step 15 ...
        for i in range(2):
            assert (
                max(e["step"] for e in read_events(tmp_path / f"logs{i}") if e["event"] == "checkpoint_saved") == STEPS
            )
        assert "rally: resuming from step 15 (from memory)" in text, text[-5000:]
        # ... and both ranks resumed from it: the parameters are those of the uninterrupted 2-rank run.
        assert params_hash(text) == ddp_clean_hash
    finally:
        stop_all(agents)
