"""Benchmark 7 — the pre-flight check's cost: N rally agents on 127.0.0.1, one plain worker each.

    rally --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
          --rdzv-id ID --local-addr 127.0.0.1 --preflight --log-dir D bench/workers/plain_ready.py OUT

Every agent prints `pre-flight of round 0 took X s: ...` once its verdict is in (agent/checks/preflight.py):
from the round's formation to the verdict, i.e. forking the probe from the worker template, its
compute blocks, gloo's connections, the 4 MB all-reduce, the round-robin 1 MB exchanges with every
other node, publishing the numbers and node 0's verdict. The figure is the largest X over the N
agents (what the job waits), median over repetitions; a second row leaves out the part spent
waiting for the worker template to finish importing torch (printed by the agent: `(Y s of it
waiting for the worker template to load torch)`), which starting the workers waits for anyway.
torchrun has no pre-flight check: its
column stays empty. The multiagent benchmark runs rally with --no-preflight, so its rendezvous
figures stay comparable with torchrun's.
"""

from __future__ import annotations

import re
import sys
import time

from bench.common import (
    SHIM,
    WORKERS,
    Context,
    Figure,
    Job,
    bench_env,
    error_run,
    free_port,
    launcher_exe,
    read_float,
    run_dir,
)

NAME = "preflight"
TOOK = re.compile(r"rally: pre-flight of round 0 took (\d+\.\d+) s(?: \((\d+\.\d+) s of it waiting)?")


def one(ctx: Context, nodes: int, rep: int) -> dict:
    d = run_dir(ctx.root, NAME, f"rally-n{nodes}-r{rep}")
    out = run_dir(d, "out")
    run = {"launcher": "rally", "nodes": nodes, "rep": rep, "cpu_busy_before": ctx.settle()}
    port = free_port()
    argv_tail = [
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"bench-preflight-{nodes}-{rep}",
        "--local-addr",
        "127.0.0.1",
        "--preflight",
        "--log-dir",
        str(d / "logs"),
        str(WORKERS / "plain_ready.py"),
        str(out),
    ]
    run["argv"] = ["rally", *argv_tail]
    env = bench_env({"BENCH_IMPORT_MARK": str(run_dir(d, "marks"))})
    timeout = 60 + 5 * nodes
    jobs: list[Job] = []
    try:
        for i in range(nodes):
            jobs.append(
                Job.start(f"agent{i}", [sys.executable, str(SHIM), launcher_exe("rally"), *argv_tail], env, d, d)
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(j.alive() for j in jobs):
            time.sleep(0.2)
        codes = [j.popen.poll() for j in jobs]
        run["exit_codes"] = codes
        ready = [read_float(out / f"ready.{r}") for r in range(nodes)]
        took = [TOOK.search(j.stderr()) for j in jobs]
        if any(r is None for r in ready) or not all(took):
            return error_run(
                run,
                jobs[0],
                f"{sum(r is not None for r in ready)}/{nodes} workers ran, {sum(map(bool, took))} pre-flight "
                f"lines; exit codes {codes}",
            )
        run.update(
            preflight_seconds=[float(m.group(1)) for m in took],
            # without the wait for the template's torch import, which the workers wait for anyway
            beyond_template=[float(m.group(1)) - float(m.group(2) or 0) for m in took],
            ok=all(c == 0 for c in codes),
        )
        return run
    finally:
        for job in jobs:
            job.kill()


def run(ctx: Context) -> list[Figure]:
    sizes, reps = ctx.params["preflight_nodes"], ctx.params["preflight_reps"]
    figures = {n: Figure(NAME, f"{n} nodes: pre-flight check (slowest node)", "s") for n in sizes}
    beyond = {
        n: Figure(NAME, f"{n} nodes: pre-flight beyond the template's torch import (slowest node)", "s") for n in sizes
    }
    for n in sizes:
        for rep in range(reps):
            result = ctx.record(NAME, one(ctx, n, rep))
            if "preflight_seconds" in result:
                figures[n].samples["rally"].append(max(result["preflight_seconds"]))
                beyond[n].samples["rally"].append(max(result["beyond_template"]))
                ctx.say(
                    f"preflight N={n} rep {rep}: {max(result['preflight_seconds']):.2f} s (slowest node), "
                    f"ok={result['ok']}"
                )
            else:
                ctx.say(f"preflight N={n} rep {rep}: FAILED {result.get('error')}")
    for n in sizes:
        for f in (figures[n], beyond[n]):
            f.notes["torchrun"] = "no pre-flight check"
            if n == 8:
                f.target = "< 3 s"
                value = f.value("rally")
                f.met = None if value is None else value < 3
    return [f for n in sizes for f in (figures[n], beyond[n])]
