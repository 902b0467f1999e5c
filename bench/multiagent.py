"""Benchmark 4 — multi-agent rendezvous: N agents on 127.0.0.1, one plain worker each.

    rally    --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
             --rdzv-id ID --local-addr 127.0.0.1 --log-dir D bench/workers/plain_ready.py OUT
    LOGLEVEL=INFO torchrun (the same without --local-addr)

PORT is assigned by the OS (bind 127.0.0.1:0). Every agent is started through
bench/shim/agent_shim.py, which runs the launcher's console script unchanged and records
when that agent's `import torch` returned (the slow part of an agent's start: N agents
importing torch on 2 cores take many seconds). Workers (plain Python, no torch) write
time.time() at their first line. Measured per run:

* rendezvous done    = the last agent's "rendezvous complete" log line - the last agent's
  torch import done: the rendezvous itself (store connect, join, round close). rally's line
  is `HH:MM:SS.mmm rally: round 0: node ...`, torchrun's `I... Rendezvous complete for
  workers` (LOGLEVEL=INFO). An agent joins within milliseconds of its import returning, for
  both launchers, so this is the figure for "rendezvous complete after the last agent joins";
* workers running    = the last worker's first line - the last agent's torch import done: the
  above plus starting one worker per node (when rally forks workers from a template, the
  template must have finished its own preload first);
* after last start   = the last worker's first line - the moment the last agent process was
  started (everything: N agents importing torch on 2 cores, plus any templates' preloads);
* peak RSS per agent = VmHWM of each agent process (kernel-tracked peak, read from
  /proc/PID/status while it runs), median over the N agents; "+ helpers" adds the peaks of the
  agent's non-worker child processes (rally: its orphan guard, and its worker template when it
  starts one; torchrun has none). Which helpers ran is recorded per run.
"""

from __future__ import annotations

import statistics
import sys
import time

import psutil

from bench.common import (
    SHIM,
    WORKERS,
    Context,
    Figure,
    Job,
    bench_env,
    error_run,
    free_port,
    glog_line_time,
    launcher_exe,
    launcher_order,
    rally_line_time,
    read_float,
    run_dir,
    short_command,
)

NAME = "multiagent"


def vm_hwm_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def helpers_of(proc: psutil.Process, worker_marker: str) -> list[psutil.Process]:
    """The agent's child processes that are not workers."""
    out = []
    try:
        for child in proc.children():
            try:
                if worker_marker not in " ".join(child.cmdline()):
                    out.append(child)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return out


def one(ctx: Context, launcher: str, nodes: int, rep: int) -> dict:
    d = run_dir(ctx.root, NAME, f"{launcher}-n{nodes}-r{rep}")
    out, marks = run_dir(d, "out"), run_dir(d, "marks")
    run = {"launcher": launcher, "nodes": nodes, "rep": rep, "cpu_busy_before": ctx.settle()}
    port = free_port()
    args = [
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"bench-{launcher}-{nodes}-{rep}",
    ]
    if launcher == "rally":
        args += ["--local-addr", "127.0.0.1", "--no-preflight"]  # its cost is bench/preflight.py's
    argv_tail = args + ["--log-dir", str(d / "logs"), str(WORKERS / "plain_ready.py"), str(out)]
    run["argv"] = [launcher] + argv_tail
    extra = {"BENCH_IMPORT_MARK": str(marks)}
    if launcher == "torchrun":
        extra["LOGLEVEL"] = "INFO"
    env = bench_env(extra)
    timeout = 60 + 5 * nodes
    jobs: list[Job] = []
    peak_agent: dict[int, int] = {}
    peak_helpers: dict[int, dict[int, int]] = {}
    helper_names: set[str] = set()
    try:
        for i in range(nodes):
            argv = [sys.executable, str(SHIM), launcher_exe(launcher), *argv_tail]
            jobs.append(Job.start(f"agent{i}", argv, env, d, d))
        t_last_start = jobs[-1].t_start
        deadline = time.monotonic() + timeout
        agent_pids = {j.pid for j in jobs}
        while time.monotonic() < deadline and any(j.alive() for j in jobs):
            # One scan of the process table per round: helpers are the agents' children
            # that are not workers.
            for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
                info = proc.info
                pid, ppid = info["pid"], info["ppid"]
                if pid in agent_pids:
                    hwm = vm_hwm_kb(pid)
                    if hwm:
                        peak_agent[pid] = hwm
                elif ppid in agent_pids and "plain_ready.py" not in " ".join(info["cmdline"] or []):
                    hwm = vm_hwm_kb(pid)
                    if hwm:
                        peak_helpers.setdefault(ppid, {})[pid] = hwm
                        helper_names.add(short_command(info["cmdline"] or []))
            time.sleep(0.3)
        codes = [j.popen.poll() for j in jobs]
        run["helpers"] = sorted(helper_names)
        ready = [read_float(out / f"ready.{r}") for r in range(nodes)]
        imported = [read_float(marks / str(j.pid)) for j in jobs]
        run["exit_codes"] = codes
        if any(r is None for r in ready):
            return error_run(
                run,
                jobs[0],
                f"{sum(r is not None for r in ready)}/{nodes} workers ran within {timeout} s; exit codes {codes}",
            )
        if any(t is None for t in imported):
            return error_run(run, jobs[0], "an agent never recorded its torch import")
        last_ready = max(ready)
        if launcher == "rally":
            formed = [rally_line_time(j.stderr(), r"rally: round 0:", last_ready) for j in jobs]
        else:
            formed = [glog_line_time(j.stderr(), r"Rendezvous complete for workers", last_ready) for j in jobs]
        joined = None
        if launcher == "torchrun":  # torchrun also logs when each agent starts to join
            joins = [glog_line_time(j.stderr(), r"Rendezvous'ing worker group", last_ready) for j in jobs]
            joined = max(joins) if all(joins) else None
        run.update(
            rendezvous_done=(max(formed) - max(imported)) if all(formed) else None,
            # diagnostics: torchrun's last "Rendezvous'ing worker group" line, relative to the
            # last import and to its last "Rendezvous complete" line
            last_join_line_after_last_import=(joined - max(imported)) if joined else None,
            done_after_last_join_line=(max(formed) - joined) if joined and all(formed) else None,
            ok=all(c == 0 for c in codes),
            after_last_import=last_ready - max(imported),
            after_last_start=last_ready - t_last_start,
            import_spread=max(imported) - min(imported),
            last_import_after_last_start=max(imported) - t_last_start,
            peak_rss_mb=[peak_agent.get(j.pid, 0) / 1024 for j in jobs],
            peak_rss_with_helpers_mb=[
                (peak_agent.get(j.pid, 0) + sum(peak_helpers.get(j.pid, {}).values())) / 1024 for j in jobs
            ],
        )
        if not run["ok"]:
            run["error"] = f"workers ran but exit codes were {codes}"
            run["log_tail"] = jobs[0].tail()
        return run
    finally:
        for job in jobs:
            job.kill()


