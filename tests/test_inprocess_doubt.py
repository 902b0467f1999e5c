"""A worker whose state is in doubt after a failure makes the whole job restart (docs/restartable.md):
its teardown between two entries failed (here destroying the process group raises what a sticky
CUDA error raises there: every CUDA call fails once one kernel faulted), so rally restarts every
worker process instead of re-entering any, saying which rank and why in one line, and counts it as
one whole restart; the new processes resume from the latest checkpoint, bit-identical to a clean run.

Real rally and tests/test_inprocess_restart.py's job (two ranks on gloo, a DDP model, the node's
memory tier), with rank 1's first process made to fail its teardown.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.helpers import clean_env, rally_status, read_events, run_rally
from test_inprocess_restart import TRAIN, _steps, clean_digest  # noqa: F401

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
def test_a_failed_teardown_restarts_every_process_said_in_one_line_and_resumes_from_the_checkpoint(
    tmp_path: Path,
    clean_digest: str,  # noqa: F811
) -> None:
    out, logs = tmp_path / "fault", tmp_path / "fault-logs"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(BROKEN_TEARDOWN + TRAIN)
    argv = ["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(logs), str(script)]
    result = run_rally(argv, cwd=tmp_path, env=clean_env(OUT=str(out), FAULT="exception:5:1"), timeout=150)
    text = result.describe()
    assert result.returncode == 0, text
    for rank in (0, 1):  # a new process for each rank, entered once, resuming after the step-3 save
        final = json.loads((out / f"result.{rank}").read_text())
        assert final["digest"] == clean_digest and final["entries"] == 1, (rank, final, text)
        old = [int(s[0]) for s in _steps(out, rank) if s[2] != str(final["pid"])]
        new = [int(s[0]) for s in _steps(out, rank) if s[2] == str(final["pid"])]
        assert old == [1, 2, 3, 4, 5][: len(old)] and len(old) >= 4 and new == list(range(4, 13)), (rank, text)
        assert len({s[2] for s in _steps(out, rank)}) == 2, (rank, text)  # its pid changed
    why = (
        "rank 1's state is in doubt: it could not tear torch.distributed down (RuntimeError: CUDA error: an "
        "illegal memory access was encountered)"
    )
    assert result.stderr.count(f"restarting the worker processes instead of re-entering them: {why}") == 1, text
    assert "restarting all workers (restart 1 of 2)" in result.stderr, text
    assert "re-entering the training function" not in result.stderr and "a new process takes" not in text, text
    events = read_events(logs)
    assert [(e["kind"], e["in_process"]) for e in events if e["event"] == "restart"] == [("worker_failed", False)]
    assert [e["reason"] for e in events if e["event"] == "reentry_refused"] == [why], events
    assert not [e for e in events if e["event"] in ("workers_parked", "worker_reentered")], events
    shown = rally_status([str(logs)], Path("/"))  # the job is over: from events.jsonl, a whole restart
    assert "last restart: round 0 ended (worker_failed): rank 1" in shown.stdout, shown.describe()
    report = json.loads(next(logs.glob("*/report.json")).read_text())
    assert [a.get("recovery") for a in report["attempts"]] == [None, None], report["attempts"]
