"""Fault matrix, sharded checkpoints (torch.distributed.checkpoint under job.save/load_latest):
the directory is torch's own format, a save killed before its publication or failing midway
leaves the previous step, damaged shards are skipped by every reader alike.

One process (world size 1, no process group) is enough for what happens on disk; the multi-rank
and multi-node behaviour is in tests/test_sharded_jobs.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.worker_side import job
from support.job_env import ckpt_dir, clean_job_env, outside_env  # noqa: F401 - fixtures

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def state_of(value: float) -> dict:
    import torch

    return {"model": {"w": torch.full((64, 32), value), "b": torch.arange(7.0) * value}, "meta": {"epoch": int(value)}}


def template() -> dict:
    return state_of(0.0)


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.timeout(60)
def test_a_sharded_save_is_a_plain_dcp_directory_that_load_latest_fills_in_place(
    ckpt_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    path = job.save(state_of(3.0), 12, sharded=True)
    assert path == ckpt_dir / "step_000000000012.dcp" and entries(ckpt_dir) == ["step_000000000012.dcp"]
    assert {".metadata", "rally.json", "__0_0.distcp"} <= set(entries(path))

    plain = template()  # torch alone reads it: the format is DCP's, rally.json is ignored
    dcp.load(plain, checkpoint_id=str(path))
    assert torch.equal(plain["model"]["w"], torch.full((64, 32), 3.0)) and plain["meta"]["epoch"] == 3

    into = template()
    ckpt = job.load_latest(into=into)
    assert ckpt is not None and ckpt.step == 12 and ckpt.path == path and ckpt.state is into
    assert torch.equal(into["model"]["b"], torch.arange(7.0) * 3.0) and into["meta"]["epoch"] == 3
    assert "rally: resuming from step 12" in capsys.readouterr().err
    assert job.newest_checkpoint_step(ckpt_dir) == 12


@pytest.mark.timeout(60)
def test_sharded_saves_keep_the_newest_k_and_load_latest_without_into_ignores_them(ckpt_dir: Path) -> None:
    for step in (2, 4, 6, 8):
        job.save(state_of(float(step)), step, keep=2, sharded=True)
    assert entries(ckpt_dir) == ["step_000000000006.dcp", "step_000000000008.dcp"]
    assert job.load_latest() is None  # whole-state files only: none here
    assert job.load_latest(into=template()).step == 8  # type: ignore[union-attr]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "damage",
    ["flip a byte of a shard", "truncate a shard", "delete the metadata", "no manifest", "garbage manifest"],
)
def test_a_damaged_newest_sharded_checkpoint_is_skipped_by_load_latest_and_the_agent(
    ckpt_dir: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    job.save(state_of(1.0), 1, sharded=True)
    newest = job.save(state_of(2.0), 2, sharded=True)
    shard = newest / "__0_0.distcp"
    if damage == "flip a byte of a shard":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate a shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "delete the metadata":
        (newest / ".metadata").unlink()
    elif damage == "no manifest":  # e.g. a directory written by plain torch.distributed.checkpoint
        (newest / "rally.json").unlink()
    else:
        (newest / "rally.json").write_text("{not json")

    into = template()
    ckpt = job.load_latest(into=into)
    assert ckpt is not None and ckpt.step == 1 and torch.equal(into["model"]["w"], torch.full((64, 32), 1.0))
    assert f"checkpoint {newest} is damaged" in capsys.readouterr().err
    assert job.newest_checkpoint_step(ckpt_dir) == 1  # the crash-loop guard counts the same step


SAVER_KILLED_BEFORE_PUBLISHING = """
    import sys
    import torch
    from rally import job
    from rally.agent.checkpoint.sharded import files as dcp_files

    job.save({"w": torch.full((1000,), 1.0)}, 1, sharded=True)

    def stall(self, files):  # every rank's file and the metadata are written; the rename is next
        print("publishing", flush=True)
        sys.stdin.readline()

    dcp_files.TempDir.publish = stall
    job.save({"w": torch.full((1000,), 2.0)}, 2, sharded=True)
