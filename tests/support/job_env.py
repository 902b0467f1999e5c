"""The set-up of tests that call `rally.job` (agent/worker_side/job.py) in this process or in helper
processes of their own, outside any launcher: tests/test_job_helper.py, test_faults_checkpoint.py
and test_faults_sharded_checkpoint.py share it, so a variable the job module starts reading is
cleared in one place for all of them.

Import the fixtures into the test module for pytest to see them
(``from job_env import ckpt_dir, clean_job_env``); `clean_job_env` is autouse there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rally.agent.worker_side import job

# What a launcher (torchrun, rally) or rally's agent sets for a worker and `rally.job` reads.
JOB_ENV = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    job.CHECKPOINT_DIR_ENV, job.CHECKPOINT_KEEP_ENV, job.HEARTBEAT_FILE_ENV, job.PREEMPT_SIGNALS_ENV,
]  # fmt: skip


def outside_env(**extra: str) -> dict[str, str]:
    """Environment for a helper process: this one's without any JOB_ENV variable, plus ``extra``."""
    return {k: v for k, v in os.environ.items() if k not in JOB_ENV} | extra


@pytest.fixture(autouse=True)
def clean_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a plain process outside any launcher."""
    for name in JOB_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checkpoint directory `rally.job` uses (RALLY_CHECKPOINT_DIR), not created yet: the
    first save creates it."""
    directory = tmp_path / "ckpt"
    monkeypatch.setenv(job.CHECKPOINT_DIR_ENV, str(directory))
    return directory
