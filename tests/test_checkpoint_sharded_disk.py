"""Issue 17, Must show: an FSDP2 job resumes bit-identical after a SIGKILL of one rank from disk
too, with the memory tier off (RALLY_MEMORY_TIER=0: every sharded save is DCP's synchronous save
published by rally). tests/test_sharded_jobs.py covers the memory tier; the workload is the same
examples/train_fsdp.py, whose ranks print the sha256 of the full state at every save and resume.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import clean_env, run_rally
from rally.agent.checkpoint import dcp_files

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_fsdp.py"
STEPS, EVERY = 12, 2
LINE = re.compile(r"\b(start|saved|final) step (\d+) world (\d+) digest ([0-9a-f]{64})$", re.M)

pytestmark = pytest.mark.torch


def digests(text: str, kind: str) -> list[tuple[int, str]]:
    return [(int(m.group(2)), m.group(4)) for m in LINE.finditer(text) if m.group(1) == kind]


@pytest.mark.timeout(400)
def test_fsdp2_job_resumes_bit_identical_from_disk_after_a_sigkill_with_the_memory_tier_off(tmp_path: Path) -> None:
    def run(name: str, *extra: str):  # noqa: ANN202
        args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                "--checkpoint-dir", str(tmp_path / name),
                str(TRAIN), "--steps", str(STEPS), "--checkpoint-every", str(EVERY), *extra]  # fmt: skip
        return run_rally(args, cwd=tmp_path, env=clean_env(RALLY_MEMORY_TIER="0"), timeout=300)

    reference = run("reference")
    assert reference.returncode == 0, reference.describe()
    saved = dict(digests(reference.stdout, "saved"))
    killed = run("killed", "--fail-at-step", "7", "--fail-rank", "1")
    assert killed.returncode == 0, killed.describe()
    assert "SIGKILL" in killed.stderr, killed.describe()
    resumed = [(step, digest) for step, digest in digests(killed.stdout, "start") if step > 0]
    assert resumed == [(6, saved[6])] * 2, killed.describe()  # both ranks, from step 6's files
    assert re.search(r"resuming from step 6 \(\S*step_000000000006\.dcp, sharded, world size 2\)", killed.stderr), (
        killed.describe()
    )
    assert {d for _, d in digests(killed.stdout, "final")} == {d for _, d in digests(reference.stdout, "final")}
    assert dcp_files.newest_intact_step(tmp_path / "killed") == STEPS
