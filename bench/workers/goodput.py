"""The goodput benchmark's worker (bench/goodput.py): train in lockstep, checkpoint, survive kills.

    <launcher> --nproc-per-node 2 bench/workers/goodput.py --method rally --dir D --until EPOCH --events E

Every rank holds the same state, 25 float32 tensors of 2000 x 2000 (400 MB, the size of
25 x Linear(2000, 2000)): the parameters of an optimizer, saved as a state_dict's detached views.
It steps in lockstep with the other rank: each step computes matrix products for
``--step-seconds`` (0.1 s: its forward and backward), then the optimizer's step overwrites every
parameter in place (an optimizer step's memory traffic: the state after step s is ``s + i`` in
tensor i, so a resumed state is checked exactly), and all-reduces a small tensor, as DDP's
gradient exchange would (so a killed peer fails the survivor, as in real training). Rank 0's all-reduce also carries
"the deadline has passed", so both ranks stop after the same step.

Checkpoints follow Young's interval for a failure every ``--mtbf`` seconds: every
``round(sqrt(2 x cost x mtbf) / step time)`` steps, with the cost and the step time measured as
the run goes (the first save after CLEAN_STEPS steps, which give the baseline step time). A save's
**stall** is the time in the call plus, for rally (whose copy overlaps the next step,
agent/checkpoint/core/overlap.py), the time the next optimizer step's fence waited for that copy;
its **cost** is the stall plus how much longer than the baseline the OVERLAP_STEPS steps after it
took in all (each step's difference with its sign: noise cancels; its copy and its background
persist compete with those steps for the cores: for an overlapped save that is most of it, and an
interval from the stall alone saves far too often). Only those few steps: counted up to the next
save, any drift of the steady steps from the baseline was charged to the save once a step, so a
longer interval made a dearer save and a longer interval again (a loop that settled at ~2 x mtbf x
drift / step², 30-80 steps, in some attempts and not others). Methods:

- ``rally``: ``rally.job.save(state, step)`` / ``load_latest()`` (the memory tier, persisted in
  the background to ``--checkpoint-dir``);
- ``torch_save``: rank 0 ``torch.save`` to a temporary file, fsync, rename (atomic; the previous
  one is removed), every rank ``torch.load``\\ s the newest at start;
- ``dlrover``: DLRover's flash checkpoint (``DdpCheckpointer``, ``StorageType.DISK``);
- ``none``: no checkpoint (the failure-free ideal's run).

Rank 0 appends one JSON line per event to ``--events``: ``start`` (the script's first line, before
``import torch``; every rank writes this one, with its ``rank``), ``resumed`` (the step loaded,
and how long the load took), ``step`` (every step, with its duration) and ``save`` (the stall).
Every rank appends ``stepping`` as each entry's first step begins (see `stepping`).
Rank 1 writes its pid to ``--pid-file`` so the driver can kill it.

**Set-up** (``--setup-seconds``): before the training function, once per process, a sleep that
stands for the model's and the data's construction. A sleep, not real work: on a shared 2-core
machine real work's length would swing with the load and compete with the other rank's, while a
sleep costs exactly the same in every row, so the rows differ by what each launcher makes the job
pay again after a fault (a whole restart pays it again, an in-process re-entry does not).

**Re-entry** (``--reenter``): ``none`` calls the training function once (a failure ends the
process and the launcher restarts every rank); ``rally`` hands it to ``rally.job.run`` (re-entered
in the surviving processes); ``nvrx`` wraps it in NVIDIA's ``inprocess.Wrapper`` (its sources from
``RALLY_BENCH_NVRX_SRC``, settings in NVRX_SETTINGS). Each entry of the function logs ``entered``
(every rank, with its pid) and tags rank 0's steps with the entry (``en``: pid.n), so the driver
tells the entry a fault ended from the one after it. A **soft fault**: rank 1 raises
``RuntimeError`` in the training function at the first step after the driver created
``--raise-file`` (renamed away first, so it is raised once), logging ``raised`` with the time.
"""

from __future__ import annotations

import time

STARTED = time.time()  # the script's first line: the restart's end as far as the launcher goes

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TENSORS = 25
SIDE = 2000

NVRX_SETTINGS = {
    "monitor_thread_interval": 0.05,
    "monitor_process_interval": 0.05,
    "heartbeat_interval": 0.05,
    "progress_watchdog_interval": 0.05,
    "last_call_wait": 0.05,
    "termination_grace_time": 1.0,
    "barrier_timeout": 120.0,
    "completion_timeout": 120.0,
    "soft_timeout": 60.0,
    "hard_timeout": 90.0,
    "heartbeat_timeout": 30.0,
}
"""NVIDIA's Wrapper, tuned for the fastest restart: every polling interval and the last-call wait
as low as worked here (seconds; its defaults are 1 s each), the timeouts its defaults (no hang is
injected)."""


