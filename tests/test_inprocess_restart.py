"""In-process restarts (`rally.job.run`, docs/restartable.md): a failure re-enters the training
function in the workers' own processes instead of restarting them.

Real rally, real workers (two ranks on gloo, a tiny DDP model), the node's memory tier. Each
fault is compared with an uninterrupted run of the same script: the final parameters must be
bit-identical, and the survivors' pids unchanged (a whole restart, what rally did before
job.run existed, gives the same parameters but new pids, so these tests fail without re-entry).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from support.helpers import clean_env, read_events, run_rally

pytestmark = pytest.mark.torch

TRAIN = textwrap.dedent(
    """
    import hashlib, json, os, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job

    OUT = Path(os.environ["OUT"])
    FAULT = os.environ.get("FAULT", "")
    OWN_INIT = os.environ.get("OWN_INIT") == "1"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)  # built once, before job.run: it survives every re-entry
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    if not OWN_INIT:
        dist.init_process_group("gloo")  # rally makes it again before each later entry
    entries = 0

    def train(steps):
        global entries
        entries += 1
        if OWN_INIT:
            dist.init_process_group("gloo")
        ctx = job.context()
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # holds the group: built per entry
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ckpt = job.load_latest()
        start = 0
        if ckpt is not None:
            model.load_state_dict(ckpt.state["model"])
            opt.load_state_dict(ckpt.state["opt"])
            start = ckpt.step
        for step in range(start + 1, steps + 1):
            x = data[(step * 4) % 64 : (step * 4) % 64 + 4]
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()
            job.heartbeat(step)
            line = [step, entries, os.getpid(), time.monotonic(), ctx.world_size, os.environ["MASTER_PORT"]]
            with open(OUT / f"steps.{ctx.rank}", "a") as f:
                f.write(" ".join(map(str, line)) + "\\n")
            if step % 3 == 0:
                job.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
            kind, _, rest = FAULT.partition(":")
            at, _, who = rest.partition(":")
            if kind and step == int(at) and ctx.rank == int(who) and not (OUT / "fault.done").exists():
                (OUT / "fault.done").write_text(str(time.monotonic()))
                if kind == "sigkill":
                    os.kill(os.getpid(), 9)
                while kind == "hang":  # in Python: the agent's interrupt raises at the next bytecode
                    time.sleep(1)
                raise ValueError(f"injected at step {step}")
        params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        result = {"digest": hashlib.sha256(params).hexdigest(), "entries": entries, "pid": os.getpid()}
        (OUT / f"result.{ctx.rank}").write_text(json.dumps(result))
        if OWN_INIT:
            dist.destroy_process_group()

    job.run(train, 12)
    """
)


def _run(tmp: Path, name: str, *flags: str, **env: str) -> tuple[subprocess.CompletedProcess | object, Path, Path]:
    out, logs = tmp / name, tmp / f"{name}-logs"
    out.mkdir()
    script = tmp / "train.py"
    script.write_text(TRAIN)
    argv = ["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(logs), *flags, str(script)]
    result = run_rally(argv, cwd=tmp, env=clean_env(OUT=str(out), **env), timeout=150)
    assert result.returncode == 0, result.describe()
    return result, out, logs


def _steps(out: Path, rank: int) -> list[list[str]]:
    return [line.split() for line in (out / f"steps.{rank}").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    _, out, _ = _run(tmp_path_factory.mktemp("clean"), "clean")
    return json.loads((out / "result.0").read_text())["digest"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("own_init", [False, True], ids=["rally-initialises", "function-initialises"])
def test_an_exception_re_enters_the_function_in_the_same_processes(
    tmp_path: Path, clean_digest: str, own_init: bool
) -> None:
    result, out, logs = _run(tmp_path, "fault", FAULT="exception:5:1", OWN_INIT="1" if own_init else "0")
    for rank in (0, 1):
        done = json.loads((out / f"result.{rank}").read_text())
        assert done["digest"] == clean_digest, f"rank {rank} did not resume bit-identically\n{result.describe()}"
        assert done["entries"] == 2, result.describe()  # entered again, not restarted
        steps = _steps(out, rank)
        assert {line[2] for line in steps} == {str(done["pid"])}, "a survivor's pid changed"
        first, second = [s for s in steps if s[1] == "1"], [s for s in steps if s[1] == "2"]
        assert second[0][0] == "4", "the second entry did not resume from the step-3 checkpoint"
        assert first[-1][5] != second[0][5], "the second entry reused the old round's MASTER_PORT"
    # the exception, with its rank and traceback, is the root cause
    assert "root cause: rank 1 (local rank 1, pid" in result.stderr, result.describe()
    assert "raised ValueError: injected at step 5" in result.stderr
    assert 'raise ValueError(f"injected at step {step}")' in result.stderr
    assert "re-entering the training function in every worker (restart 1 of 2)" in result.stderr
    events = read_events(logs)
    restarts = [e for e in events if e["event"] == "restart"]
    assert [e["in_process"] for e in restarts] == [True], restarts
    assert any(e["event"] == "worker_raised" and e["rank"] == 1 for e in events)
    report = json.loads(next(logs.glob("*/report.json")).read_text())
    assert report["attempts"][0]["recovery"] == "in-process"
    assert report["attempts"][0]["end"]["info"]["traceback"].rstrip().endswith("ValueError: injected at step 5")


@pytest.mark.timeout(300)
def test_a_killed_rank_is_replaced_and_the_survivor_re_enters(tmp_path: Path, clean_digest: str) -> None:
    result, out, logs = _run(tmp_path, "fault", FAULT="sigkill:5:1")
    survivor = json.loads((out / "result.0").read_text())
    replaced = json.loads((out / "result.1").read_text())
    assert survivor["digest"] == replaced["digest"] == clean_digest, result.describe()
    assert survivor["entries"] == 2, result.describe()  # rank 0 stayed in its process and entered again
    assert {line[2] for line in _steps(out, 0)} == {str(survivor["pid"])}, "the survivor's pid changed"
    killed = {line[2] for line in _steps(out, 1)} - {str(replaced["pid"])}
    assert len(killed) == 1 and replaced["entries"] == 1, "rank 1 was not replaced by a new process"
    assert "failed with SIGKILL" in result.stderr and "re-entering the training function" in result.stderr
    events = read_events(logs)
    assert [e["in_process"] for e in events if e["event"] == "restart"] == [True]
    started = [e for e in events if e["event"] == "worker_started" and e["round"] == 1]
    assert [(e["rank"], e["pid"]) for e in started] == [(1, replaced["pid"])], started


@pytest.mark.timeout(300)
def test_a_hung_rank_is_interrupted_and_every_rank_re_enters(tmp_path: Path, clean_digest: str) -> None:
    # 8 s: a worker's exit after its last heartbeat (torch's finalisation) must not look like a hang
    result, out, logs = _run(tmp_path, "fault", "--heartbeat-timeout", "8", FAULT="hang:5:1")
    for rank in (0, 1):
        done = json.loads((out / f"result.{rank}").read_text())
        assert done["digest"] == clean_digest, result.describe()
        assert done["entries"] == 2, result.describe()
        assert {line[2] for line in _steps(out, rank)} == {str(done["pid"])}, "a pid changed"
    assert "is hung" in result.stderr and "re-entering the training function" in result.stderr, result.describe()
    events = read_events(logs)
    assert [(e["kind"], e["in_process"]) for e in events if e["event"] == "restart"] == [("worker_hung", True)]


LEAK = textwrap.dedent(
    """
    import os, threading
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job

    OUT = Path(os.environ["OUT"])
    ENTRIES = int(os.environ["ENTRIES"])
    dist.init_process_group("gloo")
    entries = 0

    def train():
        global entries
        entries += 1
        ctx = job.context()
        fds = len(os.listdir("/proc/self/fd"))
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open(OUT / f"entries.{ctx.rank}", "a") as f:
            f.write(f"{entries} {fds} {threading.active_count()} {rss}\\n")
        x = torch.ones(1 << 16)
        for _ in range(3):
            dist.all_reduce(x)
        job.save({"x": x}, entries)  # progress: each re-entry follows a newer checkpoint
        job.wait_saved()
        dist.barrier()
        if entries < ENTRIES and ctx.rank == 1:
            raise ValueError(f"entry {entries}")
        dist.barrier()

    job.run(train)
    """
)


@pytest.mark.timeout(300)
def test_fifty_re_entries_leak_no_descriptors_threads_or_memory(tmp_path: Path) -> None:
    entries = 50
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    script = tmp_path / "leak.py"
    script.write_text(LEAK)
    argv = ["--nproc-per-node", "2", "--max-restarts", str(entries), "--log-dir", str(logs), str(script)]
    result = run_rally(argv, cwd=tmp_path, env=clean_env(OUT=str(out), ENTRIES=str(entries)), timeout=280)
    assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        rows = [list(map(int, line.split())) for line in (out / f"entries.{rank}").read_text().splitlines()]
        assert [row[0] for row in rows] == list(range(1, entries + 1)), f"rank {rank} was restarted, not re-entered"
        fifth, last = rows[4], rows[-1]
        assert last[1] <= fifth[1], f"rank {rank}: open descriptors grew from {fifth[1]} to {last[1]}"
        assert last[2] <= fifth[2], f"rank {rank}: threads grew from {fifth[2]} to {last[2]}"
        # RSS: the allocator's arenas move by a few pages; a leak of anything per entry is more
        assert last[3] <= fifth[3] + (4 << 20), f"rank {rank}: RSS grew from {fifth[3]} to {last[3]}"


@pytest.mark.timeout(300)
def test_a_warm_spare_takes_a_killed_ranks_place(tmp_path: Path, clean_digest: str) -> None:
    result, out, logs = _run(tmp_path, "fault", "--warm-spares", "1", FAULT="sigkill:5:1")
    survivor = json.loads((out / "result.0").read_text())
    promoted = json.loads((out / "result.1").read_text())
    assert survivor["digest"] == promoted["digest"] == clean_digest, result.describe()
    assert survivor["entries"] == 2, result.describe()
    events = read_events(logs)
    spares = [e["pid"] for e in events if e["event"] == "spare_started"]
    assert promoted["pid"] == spares[0], f"rank 1 is pid {promoted['pid']}, not the spare started first ({spares})"
    assert [e["pid"] for e in events if e["event"] == "spare_promoted"] == [spares[0]]
    assert len(spares) == 2, "no new spare was started after the first one took a rank's place"
    assert not [e for e in events if e["event"] == "worker_started" and e["round"] == 1], "a worker was forked anyway"
