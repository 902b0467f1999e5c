"""Benchmark 2 — restart: SIGKILL one worker of a running job, until every worker steps again.

    rally    --standalone --nproc-per-node N --max-restarts 1 --log-dir D bench/workers/steps.py OUT 10
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --standalone --nproc-per-node N --max-restarts 1 --log-dir D bench/workers/steps.py OUT 10

Workers (bench/workers/steps.py) import torch, init gloo and loop: all_reduce, append
"<TORCHELASTIC_RESTART_COUNT> <step> <time.time()>" to their own file, sleep 50 ms. Once every
rank has logged 3 steps of attempt 0, the bench SIGKILLs the highest rank (by the pid it
wrote) and takes time.time() right before the kill. Measured:

* resumed  = the last rank's first step of attempt 1 - the kill: detection, stopping the
             others, re-rendezvous, spawning, import torch, init_process_group, one all_reduce;
* respawned = the last rank's first script line of attempt 1 - the kill: the launcher's part.

Attempt 1 does 10 steps and exits 0; the launcher must then exit 0.

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with its default (the workers share
the agent's store, reused across restarts) a gloo job cannot restart at all in torch 2.13
(stale keys; research notes, section 1.6).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from bench.common import (
    TOKEN,
    TOKEN_VAR,
    WORKERS,
    Context,
    Figure,
    Job,
    bench_env,
    error_run,
    launcher_cmd,
    launcher_order,
    read_float,
    run_dir,
    wait_until,
)

NAME = "restart"
STEPS_AFTER = 10


def steps(out: Path, rank: int) -> list[tuple[int, int, float]]:
    try:
        lines = (out / f"steps.{rank}").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            rows.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return rows


def first_step(out: Path, rank: int, attempt: int) -> float | None:
    times = [t for a, _, t in steps(out, rank) if a == attempt]
    return times[0] if times else None


def one(ctx: Context, launcher: str, nproc: int, rep: int) -> dict:
    d = run_dir(ctx.root, NAME, f"{launcher}-n{nproc}-r{rep}")
    out = run_dir(d, "out")
    run = {"launcher": launcher, "nproc": nproc, "rep": rep, "cpu_busy_before": ctx.settle()}
    argv = launcher_cmd(launcher) + [
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        "--log-dir",
        str(d / "logs"),
        str(WORKERS / "steps.py"),
        str(out),
        str(STEPS_AFTER),
    ]
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else {}
    run["argv"], run["env"] = argv, extra
    timeout = 60 + 15 * nproc
    job = Job.start(launcher, argv, bench_env(extra), d, d)
    try:

        def all_stepping(attempt: int, at_least: int) -> bool:
            if not job.alive():
                return True  # stop waiting; checked below
            job.refresh()
            return all(sum(1 for a, _, _ in steps(out, r) if a == attempt) >= at_least for r in range(nproc))

        if not wait_until(lambda: all_stepping(0, 3), timeout) or not job.alive():
            return error_run(run, job, f"attempt 0 not stepping within {timeout} s (exit {job.popen.poll()})")
        victim_rank = nproc - 1
        victim = int(read_float(out / f"pid.{victim_rank}.0") or 0)
        proc = psutil.Process(victim)
        if proc.environ().get(TOKEN_VAR) != TOKEN:
            return error_run(run, job, f"pid {victim} is not one of this run's workers")
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        if not wait_until(lambda: all_stepping(1, 1), timeout) or not all(first_step(out, r, 1) for r in range(nproc)):
            return error_run(
                run, job, f"attempt 1 not stepping within {timeout} s of the kill (exit {job.popen.poll()})"
            )
        resumed = max(first_step(out, r, 1) for r in range(nproc)) - t_kill
        starts = [read_float(out / f"start.{r}.1") for r in range(nproc)]
        rc = job.wait(60)
        run.update(
            ok=rc == 0,
            rc=rc,
            victim_rank=victim_rank,
            resumed=resumed,
            respawned=(max(starts) - t_kill) if all(starts) else None,
            first_steps={r: first_step(out, r, 1) - t_kill for r in range(nproc)},
        )
        if rc != 0:
            run["error"] = f"attempt 1 finished but the launcher exited {rc}"
            run["log_tail"] = job.tail()
        return run
    finally:
        job.kill()


def run(ctx: Context) -> list[Figure]:
    nprocs, reps = ctx.params["restart_nproc"], ctx.params["restart_reps"]
    resumed = {n: Figure(NAME, f"kill → all stepping again (nproc {n})", "s") for n in nprocs}
    respawned = {n: Figure(NAME, f"kill → all scripts restarted (nproc {n})", "s") for n in nprocs}
    for n in nprocs:
        for rep in range(reps):
            for launcher in launcher_order(rep):
                result = ctx.record(NAME, one(ctx, launcher, n, rep))
                if "resumed" in result:
                    resumed[n].samples[launcher].append(result["resumed"])
                    if result.get("respawned") is not None:
                        respawned[n].samples[launcher].append(result["respawned"])
                    ctx.say(
                        f"restart {launcher} nproc {n} rep {rep}: resumed {result['resumed']:.2f} s, "
                        f"respawned {result.get('respawned') or float('nan'):.2f} s, exit {result.get('rc')}"
                    )
                if not result.get("ok"):
                    ctx.say(f"restart {launcher} nproc {n} rep {rep}: FAILED {result.get('error')}")
    if 4 in resumed:
        resumed[4].target = "≥ 10× faster (ratio ≤ 0.1)"
        ratio, _ = resumed[4].ratio()
        resumed[4].met = None if ratio is None else ratio <= 0.1
    figures = []
    for n in nprocs:
        figures += [resumed[n], respawned[n]]
    return figures
