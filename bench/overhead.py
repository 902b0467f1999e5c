"""Benchmark 6 — agent overhead while a job runs: CPU and memory of the launcher process.

    rally    --standalone --nproc-per-node 2 --log-dir D bench/workers/plain_ready.py OUT S
    torchrun --standalone --nproc-per-node 2 --log-dir D bench/workers/plain_ready.py OUT S

Two plain-Python workers write a timestamp and sleep S seconds (10 quick, 20 full). From 1 s
after both are running until S - 1 s, the bench samples the launcher process (psutil, every 0.25 s): its CPU time
(user + system, all threads) and RSS, and those of its non-worker child processes (rally's
orphan guard, and its worker template when it starts one; torchrun has none). Measured:

* idle CPU      = CPU seconds used in the window / window length, in % of one core
                  (agent + helpers), from each thread's run time in nanoseconds
                  (/proc/PID/task/TID/schedstat); the process's user + system time, which the
                  kernel counts in 10 ms ticks (a resolution of 0.125 % for 8 s: one tick more
                  or less was the whole difference between 0.12 % and 0.25 %), is kept beside it
                  as `cpu_pct_ticks` (and is what is used where schedstat is missing);
* RSS           = median RSS of the agent process in the window;
* RSS + helpers = the same plus its helper processes;
* node PSS      = proportional set size (shared pages split between the processes sharing
                  them) summed over agent, helpers and workers, once in mid-window: what
                  the whole job costs the node (workers forked from a template share its
                  pages; fresh interpreters share only the binary and libraries).
"""

from __future__ import annotations

import os
import statistics
import time

import psutil

from bench.common import (
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
    short_command,
    wait_until,
)
from bench.multiagent import helpers_comment, helpers_of

NAME = "overhead"


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system time of `procs` (all threads), in the kernel's 10 ms ticks."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def thread_run_times(procs: list[psutil.Process]) -> dict[tuple[int, int], float] | None:
    """Each thread's run time in seconds, to the nanosecond (schedstat's first field), keyed by
    (pid, tid); None where the kernel has no schedstat. A thread that exits inside the window
    takes its time with it: in the window (workers asleep) the agent starts none."""
    times: dict[tuple[int, int], float] = {}
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                    times[(p.pid, int(tid))] = int(f.read().split()[0]) / 1e9
            except FileNotFoundError:
                if not os.path.exists("/proc/self/schedstat"):
                    return None
            except (OSError, ValueError, IndexError):
                pass
    return times


def run_time_between(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float]) -> float:
    """CPU seconds the threads used between two `thread_run_times` (a thread started in between: all of its time)."""
    return sum(t - before.get(key, 0.0) for key, t in after.items())


