"""A worker whose state is in doubt after a failure is not re-entered (docs/restartable.md):
its teardown between two entries failed (here destroying the process group
raises what a sticky CUDA error raises there: every CUDA call fails once one kernel faulted), so
rally kills that process and a new one takes its rank, saying why in one line; the ranks whose
teardown succeeded re-enter in their own processes, and the job ends bit-identical to a clean run.

Real rally and tests/test_inprocess_restart.py's job (two ranks on gloo, a DDP model, the node's
memory tier), with rank 1's first process made to fail its teardown.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from support.helpers import clean_env, read_events, run_rally
from test_inprocess_restart import TRAIN, _rank_1_replaced_and_rank_0_re_entered, clean_digest  # noqa: F401

pytestmark = pytest.mark.torch

# Rank 1's first process only (the fault's marker is not written yet): its teardown raises
BROKEN_TEARDOWN = textwrap.dedent(
    """
    import os as _os
    from pathlib import Path as _Path
    if _os.environ["RANK"] == "1" and not (_Path(_os.environ["OUT"]) / "fault.done").exists():
        import torch.distributed as _dist

        def _destroy(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        _dist.destroy_process_group = _destroy
    """
)


@pytest.mark.timeout(400)
def test_a_failed_teardown_replaces_that_process_said_in_one_line_and_the_others_re_enter(
    tmp_path: Path,
    clean_digest: str,  # noqa: F811
) -> None:
    out, logs = tmp_path / "fault", tmp_path / "fault-logs"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(BROKEN_TEARDOWN + TRAIN)
    argv = ["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(logs), str(script)]
    result = run_rally(argv, cwd=tmp_path, env=clean_env(OUT=str(out), FAULT="exception:5:1"), timeout=150)
    assert result.returncode == 0, result.describe()
    _rank_1_replaced_and_rank_0_re_entered(result, out, clean_digest)
    line = (
        "rank 1 could not tear torch.distributed down (RuntimeError: CUDA error: an illegal memory access was "
        "encountered): killing it; a new process takes its place"
    )
    assert result.stderr.count(line) == 1, result.describe()
    assert "restarting the worker processes instead" not in result.stderr, result.describe()
    events = read_events(logs)
    assert [(e["kind"], e["in_process"]) for e in events if e["event"] == "restart"] == [("worker_failed", True)]
    assert [e["replaced"] for e in events if e["event"] == "workers_parked"] == [1], events
    reentered = [(e["rank"], e["round"]) for e in events if e["event"] == "worker_reentered"]
    started = [(e["rank"], e["round"]) for e in events if e["event"] == "worker_started"]
    assert reentered == [(0, 1)] and started == [(0, 0), (1, 0), (1, 1)], events
