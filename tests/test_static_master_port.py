"""The static backend gives workers MASTER_ADDR/MASTER_PORT = --master-addr/--master-port, as
torchrun does (a cluster opens one port), and a restart still never sees the previous
attempt's keys: node 0 deletes them from that store before the next round's workers start.

Two rally processes on 127.0.0.1 stand in for two nodes; their workers join one gloo process
group through env:// and all_reduce a tensor. Rank 1 fails once after the first all_reduce;
both nodes restart, and the second attempt's process group forms on the same port.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.agents import start_agent, stop_all, write_script
from support.helpers import free_port, run_rally

WORKER = """
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
record = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "TORCHELASTIC_RESTART_COUNT")}
record["sum"] = total.item()
with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}_restart{restart}.json"), "w") as f:
    json.dump(record, f)
if restart == 0:
    if rank == 1:
        sys.exit(3)  # the injected failure, after the process group has written its keys
    dist.all_reduce(total)  # rank 0 waits here until rally stops it
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_static_two_node_job_uses_the_master_port_and_restarts_cleanly(tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", WORKER)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "static",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "1",
        "--shutdown-timeout", "5",
    ]  # fmt: skip
    agents = [
        start_agent(
            f"node{rank}", tmp_path, [*common, "--node-rank", str(rank), str(script)], env={"OUT_DIR": str(out)}
        )
        for rank in (0, 1)
    ]
    try:
        codes = [agent.wait(180) for agent in agents]
        outputs = "\n".join(f"--- {a.name}\n{a.output()}" for a in agents)
        assert codes == [0, 0], outputs
        records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
        assert sorted(records) == ["rank0_restart0", "rank0_restart1", "rank1_restart0", "rank1_restart1"], outputs
        for record in records.values():
            assert (record["MASTER_ADDR"], record["MASTER_PORT"]) == ("127.0.0.1", str(port))
            assert record["sum"] == 3.0  # 1 + 2: a real all_reduce across both nodes
        for agent in agents:
            assert "root cause: rank 1" in agent.output() and "exit code 3" in agent.output(), outputs
    finally:
        stop_all(agents)


TCP_INIT = """
import os, sys
import torch
import torch.distributed as dist

# As PyTorch's launcher test: the store at --master-port, named by a tcp:// init method.
dist.init_process_group("gloo", init_method=f"tcp://localhost:{sys.argv[1]}", rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
total = torch.tensor([1.0])
dist.all_reduce(total)
print("sum", int(total.item()))
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_workers_reach_the_master_port_s_store_through_a_tcp_init_method(tmp_path: Path) -> None:
    """`--master-addr localhost --master-port P` and workers that init_process_group with
    tcp://localhost:P: they use the store rally serves there (TORCHELASTIC_USE_AGENT_STORE), so
    no worker tries to bind the port itself."""
    script = write_script(tmp_path, "tcp_init.py", TCP_INIT)
    port = free_port()
    args = ["--nnodes=1", "--nproc-per-node=3", "--master-addr=localhost", f"--master-port={port}", "--run-path"]
    result = run_rally([*args, str(script), str(port)], cwd=tmp_path, timeout=150)
    assert result.returncode == 0, result.describe()
    assert sorted(line for line in result.stdout.splitlines() if "sum" in line) == [f"[{r}] sum 3" for r in range(3)]