"""


@pytest.mark.timeout(90)
def test_a_save_killed_before_its_rename_leaves_the_previous_step_and_the_next_save_removes_its_directory(
    ckpt_dir: Path,
) -> None:
    import torch

    env = outside_env(**{job.CHECKPOINT_DIR_ENV: str(ckpt_dir)})
    saver = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(SAVER_KILLED_BEFORE_PUBLISHING)], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert saver.stdout is not None and saver.stdout.readline().strip() == "publishing", saver.stderr.read()  # type: ignore[union-attr]
        temps = [name for name in entries(ckpt_dir) if dcp_files.TEMP_RE.match(name)]
        assert len(temps) == 1 and {".metadata", "__0_0.distcp"} <= set(entries(ckpt_dir / temps[0]))
        dcp_files.remove_dead_saves(ckpt_dir)  # its saver is alive and holds the lock: kept
        assert temps[0] in entries(ckpt_dir)
    finally:
        os.killpg(saver.pid, signal.SIGKILL)
        saver.wait(10)

    into = {"w": torch.zeros(1000)}
    assert job.load_latest(into=into).step == 1 and torch.equal(into["w"], torch.full((1000,), 1.0))  # type: ignore[union-attr]
    assert job.newest_checkpoint_step(ckpt_dir) == 1
    job.save({"w": torch.full((1000,), 3.0)}, 3, sharded=True)
    assert entries(ckpt_dir) == ["step_000000000001.dcp", "step_000000000003.dcp"]  # the dead save's directory is gone


@pytest.mark.timeout(60)
def test_a_sharded_save_that_fails_midway_raises_and_leaves_the_last_good_step(ckpt_dir: Path) -> None:
    import threading

    job.save(state_of(1.0), 1, sharded=True)
    bad = state_of(2.0) | {"lock": threading.Lock()}  # not picklable: fails while the rank writes
    with pytest.raises(
        RuntimeError, match=r"^rally: sharded checkpoint of step 2 in .* failed on rank 0: TypeError: cannot pickle"
    ):
        job.save(bad, 2, sharded=True)
    assert entries(ckpt_dir) == ["step_000000000001.dcp"]
    assert job.load_latest(into=template()).step == 1  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_saving_a_step_again_replaces_its_directory_whole(ckpt_dir: Path) -> None:
    import torch

    job.save(state_of(1.0), 5, sharded=True)
    job.save(state_of(7.0), 5, sharded=True)
    assert entries(ckpt_dir) == ["step_000000000005.dcp"]
    into = template()
    assert job.load_latest(into=into).step == 5 and torch.equal(into["model"]["w"], torch.full((64, 32), 7.0))  # type: ignore[union-attr]


@pytest.mark.timeout(30)
def test_plain_tensors_are_not_sharded_and_need_no_torch_distributed_import() -> None:
    import torch

    assert not dcp_files.holds_shards({"model": {"w": torch.zeros(3)}, "step": 1})
    assert not dcp_files.holds_shards([1, "x", None])


DISK_FULL = """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from rally import job

    job.save({"w": torch.full((4096,), 1.0)}, 1, sharded=True)
    try:
        job.save({"w": torch.full((1 << 20,), 2.0)}, 2, sharded=True)  # 4 MB into a 512 KB file system
        error = None
    except RuntimeError as exc:
        error = str(exc)
    into = {"w": torch.zeros(4096)}
    ckpt = job.load_latest(into=into)
    left = sorted(os.listdir(sys.argv[1]))
    print(json.dumps({"error": error, "step": ckpt.step, "ok": bool((into["w"] == 1.0).all()), "left": left}))