class Events:
    """Rank 0's event log (other ranks log nothing)."""

    def __init__(self, path: Path, attempt: int) -> None:
        self.file = open(path, "a", buffering=1) if os.environ["RANK"] == "0" else None  # noqa: SIM115
        self.attempt = attempt

    def __call__(self, event: str, **fields: float | int | str) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"e": event, "t": time.time(), "a": self.attempt, **fields}) + "\n")

    def started(self, path: Path) -> None:
        """Every rank's ``start`` (the restart's end is the last rank's first line): one short append."""
        rank = int(os.environ["RANK"])
        line = json.dumps({"e": "start", "t": time.time(), "a": self.attempt, "at": STARTED, "rank": rank}) + "\n"
        if self.file is not None:
            self.file.write(line)
        else:
            with open(path, "a") as f:
                f.write(line)


class Checkpoints:
    """One method's save and load, behind the same two calls."""

    def __init__(self, method: str, directory: Path) -> None:
        self.method, self.dir = method, directory
        if method == "rally":
            from rally import job

            self.job = job
        elif method == "dlrover":
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

            self.dl, self.storage = DdpCheckpointer(str(directory)), StorageType.DISK

    def save(self, state: dict[str, torch.Tensor], step: int) -> None:
        if self.method == "rally":
            self.job.save(state, step)
        elif self.method == "torch_save":
            if dist.get_rank() == 0:
                final, temp = self.dir / f"step_{step}.pt", self.dir / f".step_{step}.pt.tmp"
                with open(temp, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temp, final)
                for older in self.dir.glob("step_*.pt"):
                    if older != final:
                        older.unlink(missing_ok=True)
        elif self.method == "dlrover":
            self.dl.save_checkpoint(step, state, str(self.dir / f"{step}.pt"), storage_type=self.storage)

    def load(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest checkpoint: (step, state), or None."""
        if self.method == "rally":
            ckpt = self.job.load_latest()
            return None if ckpt is None else (ckpt.step, ckpt.state)
        if self.method == "torch_save":
            steps = sorted(int(p.stem.split("_")[1]) for p in self.dir.glob("step_*.pt"))
            if not steps:
                return None
            return steps[-1], torch.load(self.dir / f"step_{steps[-1]}.pt", weights_only=True)
        if self.method == "dlrover":
            state = self.dl.load_checkpoint()
            return (int(state["layer0.weight"][0, 0].item()), state) if state else None  # tensor 0 holds its step
        return None


class Overwrite(torch.optim.Optimizer):
    """An optimizer whose step leaves parameter i holding ``step + i`` everywhere (in place)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})
        self.to_step = 0

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for i, p in enumerate(self.param_groups[0]["params"]):
            p.fill_(float(self.to_step + i))


# Steps without a save at the start of every attempt: the baseline a save's cost is measured against.
CLEAN_STEPS = 10
# Steps after a save whose excess over the baseline is the save's (its overlapped copy, its persist):
# measured (kept runs, 150 s, a save every 1-34 steps), a save slows the first step after it (by
# 4-30 ms) and no later one beyond the steps' own noise; 5 leaves room for a slower disk.
OVERLAP_STEPS = 5


def baseline(clean: list[float]) -> float:
    """A clean step's time: the mean of this attempt's steps before its first save, without the
    slowest and the fastest (one stray step does not move it). A mean, not a median: a save's
    excess is a sum of differences from it, and step times are skewed (a median below the mean
    made every save look 0.4 ms a step dearer than no save at all)."""
    kept = sorted(clean)[1:-1] if len(clean) > 2 else clean
    return statistics.fmean(kept)


def cost_of(saved: dict) -> float:
    """A save's cost to the run: the stall (the call, and the next optimizer step's wait for an
    overlapped copy) plus how much longer than the baseline the OVERLAP_STEPS steps after it took
    (fewer if the next save came sooner), in all: each step's difference counted with its sign, so
    that the steps' own noise cancels (counting only the slower steps made noise a cost: 0.9 ms a
    step in a run with no saves)."""
    return max(0.0, saved["call"] + (saved["fence"] or 0.0) + saved["excess"])


def young_interval(costs: list[float], mtbf: float, per_step: float) -> int:
    """Young's optimal interval in steps, sqrt(2 x a save's cost x the time between failures)."""
    return max(1, round(math.sqrt(2 * statistics.median(costs) * mtbf) / per_step))


