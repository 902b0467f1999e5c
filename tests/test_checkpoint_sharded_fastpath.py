"""Sharded saves at memory speed: after the first save of a
layout, ``job.save`` of DTensors copies the shards straight into the memory slot
(agent/checkpoint/sharded/layout.py), and a rank whose disk writer falls behind gives up a step
still waiting in a slot the next save needs (agent/checkpoint/sharded/persist.py) instead of
stalling the training step. The rule tested: a step given up by one rank is published by none,
every published step holds every rank's part intact, the newest step is never the one given up,
and both the memory copy and the disk copy of the newest step load back bit-identical.

A real two-rank DTensor job under rally. Rank 1's disk is made slow by delaying its writer's
file writes (the only fault injected: the files are still written, fsynced and renamed), and
the job saves back to back, so its writer must fall behind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rally.agent.checkpoint.sharded import files as dcp_files
from support.helpers import clean_env, run_rally

STEPS = 8

WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from rally import job
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.checkpoint.sharded import memory as dcp_memory
from rally.agent.checkpoint.sharded import persist as dcp_persist

STEPS, SLOW, DIR = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:  # a slow disk: every file of this rank's writer is written late
    real_write = dcp_persist.write_file
    def slow_write(path, data, *pause):
        time.sleep(SLOW)
        return real_write(path, data, *pause)
    dcp_persist.write_file = slow_write
mesh = init_device_mesh("cpu", (2,))

def make(value):
    local = {f"w{i}": torch.full((50_000 + i,), value + i + rank / 2) for i in range(4)}
    return {**{k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()},
            "meta": {"lr": 0.5, "name": "fast"}}

def values(state):
    return {k: v.to_local().clone() for k, v in state.items() if k != "meta"}

state = make(0.0)
for step in range(1, STEPS + 1):
    for v in state.values():
        if isinstance(v, DTensor):
            v.to_local().fill_(step * 100.0)
    state["w0"].to_local()[0] = step + rank / 4  # differs per step and per rank
    job.save(state, step)
    time.sleep(0.02)
expected = values(state)
fast = bool(dcp_memory._layouts)
dcp_persist.persister().wait(120)
dist.barrier()  # every rank's writer is done: rank 0 has published what it could
from_memory = make(-1.0)
ckpt = job.load_latest(into=from_memory)
memory_ok = ckpt is not None and ckpt.step == STEPS and ckpt.source == "memory" and all(
    torch.equal(from_memory[k].to_local(), v) for k, v in expected.items())
from_disk = make(-1.0)
dcp.load(from_disk, storage_reader=FileSystemReader(os.path.join(DIR, dcp_files.step_name(STEPS))))
disk_ok = all(torch.equal(from_disk[k].to_local(), v) for k, v in expected.items()) and from_disk["meta"]["lr"] == 0.5
print("RESULT " + json.dumps({"rank": rank, "skipped": dcp_persist.persister().skipped, "fast": fast,
                              "memory_ok": memory_ok, "disk_ok": disk_ok}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_step_one_rank_gives_up_is_published_by_none_and_the_newest_survives(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ckpt = tmp_path / "ckpt"
    args = ["--standalone", "--nproc-per-node", "2", "--checkpoint-dir", str(ckpt),
            str(script), str(STEPS), "0.15", str(ckpt)]  # fmt: skip
    result = run_rally(args, cwd=tmp_path, env=clean_env(), timeout=240)
    assert result.returncode == 0, result.describe()
    lines = [line.split("RESULT ", 1)[1] for line in result.stdout.splitlines() if "RESULT " in line]
    reports = {r["rank"]: r for r in map(json.loads, lines)}
    assert sorted(reports) == [0, 1], result.describe()
    assert all(r["fast"] for r in reports.values()), reports  # the fast path was taken
    assert all(r["memory_ok"] and r["disk_ok"] for r in reports.values()), reports
    given_up = set(reports[0]["skipped"]) | set(reports[1]["skipped"])
    assert given_up, f"rank 1's slow writer never fell behind: the rule was not exercised ({reports})"
    assert STEPS not in given_up, reports  # the newest step is never the one given up
    published = [step for step, _ in dcp_files.list_steps(ckpt)]
    assert published and published[-1] == STEPS, (published, reports)
    assert not set(published) & given_up, (published, reports)  # given up by one rank: published by none
    for step, path in dcp_files.list_steps(ckpt):
        dcp_files.verify(path)  # every file's size and CRC-32 as its manifest says
        assert set(dcp_files.manifest_files(path)) >= {"__0_0.distcp", "__1_0.distcp", ".metadata"}, step


@pytest.mark.timeout(60)
def test_rank_zero_stops_waiting_for_a_part_another_rank_gave_up(tmp_path: Path) -> None:
    """Rank 0's writer does not wait (PUBLISH_TIMEOUT, minutes) for a part that rank 1 marked given up,
    and publishes nothing of that step; a rank other than 0 writes nothing of a step rank 0 gave up."""
    from rally.agent.checkpoint.sharded import persist as dcp_persist

    temp = tmp_path / dcp_persist.temp_name(5)
    temp.mkdir()
    (temp / "__1.skipped").touch()
    writer = dcp_persist.Persister()
    started = time.monotonic()
    writer.submit(tmp_path, 5, 3, 0, 2, b"metadata", b"shards of rank 0")
    assert writer.wait(30)
    assert time.monotonic() - started < 10
    assert writer.last_error is None
    assert dcp_files.list_steps(tmp_path) == []
    other = tmp_path / dcp_persist.temp_name(6)
    other.mkdir()
    (other / "__0.skipped").touch()
    writer.submit(tmp_path, 6, 3, 1, 2, b"metadata", b"shards of rank 1")
    assert writer.wait(30)
    assert writer.last_error is None
    assert sorted(p.name for p in other.iterdir()) == ["__0.skipped"]


@pytest.mark.timeout(60)
def test_a_step_saved_in_one_round_is_written_into_that_rounds_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rally.job.run re-enters the function in the same process with the next round's RALLY_ROUND,
    while the writer may still have steps of the old round to write: such a step's part went into
    the new round's temporary directory of that step, where the new round's ranks write theirs
    when they save it again, and rank 0 published a step made of both rounds' parts."""
    from rally.agent.checkpoint.sharded import persist as dcp_persist

    monkeypatch.setenv("RALLY_ROUND", "3")
    saved_in = tmp_path / dcp_persist.temp_name(5)
    writer = dcp_persist.Persister()
    with writer.cond:  # the writer starts on the step only once the worker is in round 4
        writer.submit(tmp_path, 5, 3, 1, 2, b"metadata", b"shards of rank 1 in round 3")
        monkeypatch.setenv("RALLY_ROUND", "4")
    assert writer.wait(30) and writer.last_error is None
    assert not (tmp_path / dcp_persist.temp_name(5)).exists(), "round 3's part is in round 4's directory"
    assert (saved_in / "__1_0.distcp").read_bytes() == b"shards of rank 1 in round 3"
