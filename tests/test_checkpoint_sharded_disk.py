"""An FSDP2 job resumes bit-identical after a SIGKILL of one rank from disk
too, with the memory tier off (RALLY_MEMORY_TIER=0: every sharded save is DCP's synchronous save
published by rally). tests/test_sharded_jobs.py covers the memory tier; the workload is the same
examples/train_fsdp.py, whose ranks print the sha256 of the full state at every save and resume,
compared with the session's one uninterrupted run (tests/support/fsdp_reference.py: the state it saved at
step N is the state a run of N steps ends with).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rally.agent.checkpoint.sharded import files as dcp_files
from support.fsdp_reference import EVERY, TRAIN, digests
from support.helpers import clean_env, run_rally

STEPS = 12  # of the reference's 24

pytestmark = pytest.mark.torch


@pytest.mark.timeout(400)
def test_fsdp2_job_resumes_bit_identical_from_disk_after_a_sigkill_with_the_memory_tier_off(
    tmp_path: Path, fsdp_reference: dict[int, str]
) -> None:
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--checkpoint-dir", str(tmp_path / "killed"), str(TRAIN), "--steps", str(STEPS),
            "--checkpoint-every", str(EVERY), "--fail-at-step", "7", "--fail-rank", "1"]  # fmt: skip
    killed = run_rally(args, cwd=tmp_path, env=clean_env(RALLY_MEMORY_TIER="0"), timeout=300)
    assert killed.returncode == 0, killed.describe()
    assert "SIGKILL" in killed.stderr, killed.describe()
    resumed = [(step, world, digest) for step, world, digest in digests(killed.stdout, "start") if step > 0]
    assert resumed == [(6, 2, fsdp_reference[6])] * 2, killed.describe()  # both ranks, from step 6's files
    assert re.search(r"resuming from step 6 \(\S*step_000000000006\.dcp, sharded, world size 2\)", killed.stderr), (
        killed.describe()
    )
    assert {d for _, _, d in digests(killed.stdout, "final")} == {fsdp_reference[STEPS]}
    assert dcp_files.newest_intact_step(tmp_path / "killed") == STEPS
