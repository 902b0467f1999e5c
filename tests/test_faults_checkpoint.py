"""Fault matrix, checkpoint cases: concurrent savers, damaged newest files, crash loops over them.

Real processes throughout: savers and ranks are separate Python processes sharing one directory,
released together through their stdin (no sleeps), and the crash-loop case runs rally itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rally.agent.worker_side import job
from support.helpers import run_rally, write_probe
from support.job_env import ckpt_dir, clean_job_env, outside_env  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]


def start_python(code: str, **env: str) -> subprocess.Popen[str]:
    """A helper process with this environment minus any launcher variables, plus ``env``."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=outside_env(**env), cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def finish_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process (killing what outlives ``timeout``); (returncode, stdout, stderr) each."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return results


def release(procs: list[subprocess.Popen[str]], ready_line: str) -> None:
    """Wait until each process printed ``ready_line`` (its imports done), then let them all go at once."""
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == ready_line
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name[5:17]) for p in directory.iterdir() if p.name.startswith("step_"))


def temps_on_disk(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --- concurrent savers -----------------------------------------------------------------------

SAVER = """
    import sys
    import torch
    from rally import job

    first, stride, count = (int(a) for a in sys.argv[1:])
    print("ready", flush=True)
    sys.stdin.readline()
    for step in range(first, first + stride * count, stride):
        job.save({"step": step, "data": torch.full((50_000,), float(step))}, step, keep=2)
    print("saved", count, flush=True)
"""

SAVERS, SAVES_EACH, KEEP = 4, 25, 2


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_concurrent_saver_processes_never_delete_each_others_files(ckpt_dir: Path) -> None:
    import torch

    savers = [
        start_python(
            SAVER.replace("sys.argv[1:]", f"[{i}, {SAVERS}, {SAVES_EACH}]"), RALLY_CHECKPOINT_DIR=str(ckpt_dir)
        )
        for i in range(SAVERS)
    ]
    release(savers, "ready")
    for code, out, err in finish_all(savers, timeout=150):
        assert code == 0 and out.strip() == f"saved {SAVES_EACH}", f"a saver failed (exit {code}):\n{err[-3000:]}"

    # Every checkpoint left is intact and holds its own step; the newest ever saved is among them.
    newest = SAVERS * SAVES_EACH - 1
    steps = steps_on_disk(ckpt_dir)
    assert newest in steps and temps_on_disk(ckpt_dir) == []
    for step in steps:
        state = torch.load(ckpt_dir / f"step_{step:012d}.pt", weights_only=True)
        assert state["step"] == step and torch.equal(state["data"], torch.full((50_000,), float(step)))
    assert job.newest_checkpoint_step(ckpt_dir) == newest
    job.save({"step": newest + 1}, newest + 1, keep=KEEP)
    assert steps_on_disk(ckpt_dir) == [newest, newest + 1]


BLOCKED_SAVER = """
    import collections, sys
    from rally import job

    class Gate:
        \"\"\"Pickled inside torch.save: holds the save open, mid-write, until the test says go.\"\"\"
        def __reduce__(self):
            print("inside save", flush=True)
            sys.stdin.readline()
            return (collections.OrderedDict, ())

    import torch
    print("ready", flush=True)
    sys.stdin.readline()
    job.save({"gate": Gate(), "step": 50}, 50)
    print("saved", flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_save_in_progress_keeps_its_temp_file_while_another_saver_cleans_up(ckpt_dir: Path) -> None:
    writer = start_python(BLOCKED_SAVER, RALLY_CHECKPOINT_DIR=str(ckpt_dir))
    try:
        release([writer], "ready")
        assert writer.stdout is not None and writer.stdout.readline().strip() == "inside save"
        in_progress = temps_on_disk(ckpt_dir)
        assert len(in_progress) == 1
        (ckpt_dir / ".step_000000000049.pt.dead.tmp").write_bytes(b"left by a writer that died")

        job.save({"step": 1}, 1)  # another saver: cleans up the dead writer's temp only
        assert temps_on_disk(ckpt_dir) == in_progress

        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
    finally:
        [(code, out, err)] = finish_all([writer], timeout=60)
    assert code == 0 and out.strip().endswith("saved"), err[-3000:]
    assert steps_on_disk(ckpt_dir) == [1, 50] and temps_on_disk(ckpt_dir) == []
    ckpt = job.load_latest()
    assert ckpt is not None and ckpt.step == 50 and ckpt.state["step"] == 50


class FailsWhilePickled:
    """torch.save raises halfway through writing, as a full disk or a broken state would."""

    def __reduce__(self) -> tuple:
        raise OSError(28, "No space left on device")


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_save_that_fails_midway_leaves_the_last_good_checkpoint_and_no_temp_file(ckpt_dir: Path) -> None:
    import torch

    job.save({"step": 1, "w": torch.ones(1000)}, 1, keep=1)
    with pytest.raises(OSError, match="No space left"):
        job.save({"w": torch.zeros(1000), "bad": FailsWhilePickled()}, 2, keep=1)
    assert steps_on_disk(ckpt_dir) == [1] and temps_on_disk(ckpt_dir) == []
    ckpt = job.load_latest()
    assert ckpt is not None and ckpt.step == 1 and torch.equal(ckpt.state["w"], torch.ones(1000))


# --- damaged newest checkpoints --------------------------------------------------------------


def damage_newest_files(directory: Path) -> dict[int, str]:
    """Good steps 1 and 2, then steps 3-9 each damaged a different way; {step: how}."""
    import torch

    for step in range(1, 6):
        job.save({"step": step, "w": torch.full((10_000,), float(step))}, step, keep=100)
    path = {step: directory / f"step_{step:012d}.pt" for step in range(3, 10)}
    with open(path[3], "r+b") as f:
        f.truncate(path[3].stat().st_size // 2)
    with open(path[4], "r+b") as f:  # garbage in the middle of the tensor's bytes: same length
        f.seek(path[4].stat().st_size // 2)
        f.write(b"\xde\xad\xbe\xef" * 64)
    assert torch.load(path[4], weights_only=True)["step"] == 4, "torch.load alone takes the garbage"
    path[5].write_bytes(b"")
    path[6].mkdir()
    os.mkfifo(path[7])
    torch.save({"step": 8}, path[8])  # plain torch.save: no footer, cannot be told from a truncated one
    path[9].write_bytes(os.urandom(4096))
    return {3: "truncated", 4: "garbage", 5: "empty", 6: "directory", 7: "fifo", 8: "no footer", 9: "random"}


RANK = """
    from rally import job
    import torch
    print("ready", flush=True)
    input()
    ckpt = job.load_latest()
    print(ckpt.step, int(ckpt.state["w"][0]), flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_every_rank_skips_damaged_newest_checkpoints_alike_and_so_does_the_agent(ckpt_dir: Path) -> None:
    damaged = damage_newest_files(ckpt_dir)
    world = 4
    ranks = [
        start_python(RANK, RALLY_CHECKPOINT_DIR=str(ckpt_dir), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world))
        for r in range(world)
    ]
    release(ranks, "ready")
    results = finish_all(ranks, timeout=120)
    assert [(code, out.strip()) for code, out, _ in results] == [(0, "2 2")] * world, results

    warnings = [line for line in results[0][2].splitlines() if "is damaged" in line]
    assert len(warnings) == len(damaged), results[0][2]
    for step, line in zip(sorted(damaged, reverse=True), warnings, strict=True):
        assert f"step_{step:012d}.pt is damaged (" in line and line.endswith("trying an older one")
    assert "rally: resuming from step 2" in results[0][2]
    assert all("is damaged" not in err for _, _, err in results[1:]), "only local rank 0 warns"

    assert job.newest_checkpoint_step(ckpt_dir) == 2  # the agent's crash-loop check agrees


CRASHES_AFTER_RESUMING = """
    from rally import job
    ckpt = job.load_latest()
    print("resumed at", ckpt.step if ckpt else None, flush=True)
    raise SystemExit(f"fails right after resuming from step {ckpt.step if ckpt else None}")
"""


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_a_crash_loop_over_a_damaged_newest_checkpoint_is_detected_at_the_step_resumed_from(
    tmp_path: Path, ckpt_dir: Path
) -> None:
    damage_newest_files(ckpt_dir)
    write_probe(tmp_path / "train.py", CRASHES_AFTER_RESUMING)
    result = run_rally(
        [
            "--standalone",
            "--max-restarts",
            "10",
            "--crash-loop-limit",
            "2",
            "--checkpoint-dir",
            str(ckpt_dir),
            "train.py",
        ],
        cwd=tmp_path,
        timeout=150,
    )
    assert result.returncode == 1, result.describe()
    out = result.stdout + result.stderr
    assert "crash loop: 2 restarts in a row made no progress (the newest checkpoint is still step 2)" in out, (
        result.describe()
    )
    assert out.count("resumed at 2") == 2, result.describe()  # the stall is seen entering the third round
    assert "Traceback" not in result.stderr, result.describe()
