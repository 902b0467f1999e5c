"""Benchmark 1 — launch: from starting the launcher to every worker ready.

    rally    --standalone --nproc-per-node N --log-dir D bench/workers/ready.py OUT
    torchrun --standalone --nproc-per-node N --log-dir D bench/workers/ready.py OUT

Each worker imports torch, calls init_process_group("gloo"), does one all_reduce and writes
time.time() at its first line, after `import torch` and after the all_reduce
(bench/workers/ready.py). Measured, per run:

* all ready      = the last worker's all_reduce done - the moment the launcher was started
                   (time.time() just before the process was created);
* first line     = the last worker's first script line - the same start. With plain spawning
                   (torchrun) this is the launcher's own cost before the script runs (start-up,
                   imports, rendezvous, N interpreters); a worker forked from a template that
                   already imported torch (rally) reaches its first line after that import;
* exit           = the launcher's exit (its pid reaped) - the same start.

Both launchers use their defaults (torchrun shares its rendezvous store with the workers).
On 2 cores, N workers importing torch at once dominate: 8 workers take 10-20 s either way
unless a launcher avoids the imports (rally forks workers from a template process that
imported torch once).
"""

from __future__ import annotations

import time

from bench.common import (
    WORKERS,
    Context,
    Figure,
    Job,
    bench_env,
    error_run,
    launcher_cmd,
    launcher_order,
    read_json,
    run_dir,
)

NAME = "launch"


def one(ctx: Context, launcher: str, nproc: int, rep: int) -> dict:
    d = run_dir(ctx.root, NAME, f"{launcher}-n{nproc}-r{rep}")
    out = run_dir(d, "out")
    run = {"launcher": launcher, "nproc": nproc, "rep": rep, "cpu_busy_before": ctx.settle()}
    argv = launcher_cmd(launcher) + [
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--log-dir",
        str(d / "logs"),
        str(WORKERS / "ready.py"),
        str(out),
    ]
    run["argv"] = argv
    timeout = 60 + 15 * nproc
    job = Job.start(launcher, argv, bench_env(), d, d)
    try:
        rc = job.wait(timeout)
        t_exit = time.time()
        if rc is None:
            return error_run(run, job, f"no exit within {timeout} s")
        records = [read_json(out / f"ready.{r}.json") for r in range(nproc)]
        if rc != 0 or any(r is None for r in records):
            return error_run(run, job, f"exit code {rc}, {sum(r is not None for r in records)}/{nproc} workers ready")
        run.update(
            ok=True,
            rc=rc,
            all_ready=max(r["ready"] for r in records) - job.t_start,
            script_started=max(r["start"] for r in records) - job.t_start,
            torch_imported=max(r["imported"] for r in records) - job.t_start,
            exit=t_exit - job.t_start,
            workers=records,
        )
        return run
    finally:
        job.kill()


def run(ctx: Context) -> list[Figure]:
    nprocs, reps = ctx.params["launch_nproc"], ctx.params["launch_reps"]
    ready = {n: Figure(NAME, f"all {n} workers ready (nproc {n})", "s") for n in nprocs}
    started = {n: Figure(NAME, f"first script line on all {n} (nproc {n})", "s") for n in nprocs}
    for n in nprocs:
        for rep in range(reps):
            for launcher in launcher_order(rep):
                result = ctx.record(NAME, one(ctx, launcher, n, rep))
                if result.get("ok"):
                    ready[n].samples[launcher].append(result["all_ready"])
                    started[n].samples[launcher].append(result["script_started"])
                    ctx.say(
                        f"launch {launcher} nproc {n} rep {rep}: ready {result['all_ready']:.2f} s "
                        f"(first lines {result['script_started']:.2f} s, exit {result['exit']:.2f} s)"
                    )
                else:
                    ctx.say(f"launch {launcher} nproc {n} rep {rep}: FAILED {result['error']}")
    if 8 in ready:
        ready[8].target = "≥ 3× faster (ratio ≤ 0.33)"
    figures = []
    for n in nprocs:
        figures += [ready[n], started[n]]
    for f in figures:
        if f.target:
            ratio, _ = f.ratio()
            f.met = None if ratio is None else ratio <= 1 / 3
    return figures
