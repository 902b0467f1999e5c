"""Specification of agent.job, the helper module training scripts import, and agent.heartbeat_file.

Crash, heartbeat and signal behaviour is checked with real subprocesses, real files and real signals.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from rally.agent.worker_side import heartbeat_file, job, memory_only, process_memory
from support.job_env import ckpt_dir, clean_job_env, outside_env  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=outside_env(**env), cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def checkpoint_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def temp_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# --- context ---------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_context_outside_a_launcher_is_rank_0_of_1() -> None:
    ctx = job.context()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (0, 0, 1, 1)
    assert (ctx.group_rank, ctx.group_world_size, ctx.restart_count, ctx.max_restarts) == (0, 1, 0, 0)
    assert ctx.is_rank0 and ctx.checkpoint_dir is None and ctx.preempt_signals == ()


@pytest.mark.timeout(10)
def test_context_reads_the_torchrun_and_rally_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job42", "RALLY_CHECKPOINT_DIR": "/shared/ckpt",
        "RALLY_PREEMPT_SIGNALS": "SIGUSR1, TERM",
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ctx = job.context()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (5, 1, 8, 4)
    assert (ctx.group_rank, ctx.group_world_size, ctx.restart_count, ctx.max_restarts) == (1, 2, 2, 3)
    assert ctx.run_id == "job42" and ctx.checkpoint_dir == Path("/shared/ckpt") and not ctx.is_rank0
    assert ctx.preempt_signals == (signal.SIGUSR1, signal.SIGTERM)


@pytest.mark.timeout(10)
def test_malformed_environment_gives_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'zero'"):
        job.context()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("RALLY_PREEMPT_SIGNALS", "SIGUSR1,SIGNOPE")
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        job.context()


# --- checkpoints -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_save_then_load_latest_round_trips_state_and_step(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert job.load_latest() is None
    assert "rally: no checkpoint, starting from scratch" in capsys.readouterr().err

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"lr": 0.1, "step": torch.tensor(7)}}
    path = job.save(state, 7)
    assert path == ckpt_dir / "step_000000000007.pt"

    ckpt = job.load_latest()
    assert ckpt is not None and ckpt.step == 7 and ckpt.path == path
    assert torch.equal(ckpt.state["model"]["w"], state["model"]["w"]) and ckpt.state["optim"]["lr"] == 0.1
    assert f"rally: resuming from step 7 ({path})" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_save_keeps_only_the_newest_k(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in range(1, 6):
        job.save({"step": step}, step, keep=2)
    assert checkpoint_names(ckpt_dir) == ["step_000000000004.pt", "step_000000000005.pt"]

    monkeypatch.setenv(job.CHECKPOINT_KEEP_ENV, "1")
    job.save({"step": 6}, 6)
    assert checkpoint_names(ckpt_dir) == ["step_000000000006.pt"]

    monkeypatch.delenv(job.CHECKPOINT_KEEP_ENV)
    for step in range(7, 12):
        job.save({"step": step}, step)
    assert len(checkpoint_names(ckpt_dir)) == job.DEFAULT_CHECKPOINT_KEEP == 3


@pytest.mark.timeout(60)
def test_non_rank0_save_writes_nothing_but_load_works(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job.save({"step": 3}, 3)
    monkeypatch.setenv("RANK", "1")
    assert job.save({"step": 4}, 4) is None
    assert checkpoint_names(ckpt_dir) == ["step_000000000003.pt"]
    ckpt = job.load_latest()
    assert ckpt is not None and ckpt.step == 3


@pytest.mark.timeout(60)
def test_truncated_newest_checkpoint_falls_back_to_previous(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    job.save({"w": torch.full((1000,), 1.0)}, 1)
    newest = job.save({"w": torch.full((1000,), 2.0)}, 2)
    assert newest is not None
    with open(newest, "r+b") as f:  # as if the disk lost the file's tail
        f.truncate(newest.stat().st_size // 2)
    capsys.readouterr()

    ckpt = job.load_latest()
    assert ckpt is not None and ckpt.step == 1 and torch.equal(ckpt.state["w"], torch.full((1000,), 1.0))
    err = capsys.readouterr().err
    assert f"rally: warning: checkpoint {newest} is damaged" in err
    assert "rally: resuming from step 1" in err


@pytest.mark.timeout(60)
def test_stale_temp_file_is_ignored_by_load_and_removed_by_next_save(ckpt_dir: Path) -> None:
    job.save({"step": 1}, 1)
    stale = ckpt_dir / ".step_000000000002.pt.abc123.tmp"  # what a killed writer leaves behind
    stale.write_bytes(b"half a checkpoint")

    ckpt = job.load_latest()
    assert ckpt is not None and ckpt.step == 1
    job.save({"step": 2}, 2)
    assert temp_names(ckpt_dir) == []
    assert checkpoint_names(ckpt_dir) == ["step_000000000001.pt", "step_000000000002.pt"]


IN_PROCESS = """
    import torch
    from rally import job

    assert job.load_latest() is None
    weights = torch.zeros(4)
    job.save({"w": weights}, 1)
    weights += 1  # the script's tensors change in place after a save: the kept copy must not
    job.save({"w": weights}, 2)
    weights += 1
    ckpt = job.load_latest()
    print("loaded", ckpt.step, ckpt.state["w"].tolist(), ckpt.source, flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_without_a_directory_or_rallys_memory_tier_the_newest_save_is_kept_in_the_process(tmp_path: Path) -> None:
    """torchrun or plain python with no RALLY_CHECKPOINT_DIR: no traceback (main raised
    CheckpointDirNotSet on the first load), no file written anywhere, the newest save (a copy)
    comes back in the same process, and one line says where checkpoints went and how to keep them."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(IN_PROCESS)],
        env=outside_env(), cwd=tmp_path, capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "loaded 2 [1.0, 1.0, 1.0, 1.0] process memory" in result.stdout, result.stdout + result.stderr
    assert result.stderr.count(process_memory.LINE) == 1, result.stderr
    assert "RALLY_CHECKPOINT_DIR=DIR" in process_memory.LINE and "\n" not in process_memory.LINE
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("*")), "nothing may be written where nobody chose"


def readme_train_py() -> str:
    """The README's own `train.py` (its `<!-- snippet: file train.py -->` block), as a user copies it."""
    text = (REPO / "README.md").read_text()
    after = text.split("<!-- snippet: file train.py -->", 1)[1]
    return after.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"


def torch_aborted_at_exit(result: Any) -> bool:
    """torch 2.13's own abort as a gloo worker exits after its last step and destroy_process_group
    ("terminate called without an active exception", SIGABRT): 1 run in 8-12 of the README's
    train.py under torchrun, and as often with every rally.job call taken out of it (plain DDP, 2
    of 16 runs, 2026-12-04). Not the script's failure: the run is made once more."""
    return (
        result.returncode != 0
        and "done at step 49" in result.stdout
        and "terminate called without an active exception" in result.stderr
    )


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_the_readmes_train_py_runs_under_torchrun_and_plain_python_without_a_checkpoint_dir(tmp_path: Path) -> None:
    """A script written for rally runs on the launcher it replaces: the README's train.py under torch's
    own torchrun (2 workers) and under plain python (one process, its rendezvous in the environment),
    with no RALLY_CHECKPOINT_DIR. On main every rank died with a CheckpointDirNotSet traceback.
    The two runs go side by side (each its own rendezvous: torchrun's on a port of its choosing, the
    plain one on a free port), the plain one's start overlapping torchrun's."""
    from support.helpers import finish, free_port, kill_group

    script = tmp_path / "train.py"
    script.write_text(readme_train_py())

    def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    torchrun_argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    torchrun_proc = start(torchrun_argv, outside_env(OMP_NUM_THREADS="1"))
    plain_proc = start(
        [sys.executable, str(script)],
        outside_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"),
    )
    try:
        torchrun, plain = finish(torchrun_proc, 150), finish(plain_proc, 60)  # each killed and failed at its bound
        if torch_aborted_at_exit(torchrun):
            torchrun_proc = start(torchrun_argv, outside_env(OMP_NUM_THREADS="1"))  # once more (see above)
            torchrun = finish(torchrun_proc, 150)
    finally:
        for proc in (torchrun_proc, plain_proc):
            if proc.poll() is None:
                kill_group(proc.pid)
                proc.wait()
    for name, result in (("torchrun", torchrun), ("python", plain)):
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        assert "done at step 49" in result.stdout, f"{name}: {result.stdout}{result.stderr}"
        assert "Traceback" not in result.stderr, f"{name}: {result.stderr}"
        assert result.stderr.count(process_memory.LINE) == 1, f"{name}: {result.stderr}"  # rank 0, once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"], "no checkpoint file may appear"


WRITER = """
    import sys
    import torch
    from rally import job

    size = int(sys.argv[1])
    ckpt = job.load_latest()
    step = ckpt.step + 1 if ckpt else 1
    print("writing from step", step, flush=True)
    while True:  # a training loop that does nothing but checkpoint: SIGKILL lands mid-write
        job.save({"step": step, "data": torch.full((size,), float(step))}, step, keep=2)
        step += 1
"""


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_sigkill_during_save_never_damages_or_hides_the_previous_checkpoint(
    ckpt_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    size = 4_000_000  # 16 MB: each save takes ~30 ms here; the kill waits for one to be under way
    rng = random.Random(1234)
    mid_write_kills = 0
    last_step = 0
    ckpt_dir.mkdir()
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WRITER), str(size)],
            env=outside_env(RALLY_CHECKPOINT_DIR=str(ckpt_dir)), cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("writing from step")
            # Once a checkpoint exists, kill at a random moment, preferably while a write is under way.
            deadline = time.monotonic() + 30
            while not checkpoint_names(ckpt_dir):
                assert time.monotonic() < deadline, "writer never saved a checkpoint"
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.3))
            deadline = time.monotonic() + 0.5
            while not temp_names(ckpt_dir) and time.monotonic() < deadline:
                time.sleep(0.001)
            mid_write_kills += bool(temp_names(ckpt_dir))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

        # Every checkpoint that is visible is complete and holds what was saved for its step ...
        capsys.readouterr()
        for name in checkpoint_names(ckpt_dir):
            state = torch.load(ckpt_dir / name, weights_only=True)
            assert int(name[5:17]) == state["step"] and torch.equal(
                state["data"], torch.full((size,), float(state["step"]))
            )
        # ... and load_latest finds the newest of them without needing to fall back.
        ckpt = job.load_latest()
        assert ckpt is not None and ckpt.step >= max(last_step, 1)
        assert "damaged" not in capsys.readouterr().err
        last_step = ckpt.step

    assert mid_write_kills >= 1, "no kill landed while a checkpoint was being written"
    job.save({"step": last_step + 1}, last_step + 1)
    assert temp_names(ckpt_dir) == []


