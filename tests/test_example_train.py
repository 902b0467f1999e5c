"""examples/train.py under a real launcher: a run whose worker is SIGKILLed and restarted ends bit-identical.

Each run starts two workers that import torch (~2 s of CPU each on this machine), plus their
restarts, so this file keeps to one test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"


def launcher_command(script_args: list[str], *, nproc: int, max_restarts: int) -> tuple[list[str], dict[str, str]]:
    """How a job is launched: the argv and the extra environment. The one place to swap torchrun for rally."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), str(TRAIN), *script_args,
    ]  # fmt: skip
    env = {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # torchrun 2.13 cannot restart gloo workers without it
        "RES_OPTIONS": "timeout:1 attempts:1",  # see DESIGN.md: TCPStore reverse-DNS stalls
    }
    return argv, env


def run_job(script_args: list[str], *, nproc: int = 2, max_restarts: int = 2, timeout: float = 110) -> tuple[str, str]:
    """Run one job to completion in its own process group; return (stdout, stderr) after asserting success."""
    argv, extra_env = launcher_command(script_args, nproc=nproc, max_restarts=max_restarts)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra_env)
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return stdout, stderr


def params_hash(stdout: str) -> str:
    match = re.search(r"^params sha256 ([0-9a-f]{64})$", stdout, re.MULTILINE)
    assert match, f"no final hash in output:\n{stdout[-2000:]}"
    return match.group(1)


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_worker_killed_mid_run_and_restarted_ends_with_bit_identical_parameters(tmp_path: Path) -> None:
    import torch

    common = ["--steps", "30", "--checkpoint-every", "5"]
    clean_out, _ = run_job([*common, "--checkpoint-dir", str(tmp_path / "clean"), "--out", str(tmp_path / "clean.pt")])
    assert "step 30 loss" in clean_out

    killed_out, killed_err = run_job([
        *common, "--checkpoint-dir", str(tmp_path / "killed"), "--out", str(tmp_path / "killed.pt"),
        "--fail-at-step", "17", "--fail-rank", "1",
    ])  # fmt: skip
    assert "rank 1: killing myself at step 17" in killed_err
    assert "rally: resuming from step 15" in killed_err  # the restart resumed from the last checkpoint

    assert params_hash(killed_out) == params_hash(clean_out)
    clean = torch.load(tmp_path / "clean.pt", weights_only=True)
    killed = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert clean.keys() == killed.keys() and all(torch.equal(clean[k], killed[k]) for k in clean)
