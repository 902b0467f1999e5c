"""A sharded job's last step is saved before it ends: when a job fails for good, the agent first makes the newest
sharded (DCP) step that is only in memory durable on disk, bounded by the grace period.

The job is two ranks holding one DTensor (Shard(0) over a gloo CPU mesh; no model, a few bytes).
Step 1 is saved and made durable by the workers' own background persister. Step 2 is saved to
memory while the persister is stuck (as on a slow disk: the script swaps its submit for one that
never writes), then rank 0 SIGKILLs itself: with --max-restarts 0 the job has failed for good, and
step 2 exists only in the holder's memory. The agent's breakpoint save must publish it as an
intact DCP directory whose shards are step 2's values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rally.agent.checkpoint.sharded import files as dcp_files
from support.helpers import clean_env, read_events, run_rally, write_probe

SCRIPT = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from rally import job
from rally.agent.checkpoint.sharded import persist as dcp_persist

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
ckpt = job.context().checkpoint_dir
for step in (1, 2):
    if step == 2:  # the disk write of step 2 never happens in the workers
        dcp_persist.persister().submit = lambda *args, **kwargs: None
    full = torch.arange(8, dtype=torch.float32) + 100 * step
    job.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, step)
    if step == 1:
        while not dcp_files.is_intact(ckpt / dcp_files.step_name(1)):
            time.sleep(0.02)
    dist.barrier()
print(f"rank {rank} saved 2", flush=True)
if rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
""".replace(
    "from rally import job", "from rally import job\nfrom rally.agent.checkpoint.sharded import files as dcp_files"
)

LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
state = {"w": torch.zeros(8)}
dcp.load(state, checkpoint_id=sys.argv[1], no_dist=True)
print(state["w"].tolist())
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_a_sharded_step_only_in_memory_is_made_durable_when_the_job_fails_for_good(tmp_path: Path) -> None:
    script = write_probe(tmp_path / "shards.py", SCRIPT)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    result = run_rally(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
        + ["--log-dir", str(logs), "--checkpoint-dir", str(ckpt), str(script)],
        cwd=tmp_path, env=clean_env(), timeout=200,
    )  # fmt: skip
    assert result.returncode != 0, result.describe()
    assert "rank 1 saved 2" in result.stdout, result.describe()
    published = ckpt / dcp_files.step_name(2)
    assert dcp_files.is_intact(published), result.describe()
    assert dcp_files.newest_intact_step(ckpt) == 2
    assert [n.name for n in ckpt.iterdir() if dcp_files.TEMP_RE.match(n.name)] == []
    assert "sharded checkpoint step 2 was only in memory: written to" in result.stdout + result.stderr, (
        result.describe()
    )
    events = read_events(logs)
    assert any(
        e.get("event") == "checkpoint_durable" and e.get("step") == 2 and e.get("where") == "breakpoint" for e in events
    ), events
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD, str(published)], capture_output=True, text=True, timeout=120, check=False
    )
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout) == [200.0 + i for i in range(8)]