def finish(events: Events, saved: dict, costs: list[float], interval: int, skipped: int) -> None:
    """Record a save once the next one is made (or the run ends): its stall, its whole cost, and
    how many saves this process has skipped by then (`skipped_saves`: a fence settled this one)."""
    costs.append(cost_of(saved))
    events("save", step=saved["step"], seconds=costs[-1], stall=saved["call"] + (saved["fence"] or 0.0),
           skipped=skipped)  # fmt: skip
    events("interval", steps=interval)


def skipped_saves(method: str) -> int:
    """How many of rally's saves this process skipped to spare the newest step (its holder was
    persisting the other slot: agent/checkpoint/core/overlap.py); 0 elsewhere."""
    if method != "rally":
        return 0
    from rally.agent.checkpoint.core.overlap import overlap

    return overlap.skipped


def fence_seconds(method: str) -> float:
    """How long rally's fences have waited for overlapped copies in this process (0 elsewhere)."""
    if method != "rally":
        return 0.0
    from rally.agent.checkpoint.core.overlap import overlap

    return overlap.fence_seconds


def check(state: dict[str, torch.Tensor], step: int) -> None:
    """A resumed state must be exactly the saved step's (first and last element of each tensor)."""
    for i, tensor in enumerate(state.values()):
        flat = tensor.view(-1)
        if flat[0].item() != step + i or flat[-1].item() != step + i:
            raise SystemExit(f"resumed state is not step {step}'s: tensor {i} holds {flat[0].item()}")


def busy_until(deadline: float, a: torch.Tensor, b: torch.Tensor) -> None:
    while time.perf_counter() < deadline:
        torch.mm(a, b)


def log_line(path: Path, event: str, **fields: float | int | str) -> None:
    """One event line from any rank (an append: short lines from two ranks do not interleave)."""
    with open(path, "a") as f:
        f.write(json.dumps({"e": event, "t": time.time(), **fields}) + "\n")


def stepping(args: argparse.Namespace, rank: int, entry: str, marks: tuple[float, float, float]) -> None:
    """Every rank's ``stepping`` line as an entry's first step begins: when this rank is training
    again (the driver's fault -> every rank stepping again is the last rank's), with when the entry
    began, its load call returned and the copy into the model ended (`marks`), and under
    ``rally.job.run`` its re-entry's timestamps (rally/agent/worker_side/restartable.py
    ``timeline``) for the phase breakdown."""
    entered_at, called_at, loaded_at = marks
    points: dict[str, float] = {}
    if args.reenter == "rally":
        from rally.agent.worker_side import restartable

        points = dict(restartable.timeline)
    line = {"e": "stepping", "t": time.time(), "rank": rank, "pid": os.getpid(), "en": entry,
            "entered": entered_at, "called": called_at, "loaded": loaded_at, "points": points}  # fmt: skip
    with open(args.events, "a") as f:
        f.write(json.dumps(line) + "\n")