def rss_mb(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def pss_mb(procs: list[psutil.Process]) -> float | None:
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except (psutil.Error, AttributeError):
            return None
    return total / 2**20


def one(ctx: Context, launcher: str, rep: int) -> dict:
    SLEEP = float(ctx.params["overhead_seconds"])
    d = run_dir(ctx.root, NAME, f"{launcher}-r{rep}")
    out = run_dir(d, "out")
    run = {"launcher": launcher, "rep": rep, "cpu_busy_before": ctx.settle()}
    argv = launcher_cmd(launcher) + [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(d / "logs"),
        str(WORKERS / "plain_ready.py"),
        str(out),
        str(SLEEP),
    ]
    run["argv"] = argv
    job = Job.start(launcher, argv, bench_env(), d, d)
    try:
        ok = wait_until(lambda: (read_float(out / "ready.0") and read_float(out / "ready.1")) or not job.alive(), 60)
        if not ok or not job.alive():
            return error_run(run, job, "workers did not start within 60 s")
        t_ready = max(read_float(out / "ready.0"), read_float(out / "ready.1"))
        agent = job.process()
        helpers = helpers_of(agent, "plain_ready.py")
        workers = [p for p in agent.children(recursive=True) if "plain_ready.py" in " ".join(p.cmdline())]
        run["helpers"] = sorted({short_command(h.cmdline()) for h in helpers})
        run["workers"] = [w.pid for w in workers]
        time.sleep(max(0.0, t_ready + 1.0 - time.time()))
        c0_agent, c0_all, w0 = cpu_seconds([agent]), cpu_seconds([agent, *helpers]), time.monotonic()
        r0_agent, r0_all = thread_run_times([agent]), thread_run_times([agent, *helpers])
        rss, rss_all, pss = [], [], None
        while time.time() < t_ready + SLEEP - 1.0 and job.alive():
            rss.append(rss_mb([agent]))
            rss_all.append(rss_mb([agent, *helpers]))
            if pss is None and time.time() > t_ready + SLEEP / 2:
                pss = pss_mb([agent, *helpers, *workers])
            time.sleep(0.25)
        r1_agent, r1_all = thread_run_times([agent]), thread_run_times([agent, *helpers])
        c1_agent, c1_all, w1 = cpu_seconds([agent]), cpu_seconds([agent, *helpers]), time.monotonic()
        if not job.alive() or not rss:
            return error_run(run, job, "the launcher exited during the sampling window")
        window = w1 - w0
        agent_s, all_s = c1_agent - c0_agent, c1_all - c0_all
        if r0_agent is not None and r1_agent is not None and r0_all is not None and r1_all is not None:
            agent_s, all_s = run_time_between(r0_agent, r1_agent), run_time_between(r0_all, r1_all)
        run.update(
            ok=True,
            window_s=window,
            cpu_pct_agent=100 * agent_s / window,
            cpu_pct=100 * all_s / window,
            cpu_pct_ticks=100 * (c1_all - c0_all) / window,
            cpu_pct_by_process=per_process(agent, helpers, r0_all, r1_all, window),
            rss_mb=statistics.median(rss),
            rss_with_helpers_mb=statistics.median(rss_all),
            node_pss_mb=pss,
            threads=agent.num_threads(),
        )
        run["rc"] = job.wait(SLEEP + 30)
        return run
    finally:
        job.kill()


def per_process(
    agent: psutil.Process, helpers: list[psutil.Process], before: dict | None, after: dict | None, window: float
) -> dict[str, float] | None:
    """% of a core per process in the window (the agent, then each helper by its short command)."""
    if before is None or after is None:
        return None
    out = {}
    for p in [agent, *helpers]:
        name = "agent" if p is agent else short_command(p.cmdline()) if p.is_running() else str(p.pid)
        mine = {k: v for k, v in after.items() if k[0] == p.pid}
        out[name] = round(100 * run_time_between(before, mine) / window, 4)
    return out


def run(ctx: Context) -> list[Figure]:
    reps = ctx.params["overhead_reps"]
    cpu = Figure(NAME, "agent CPU while workers run (agent + helpers)", "% core")
    rss = Figure(NAME, "agent RSS while workers run", "MB")
    rss_all = Figure(NAME, "agent + helpers RSS while workers run", "MB")
    pss = Figure(NAME, "node PSS: agent + helpers + 2 workers", "MB")
    for rep in range(reps):
        for launcher in launcher_order(rep):
            result = ctx.record(NAME, one(ctx, launcher, rep))
            if not result.get("ok"):
                ctx.say(f"overhead {launcher} rep {rep}: FAILED {result['error']}")
                continue
            cpu.samples[launcher].append(result["cpu_pct"])
            rss.samples[launcher].append(result["rss_mb"])
            rss_all.samples[launcher].append(result["rss_with_helpers_mb"])
            if result.get("node_pss_mb") is not None:
                pss.samples[launcher].append(result["node_pss_mb"])
            ctx.say(
                f"overhead {launcher} rep {rep}: CPU {result['cpu_pct']:.2f}% of a core, RSS {result['rss_mb']:.0f} MB "
                f"(+helpers {result['rss_with_helpers_mb']:.0f} MB, node PSS "
                f"{result['node_pss_mb'] or float('nan'):.0f} MB), "
                f"{result['threads']} threads; by process {result['cpu_pct_by_process']} "
                f"(ticks: {result['cpu_pct_ticks']:.2f}%)"
            )
    cpu.target = "≤ 1% of a core"
    v = cpu.value("rally")
    cpu.met = None if v is None else v <= 1.0
    rss.target = "≤ torchrun's"
    r, t = rss.value("rally"), rss.value("torchrun")
    rss.met = None if r is None or t is None else r <= t
    rss_all.comment = helpers_comment(ctx.raw.get(NAME, []))
    pss.comment = "workers are plain Python (no torch)"
    cpu.comment = "each thread's run time (schedstat, ns); the 10 ms tick count beside it in the raw results"
    return [cpu, rss, rss_all, pss]
