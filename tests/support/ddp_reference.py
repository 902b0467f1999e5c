"""pytest plugin: the uninterrupted DDP run that the DDP fault tests compare with, once per session.

tests/test_example_train.py (random SIGKILLs), tests/test_faults_memory_tier.py (a SIGKILL
resumed from memory, from disk, on two nodes) and tests/test_checkpoint_node_loss.py (a whole node
lost, a spare in its place) each prove that a job ends with the parameters of an
uninterrupted run of examples/train.py: 2 workers, STEPS steps, a checkpoint every EVERY. That
run is the same for all of them (deterministic: fixed seeds, gloo, one intra-op thread per
worker), so the test run makes it once (two torch workers fewer per module; tests/support/once_per_run.py: once
for all pytest-xdist workers too).

Loaded from tests/conftest.py (``pytest_plugins``), so every module shares the one fixture.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally
from support.once_per_run import once_per_run

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
STEPS, EVERY = 30, 5


def params_hash(text: str) -> str:
    """The sha256 of the final parameters that rank 0 of examples/train.py prints last: exactly
    one in a job's output (a job that printed two finished twice)."""
    found = re.findall(r"params sha256 ([0-9a-f]{64})", text)
    assert len(found) == 1, f"expected one final hash in:\n{text[-3000:]}"
    return found[0]


@pytest.fixture(scope="session")
def ddp_clean_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final parameters' sha256 of an uninterrupted 2-worker run of examples/train.py."""

    def run() -> str:
        tmp = tmp_path_factory.mktemp("ddp-clean")
        args = [
            "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--checkpoint-dir", str(tmp / "ckpt"),
            str(TRAIN), "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
        ]  # fmt: skip
        result = run_rally(args, cwd=tmp, env=clean_env(), timeout=240)
        assert result.returncode == 0, result.describe()
        assert f"step {STEPS} loss" in result.stdout, result.describe()
        return params_hash(result.stdout)

    return str(once_per_run(tmp_path_factory, "ddp-clean-hash", run))