class Job:
    """What a process builds once, before the training function: argument, state, optimizer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # initialised, as a model's construction does (torch.empty alone would leave the pages for the
        # first load or step to fault in: a cost a real model pays in its set-up)
        self.params = [torch.nn.Parameter(torch.zeros(SIDE, SIDE), requires_grad=False) for _ in range(TENSORS)]
        self.optimizer = Overwrite(self.params)
        self.state = {f"layer{i}.weight": p.detach() for i, p in enumerate(self.params)}  # model.state_dict()
        self.ckpt = Checkpoints(args.method, args.dir)
        self.entries = 0
        self.events: Events | None = None

    def train(self, attempt: int | None = None) -> None:
        """The training function: resume from the newest checkpoint, step until the deadline."""
        args, state, optimizer, ckpt = self.args, self.state, self.optimizer, self.ckpt
        self.entries += 1
        if attempt is None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        entry = f"{os.getpid()}.{self.entries}"
        rank = dist.get_rank()
        if self.events is None:
            self.events = Events(args.events, attempt)
        events = self.events
        events.attempt = attempt
        entered_at = time.time()
        log_line(args.events, "entered", rank=rank, pid=os.getpid(), en=entry, a=attempt)
        if rank == 1:
            args.pid_file.write_text(str(os.getpid()))
        began = time.perf_counter()
        loaded = ckpt.load() if args.method != "none" else None
        called_at = time.time()
        step = 0
        if loaded is not None:
            step, saved = loaded
            for name, tensor in state.items():
                tensor.copy_(saved[name])
            check(state, step)
            events("resumed", step=step, seconds=time.perf_counter() - began, en=entry)
        else:
            optimizer.to_step = 0
            optimizer.step()
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        flag = torch.zeros(1)
        costs: list[float] = []  # finished saves' costs (see `young_interval`)
        clean: list[float] = []  # step times before the first save of this attempt: the baseline
        next_save = step + CLEAN_STEPS
        saved: dict | None = None  # the last save: step, stall (the call and the fence's wait), excess, steps counted
        interval = 1
        first = step + 1
        loaded_at = time.time()
        while True:
            step += 1
            t0 = time.perf_counter()
            if step == first:  # every rank: this entry's first step begins (the end of a recovery)
                stepping(args, rank, entry, (entered_at, called_at, loaded_at))
            # Raised at a step after the entry's first (a fault asked for during a recovery waits for it).
            if rank == 1 and args.raise_file is not None and step > first:
                try:
                    os.rename(args.raise_file, f"{args.raise_file}.{entry}")
                except OSError:
                    pass
                else:
                    log_line(args.events, "raised", rank=rank, pid=os.getpid(), en=entry)
                    raise RuntimeError("bench: a soft fault in rank 1's training function")
            busy_until(t0 + args.step_seconds, a, b)
            optimizer.to_step = step
            fenced = fence_seconds(args.method)
            optimizer.step()  # rally's fence: waits for the last save's copy if it still runs
            fence_wait = fence_seconds(args.method) - fenced
            if saved is not None and saved["fence"] is None:
                saved["fence"] = fence_wait
            flag[0] = 1.0 if rank == 0 and time.time() >= args.until else 0.0
            dist.all_reduce(flag)
            took = time.perf_counter() - t0
            events("step", step=step, seconds=took, en=entry)
            if saved is None:
                clean.append(took)
            else:
                # What the save costs the steps after it beyond the fence's wait: its copy and its
                # persist compete with the step for the cores (for an overlapped save, most of its cost).
                clean_step = baseline(clean)
                if saved["counted"] < OVERLAP_STEPS:
                    saved["excess"] += took - fence_wait - clean_step
                    saved["counted"] += 1
                interval = young_interval([*costs, cost_of(saved)], args.mtbf, clean_step)
                next_save = saved["step"] + interval
            if flag[0] > 0:
                break
            if args.method != "none" and step >= next_save:
                if saved is not None:
                    finish(events, saved, costs, interval, skipped_saves(args.method))
                t1 = time.perf_counter()
                ckpt.save(state, step)
                saved = {"step": step, "call": time.perf_counter() - t1, "fence": None, "excess": 0.0, "counted": 0}
        if saved is not None:
            finish(events, saved, costs, interval, skipped_saves(args.method))


def run_nvrx(job: Job) -> None:
    """The training function under NVIDIA's in-process Wrapper (nvidia-resiliency-ext's sources):
    each iteration makes its own store and group, as its examples do; LOCAL_RANK unset, so no
    GPU health check (this job has no GPU)."""
    from datetime import timedelta

    import nvidia_resiliency_ext.inprocess as inprocess

    os.environ.pop("LOCAL_RANK", None)
    port = int(os.environ["MASTER_PORT"])
    timing = {k: timedelta(seconds=v) for k, v in NVRX_SETTINGS.items()}

    def train(call_wrapper: Any = None) -> None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], port + 2 + call_wrapper.iteration,
                              int(os.environ["WORLD_SIZE"]), is_master=os.environ["RANK"] == "0",
                              multi_tenant=True, wait_for_workers=True, use_libuv=True)  # fmt: skip
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
        base = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        job.train(attempt=base * 1000 + call_wrapper.iteration)
        dist.destroy_process_group()

    # The Wrapper hands its CallWrapper to the parameter annotated with that class: a real class
    # here, not the string this module's `from __future__ import annotations` makes of it.
    train.__annotations__["call_wrapper"] = Optional[inprocess.CallWrapper]  # noqa: UP045 (it checks typing.Union)
    inprocess.Wrapper(store_kwargs={"port": port + 1}, **timing)(train)()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True, choices=("rally", "torch_save", "dlrover", "none"))
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--pid-file", type=Path, required=True)
    parser.add_argument("--until", type=float, required=True, help="wall-clock time (epoch) to stop at")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--mtbf", type=float, default=60.0)
    parser.add_argument("--setup-seconds", type=float, default=0.0)
    parser.add_argument("--reenter", choices=("none", "rally", "nvrx"), default="none")
    parser.add_argument("--raise-file", type=Path, default=None)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)

    torch.set_num_threads(1)
    Events(args.events, attempt).started(args.events)
    time.sleep(args.setup_seconds)  # stands for the model's and the data's construction (docstring)
    job = Job(args)
    if args.reenter == "nvrx":
        run_nvrx(job)
        return
    dist.init_process_group("gloo")
    if args.reenter == "rally":
        from rally import job as rally_job

        rally_job.run(job.train)
    else:
        job.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