# --- heartbeat -------------------------------------------------------------------------------

HEARTBEATER = """
    import sys, time
    from rally import job
    job.heartbeat()
    print("beat", flush=True)
    sys.stdin.readline()
    start = time.process_time()
    for _ in range(10_000):
        job.heartbeat()
    print(time.process_time() - start, flush=True)
"""


@pytest.mark.timeout(30)
def test_heartbeat_round_trips_through_a_file_between_processes(tmp_path: Path) -> None:
    path = heartbeat_file.create(tmp_path / "rank0.hb")
    assert heartbeat_file.read(path) == (0, 0)

    before = time.monotonic_ns()
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HEARTBEATER)], env=outside_env(RALLY_HEARTBEAT_FILE=str(path)),
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "beat\n"
        count, ns = heartbeat_file.read(path)
        assert count == 1 and before < ns <= time.monotonic_ns()

        proc.stdin.write("go\n")
        proc.stdin.flush()
        elapsed = float(proc.stdout.readline())
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    count, last_ns = heartbeat_file.read(path)
    assert count == 10_001 and ns < last_ns <= time.monotonic_ns()
    assert elapsed < 1.0, f"10,000 heartbeats took {elapsed:.3f} s of CPU"  # typically ~5 ms


@pytest.mark.timeout(30)
def test_heartbeat_without_a_file_is_a_cheap_no_op() -> None:
    result = run_python("""
        import time
        from rally import job
        start = time.process_time()
        for _ in range(10_000):
            job.heartbeat()
        print(time.process_time() - start)
    """)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 1.0