"""


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs in a private mount namespace (root)")
def test_a_full_disk_fails_the_sharded_save_in_one_line_and_keeps_the_last_good_step(tmp_path: Path) -> None:
    import json

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = outside_env(**{job.CHECKPOINT_DIR_ENV: str(ckpt)})
    script = (
        f"mount -t tmpfs -o size=512k,mode=0700 rally-test-full {ckpt} && exec {sys.executable} -c "
        f"'{textwrap.dedent(DISK_FULL)}' {ckpt}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"].startswith(f"rally: sharded checkpoint of step 2 in {ckpt} failed on rank 0: OSError")
    assert "No space left on device" in result["error"] and "\n" not in result["error"]
    assert result["step"] == 1 and result["ok"] and result["left"] == ["step_000000000001.dcp"]


def test_the_resume_plan_takes_the_newest_step_every_rank_has_in_some_nodes_memory() -> None:
    from rally.agent.checkpoint.sharded.memory import plan

    # 2 nodes x 1 rank: node 0 (rank 0) holds its own steps 4, 6 and node 1's replica of 6.
    held = [{"dcp0of2": [4, 6], "dcpr1of2": [4, 6]}, {"dcp1of2": [4, 6], "dcpr0of2": [4, 6]}]
    assert plan(held, 2, 1) == (6, {0: 0, 1: 1}, "")
    # node 1 was lost and a spare (nothing in memory) took rank 1: rank 1 gets its copy from rank 0
    assert plan([held[0], {}], 2, 1) == (6, {0: 0, 1: 0}, "")
    # without the replica: no step is complete, the disk it is, and why
    step, providers, why = plan([{"dcp0of2": [4, 6]}, {}], 2, 1)
    assert (
        step is None
        and why == "step 6: the shards of rank 1 (node 1) have no live copy in memory, neither own nor replica"
    )
    # a newer step only partly in memory gives way to the newest complete one
    assert plan([{"dcp0of2": [6, 8]}, {"dcp1of2": [6]}], 2, 1)[:2] == (6, {0: 0, 1: 1})
    # the world size changed: memory cannot serve another layout
    assert plan([{"dcp0of2": [6], "dcpr1of2": [6]}], 1, 1) == (
        None,
        {},
        "the world size changed (2 -> 1): shards are resharded from disk",
    )
    assert plan([{}, {}], 2, 1) == (None, {}, "no shards of this job in any node's memory")


def _rank_part(rank: int, value: float) -> tuple:
    import torch

    from rally.agent.checkpoint.sharded.memory import _rank_local_files

    state = {f"own{rank}": torch.full((5,), value + rank), "common": torch.arange(3.0) * value}
    return _rank_local_files(state, rank)


@pytest.mark.timeout(60)
def test_background_parts_of_every_rank_are_published_as_one_dcp_checkpoint(tmp_path: Path) -> None:
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    from rally.agent.checkpoint.sharded import persist as dcp_persist

    parts = [_rank_part(rank, 2.0) for rank in (0, 1)]
    writers = [
        threading.Thread(target=dcp_persist.persist_part, args=(tmp_path, 4, 3, rank, 2, *parts[rank]))
        for rank in (1, 0)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(30)
    assert entries(tmp_path) == ["step_000000000004.dcp"]  # published whole; no temporary left
    assert dcp_files.newest_intact_step(tmp_path) == 4
    into = {"own0": torch.zeros(5), "own1": torch.zeros(5), "common": torch.zeros(3)}
    dcp.load(into, checkpoint_id=str(tmp_path / "step_000000000004.dcp"))  # torch alone, global metadata
    assert torch.equal(into["own0"], torch.full((5,), 2.0)) and torch.equal(into["own1"], torch.full((5,), 3.0))
    assert torch.equal(into["common"], torch.arange(3.0) * 2.0)


@pytest.mark.timeout(60)
def test_a_step_whose_other_rank_never_writes_is_not_published_and_a_later_step_cleans_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rally.agent.checkpoint.sharded import persist as dcp_persist

    monkeypatch.setattr(dcp_persist, "PUBLISH_TIMEOUT", 0.5)
    persister = dcp_persist.Persister()
    persister.submit(tmp_path, 2, 3, 0, 2, *_rank_part(0, 1.0))  # rank 1 died before writing step 2
    assert persister.wait(30)
    assert "step 2 could not be written" in capsys.readouterr().err and "ranks [1] did not write their part" in (
        persister.last_error or ""
    )
    assert [n for n in entries(tmp_path) if dcp_files.STEP_RE.match(n)] == [] and dcp_files.newest_intact_step(
        tmp_path
    ) is None
    rank1 = dcp_persist.Persister()
    rank1.submit(tmp_path, 4, 3, 1, 2, *_rank_part(1, 5.0))
    persister.submit(tmp_path, 4, 3, 0, 2, *_rank_part(0, 5.0))
    assert persister.wait(30) and rank1.wait(30)
    assert entries(tmp_path) == ["step_000000000004.dcp"]  # step 4 published, step 2's leftovers gone
