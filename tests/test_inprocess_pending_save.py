"""A save whose overlapped copy is still undecided when its round ends (`rally.job.run`).

An overlapped save (agent/checkpoint/core/overlap.py) is decided, committed or dropped, on the
saving thread at the next optimizer step's fence, the next save, `wait_saved()` or a heartbeat.
When another rank fails right after this rank's save, the next fence of this rank's round never
comes: the decision is left to whatever comes after the re-entry, when the worker already has the
next round's number. The holder must never take that old save as a step of the new round, and the
new round must not pay for it (an old round's message reaching a new round).

Real rally, two ranks on gloo, the node's memory tier: rank 0 (the node's saver) saves every step,
its weight large enough to be copied in the background; rank 1 raises right after step FAULT_AT's
save, while rank 0 waits for it in the next step's all-reduce, so step FAULT_AT's save is still
pending (the script records it) when rank 0 is interrupted.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.helpers import clean_env, read_events, run_rally

pytestmark = pytest.mark.torch

FAULT_AT = 5

TRAIN = textwrap.dedent(
    """
    import hashlib, json, os, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job
    from rally.agent.checkpoint.core.overlap import overlap

    OUT = Path(os.environ["OUT"])
    FAULT_AT = int(os.environ.get("FAULT_AT", "0"))
    torch.manual_seed(0)
    # a 256 x 256 weight (256 KB, over overlap.SMALL_BYTES): an optimizer's tensor, copied in the background
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    data = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo")
    entries = 0

    def train(steps):
        global entries
        entries += 1
        ctx = job.context()
        ckpt = job.load_latest()
        start = 0
        if ckpt is not None:  # ASSIGN=1: the loaded tensors become the parameters (no in-place copy)
            model.load_state_dict(ckpt.state["model"], assign=os.environ.get("ASSIGN") == "1")
            start = ckpt.step
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        if ckpt is not None:
            opt.load_state_dict(ckpt.state["opt"])
        with open(OUT / f"entries.{ctx.rank}", "a") as f:
            f.write(f"{entries} {os.getpid()} {start}\\n")
        for step in range(start + 1, steps + 1):
            x = data[(step * 4) % 64 : (step * 4) % 64 + 4]
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()
            job.heartbeat(step)
            job.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
            if step == FAULT_AT and entries == 1 and ctx.rank == 0:
                pending = overlap.pending  # undecided until the next step's fence, which this round never reaches
                (OUT / "pending").write_text(str(pending.step if pending is not None else None))
            if step == FAULT_AT and entries == 1 and ctx.rank == 1:
                while not (OUT / "pending").exists():  # rank 0 saved this step and is on its way to the next
                    time.sleep(0.01)
                raise ValueError(f"injected at step {step}")
        job.wait_saved()
        params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        result = {"digest": hashlib.sha256(params).hexdigest(), "entries": entries, "pid": os.getpid()}
        (OUT / f"result.{ctx.rank}").write_text(json.dumps(result))

    job.run(train, 10)
    """
)


def _run(tmp: Path, name: str, **env: str) -> tuple[object, Path, Path]:
    out, logs = tmp / name, tmp / f"{name}-logs"
    out.mkdir()
    script = tmp / "train.py"
    script.write_text(TRAIN)
    # --max-restarts 1: the fault's in-process restart is the only one the job can afford
    argv = ["--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs), str(script)]
    result = run_rally(argv, cwd=tmp, env=clean_env(OUT=str(out), **env), timeout=150)
    assert result.returncode == 0, result.describe()  # type: ignore[attr-defined]
    return result, out, logs


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    _, out, _ = _run(tmp_path_factory.mktemp("clean"), "clean")
    return json.loads((out / "result.0").read_text())["digest"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("assign", [False, True], ids=["loaded-in-place", "loaded-by-assignment"])
def test_a_save_pending_at_a_fault_never_lands_in_the_next_round_and_every_rank_resumes_alike(
    tmp_path: Path, clean_digest: str, assign: bool
) -> None:
    """Loaded in place (`load_state_dict` copies into the parameters): the old round's save was
    judged in the new round as torn by the load, and a warning blamed the script for changing
    saved tensors outside an optimizer. Loaded by assignment (the saved tensors untouched): it was
    committed in the new round, which the holder refused (the slot was voided when round 0
    closed), and the refusal was raised by a save of the new round: a second failure, which this
    job's one restart cannot afford."""
    result, out, logs = _run(tmp_path, "fault", FAULT_AT=str(FAULT_AT), ASSIGN="1" if assign else "0")
    text = result.describe()  # type: ignore[attr-defined]
    assert (out / "pending").read_text() == str(FAULT_AT), "the save was decided before the fault: nothing shown"
    # one failure, one in-process restart: the old round's save cost the new round nothing, said nothing
    assert "checkpoint refused" not in text and "was discarded" not in text, text
    events = read_events(logs)
    restarts = [(e["kind"], e["in_process"]) for e in events if e["event"] == "restart"]
    assert restarts == [("worker_failed", True)], text
    # every rank resumed from the same step, the last one committed before the fault, in its own process
    for rank in (0, 1):
        entries = [line.split() for line in (out / f"entries.{rank}").read_text().splitlines()]
        assert [(e[0], e[2]) for e in entries] == [("1", "0"), ("2", str(FAULT_AT - 1))], (rank, entries, text)
        assert len({e[1] for e in entries}) == 1, "a pid changed"
        done = json.loads((out / f"result.{rank}").read_text())
        assert done["digest"] == clean_digest and done["entries"] == 2, text