@pytest.mark.timeout(10)
def test_heartbeat_file_refuses_a_file_that_is_not_one(tmp_path: Path) -> None:
    other = tmp_path / "not-a-heartbeat"
    other.write_bytes(b"x" * 64)
    with pytest.raises(heartbeat_file.HeartbeatFileError, match="not a rally heartbeat file"):
        heartbeat_file.HeartbeatWriter(other)
    with pytest.raises(heartbeat_file.HeartbeatFileError, match="does not exist"):
        heartbeat_file.read(tmp_path / "missing")


@pytest.mark.timeout(10)
def test_recreating_a_heartbeat_file_resets_it_without_hurting_an_old_writer(tmp_path: Path) -> None:
    path = heartbeat_file.create(tmp_path / "hb")
    old = heartbeat_file.HeartbeatWriter(path)
    old.beat()
    heartbeat_file.create(path)  # next round
    old.beat()  # a straggler from the previous round: no SIGBUS, no effect on the new file
    assert heartbeat_file.read(path) == (0, 0)
    heartbeat_file.HeartbeatWriter(path).beat()
    assert heartbeat_file.read(path)[0] == 1
    old.close()


# --- preemption ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_preemption_signal_sets_the_flag_and_runs_callbacks_instead_of_killing() -> None:
    result = run_python(
        """
        import os, signal, time
        from rally import job
        job.install_preemption_handler(job.context().preempt_signals)
        calls = []
        job.on_preempt(lambda signum: 1 / 0)  # a broken callback must not kill the worker
        job.on_preempt(calls.append)
        assert not job.preempted()
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not job.preempted() and time.monotonic() < deadline:
            pass
        print(job.preempted(), calls)
        """,
        RALLY_PREEMPT_SIGNALS="SIGUSR1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"True [{int(signal.SIGUSR1)}]"
    assert "ZeroDivisionError" in result.stderr


@pytest.mark.timeout(30)
def test_without_the_handler_the_preemption_signal_kills_as_usual() -> None:
    result = run_python("""
        import os, signal, time
        from rally import job
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
    """)
    assert result.returncode == -signal.SIGUSR1


# --- import cost -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_importing_the_helper_does_not_import_torch() -> None:
    result = run_python("""
        import sys
        import rally.agent.worker_side.job
        from rally import job
        job.context(); job.heartbeat(); job.preempted()
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


MEMORY_ONLY = """
    import os, time
    import torch
    from rally import job

    ckpt = job.load_latest()
    start = ckpt.step + 1 if ckpt else 0
    w = ckpt.state["w"] if ckpt else torch.zeros(1)
    ctx = job.context()
    print(f"start {start} source {ckpt.source if ckpt else None}", flush=True)
    for step in range(start, 6):
        w += 1
        job.save({"w": w}, step)
        if step == 3 and ctx.restart_count == 0 and ctx.rank == 1:
            time.sleep(1.0)  # rank 0 saves steps up to 5 meanwhile
            os._exit(3)
    print(f"w {w.item()}", flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_script_without_checkpoint_dir_keeps_its_checkpoints_in_memory_and_resumes_from_them(
    tmp_path: Path,
) -> None:
    """A script written for rally works under `rally` with no flag. Its saves go to the
    memory tier only (no file anywhere), a restart resumes from memory, and one line says where
    checkpoints are kept and how to make them durable."""
    from support.helpers import clean_env, run_rally

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(MEMORY_ONLY))
    result = run_rally(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", tmp_path / "logs", script],
        cwd=tmp_path, env=clean_env(), timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    err = result.stderr
    assert err.count(memory_only.LINE) == 1, result.describe()  # once, on rank 0, at the first start
    assert "--checkpoint-dir DIR" in memory_only.LINE
    assert "resuming from step 5 (from memory)" in err, result.describe()
    assert "[0] start 6 source memory" in result.stdout and "[1] start 6 source memory" in result.stdout
    assert "[0] w 6.0" in result.stdout and "[1] w 6.0" in result.stdout
    assert not list(tmp_path.rglob("step_*")), "a memory-only checkpoint must leave no file"
