"""pytest plugin: the uninterrupted FSDP2 run that the sharded-checkpoint tests compare with, once
per session.

tests/test_sharded_jobs.py (memory tier, node losses) and tests/test_checkpoint_sharded_disk.py
(the tier off) each prove that a job of examples/train_fsdp.py resumes with the very state of an
uninterrupted run: at every save and after a resume each rank prints the sha256 of the full model
and optimizer state. That run is the same for both (deterministic: fixed seeds, gloo, one
intra-op thread per worker; how a step is saved does not change the training), so the session
makes it once (two torch workers fewer; tests/support/once_per_run.py: once for all pytest-xdist workers too).

Loaded from tests/conftest.py (``pytest_plugins``), as tests/support/ddp_reference.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.helpers import clean_env, finish, start_rally
from support.once_per_run import once_per_run

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_fsdp.py"
STEPS, EVERY = 24, 2
LINE = re.compile(r"\b(start|saved|final) step (\d+) world (\d+) digest ([0-9a-f]{64})$")


def digests(text: str, kind: str) -> list[tuple[int, int, str]]:
    """(step, world size, digest) of every `kind` line the workers printed, in order."""
    found = []
    for line in text.splitlines():
        match = LINE.search(line)
        if match and match.group(1) == kind:
            found.append((int(match.group(2)), int(match.group(3)), match.group(4)))
    return found


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Digest of the full state at every saved step (2, 4, ... STEPS), and at the end (key
    STEPS + 1), of an uninterrupted two-rank run (`--checkpoint-every EVERY`)."""

    def run() -> list[tuple[int, str]]:
        tmp = tmp_path_factory.mktemp("fsdp-reference")
        args = [
            "--checkpoint-dir",
            str(tmp / "ckpt"),
            str(TRAIN),
            "--steps",
            str(STEPS),
            "--checkpoint-every",
            str(EVERY),
        ]
        proc = start_rally(["--standalone", "--nproc-per-node", "2", *args], cwd=tmp, env=clean_env())
        result = finish(proc, 240)
        assert result.returncode == 0, result.describe()
        saved = {step: digest for step, world, digest in digests(result.stdout, "saved") if world == 2}
        assert sorted(saved) == list(range(EVERY, STEPS + 1, EVERY)), result.describe()
        (final,) = {digest for _, _, digest in digests(result.stdout, "final")}
        return sorted((saved | {STEPS + 1: final}).items())

    # pairs, not a dict: JSON (once_per_run) would turn the steps into strings
    return {int(step): str(digest) for step, digest in once_per_run(tmp_path_factory, "fsdp-reference", run)}
