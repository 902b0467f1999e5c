"""What an in-process restart costs the survivors (docs/restartable.md, "Measured"): the teardown
between two entries does not scan the objects the script built before `rally.job.run`.

A real script under real rally, two ranks on gloo, with two million objects built before
`job.run` (a big model's and data pipeline's Python objects): rank 1 raises at its first entry,
rank 0 is released from its collective, both re-enter. The teardown's collection of the last
entry's cycles (agent/worker_side/restartable.py) took 0.1-0.3 s here when it scanned everything
the process held, the largest part of an exception's recovery in the benchmark's job; with the
objects alive at the entry frozen out of the collector it takes milliseconds.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally

pytestmark = pytest.mark.torch

SCRIPT = textwrap.dedent(
    """
    import json, os
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job
    from rally.agent.worker_side import restartable

    OUT = Path(os.environ["OUT"])
    ballast = [[] for _ in range(2_000_000)]  # built once, before job.run: it lives across entries
    dist.init_process_group("gloo")
    entries = 0

    def train():
        global entries
        entries += 1
        rank = dist.get_rank()
        flag = torch.ones(1)
        dist.all_reduce(flag)
        if entries == 1:
            if rank == 1:
                raise ValueError("injected")
            dist.all_reduce(flag)  # blocked until rank 1's teardown releases it
        (OUT / f"timeline.{rank}").write_text(json.dumps({**restartable.timeline, "entries": entries}))

    job.run(train)
    """
)


@pytest.mark.timeout(300)
def test_the_teardown_between_entries_does_not_scan_what_the_script_built_before(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = ["--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), str(script)]
    result = run_rally(argv, cwd=tmp_path, env=clean_env(OUT=str(out)), timeout=240)
    assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        timeline = json.loads((out / f"timeline.{rank}").read_text())
        assert timeline["entries"] == 2, result.describe()  # re-entered, not restarted
        collecting = timeline["collected"] - timeline["destroyed"]
        # a full scan of the 2,000,000 objects: 0.1-0.3 s on this 2-core machine
        assert collecting < 0.05, f"rank {rank}'s teardown collected for {collecting:.3f} s\n{result.describe()}"