def helpers_comment(runs: list[dict]) -> str:
    """Which helper processes each launcher's agents had, from the runs' records."""
    parts = []
    for launcher in ("rally", "torchrun"):
        names = sorted({h for r in runs if r.get("launcher") == launcher for h in r.get("helpers", [])})
        parts.append(f"{launcher} helpers: {', '.join(names) if names else 'none'}")
    return "; ".join(parts)


def run(ctx: Context) -> list[Figure]:
    sizes, reps = ctx.params["multiagent_nodes"], ctx.params["multiagent_reps"]
    formed = {n: Figure(NAME, f"{n} agents: rendezvous done after last agent's import", "s") for n in sizes}
    after_import = {n: Figure(NAME, f"{n} agents: workers running after last agent's import", "s") for n in sizes}
    after_start = {n: Figure(NAME, f"{n} agents: workers running after last agent started", "s") for n in sizes}
    rss = Figure(NAME, "agent peak RSS (median agent, all runs)", "MB")
    rss_helpers = Figure(NAME, "agent + helpers peak RSS (median agent, all runs)", "MB")
    for n in sizes:
        # 16 and 32 agents (and, for rally, as many templates) importing torch on 2 cores take
        # minutes per run: one repetition there.
        for rep in range(reps if n <= 8 else min(reps, 1)):
            for launcher in launcher_order(rep):
                result = ctx.record(NAME, one(ctx, launcher, n, rep))
                if "after_last_import" in result:
                    if result.get("rendezvous_done") is not None:
                        formed[n].samples[launcher].append(result["rendezvous_done"])
                    after_import[n].samples[launcher].append(result["after_last_import"])
                    after_start[n].samples[launcher].append(result["after_last_start"])
                    rss.samples[launcher].append(statistics.median(result["peak_rss_mb"]))
                    rss_helpers.samples[launcher].append(statistics.median(result["peak_rss_with_helpers_mb"]))
                    ctx.say(
                        f"multiagent {launcher} N={n} rep {rep}: rendezvous done "
                        f"{result.get('rendezvous_done') or float('nan'):.3f} s "
                        f"and workers running {result['after_last_import']:.3f} s after last import, "
                        f"{result['after_last_start']:.2f} s after last start, "
                        f"RSS {statistics.median(result['peak_rss_mb']):.0f} MB, exit codes ok={result['ok']}"
                    )
                if not result.get("ok"):
                    ctx.say(f"multiagent {launcher} N={n} rep {rep}: FAILED {result.get('error')}")
    figures = []
    for n in sizes:
        f = formed[n]
        f.target = "≤ 0.1 s"
        value = f.value("rally")
        f.met = None if value is None else value <= 0.1
        figures += [f, after_import[n], after_start[n]]
    rss.target = "≤ torchrun's"
    r, t = rss.value("rally"), rss.value("torchrun")
    rss.met = None if r is None or t is None else r <= t
    rss_helpers.comment = helpers_comment(ctx.raw.get(NAME, []))
    figures += [rss, rss_helpers]
    return figures
