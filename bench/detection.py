"""Benchmark 3 — detection: from a worker's exit to the launcher acting on it.

    rally                  --standalone --nproc-per-node 2 --max-restarts A-1 --log-dir D \
                           bench/workers/detect.py OUT
    LOGLEVEL=INFO torchrun (the same flags)

Two plain-Python workers (no torch, so a run is quick). Rank 1 installs a SIGTERM handler that
writes time.time() and exits; rank 0 then writes time.time() and calls os._exit(1) right
after. Every attempt fails the same way, so one launcher run gives A samples (A = 5; the
first from a fresh agent, the rest after restarts). Both launchers answer a failed worker by
sending SIGTERM to the other workers, so the same clock works for both:

* sibling SIGTERM = the sibling's handler time - the failing worker's exit time (the primary
  figure, median and p99);
* failure logged  = the launcher's own timestamped failure line - the exit time. rally:
  `HH:MM:SS.mmm rally: error: root cause: ...` (rally stamps its lines when stderr is not a
  terminal); torchrun: the glog-style `EMMDD HH:MM:SS.uuuuuu ... failed (exitcode: 1)` line
  (millisecond resolution), the k-th such line for attempt k. Both lines come after the
  other worker was stopped.
"""

from __future__ import annotations

import re

from bench.common import (
    WORKERS,
    Context,
    Figure,
    Job,
    bench_env,
    error_run,
    glog_line_time,
    launcher_cmd,
    launcher_order,
    rally_line_time,
    read_float,
    run_dir,
)

NAME = "detection"


ATTEMPTS = 5


def log_time(launcher: str, stderr: str, attempt: int, reference: float) -> float | None:
    """The time of the launcher's failure line for `attempt` (its attempt-th such line)."""
    pattern = r"rally: error: root cause:" if launcher == "rally" else r"failed \(exitcode"
    parse = rally_line_time if launcher == "rally" else glog_line_time
    lines = [line for line in stderr.splitlines() if re.search(pattern, line)]
    if len(lines) <= attempt:
        return None
    return parse(lines[attempt], pattern, reference)


def agent_noticed_times(log_dir) -> list[float]:  # a Path
    """rally only: when the agent registered each failed exit (events.jsonl `worker_exited`,
    written in the same loop iteration in which the worker's pidfd turned readable)."""
    import json

    times = []
    for events in sorted(log_dir.glob("*/events.jsonl")):
        for line in events.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "worker_exited" and record.get("returncode") == 1:
                times.append(record["time"])
    return sorted(times)


def one(ctx: Context, launcher: str, rep: int) -> dict:
    d = run_dir(ctx.root, NAME, f"{launcher}-r{rep}")
    out = run_dir(d, "out")
    run = {"launcher": launcher, "rep": rep, "cpu_busy_before": ctx.settle()}
    argv = launcher_cmd(launcher) + [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(ATTEMPTS - 1),
        "--log-dir",
        str(d / "logs"),
        str(WORKERS / "detect.py"),
        str(out),
    ]
    extra = {"LOGLEVEL": "INFO"} if launcher == "torchrun" else {}
    run["argv"], run["env"] = argv, extra
    job = Job.start(launcher, argv, bench_env(extra), d, d)
    try:
        rc = job.wait(60 + 10 * ATTEMPTS)
        if rc is None:
            return error_run(run, job, f"no exit within {60 + 10 * ATTEMPTS} s")
        stderr = job.stderr()
        noticed = agent_noticed_times(d / "logs") if launcher == "rally" else []
        attempts = []
        for k in range(ATTEMPTS):
            exit_ts, term_ts = read_float(out / f"exit.{k}"), read_float(out / f"term.{k}")
            if exit_ts is None or term_ts is None:
                continue
            logged = log_time(launcher, stderr, k, exit_ts)
            attempts.append(
                {
                    "attempt": k,
                    "sibling_sigterm_ms": (term_ts - exit_ts) * 1000,
                    "failure_logged_ms": (logged - exit_ts) * 1000 if logged is not None else None,
                    "agent_noticed_ms": (noticed[k] - exit_ts) * 1000 if k < len(noticed) else None,
                }
            )
        run.update(ok=len(attempts) == ATTEMPTS, rc=rc, attempts=attempts)
        if not run["ok"]:
            return error_run(run, job, f"exit code {rc}; {len(attempts)}/{ATTEMPTS} attempts measured")
        return run
    finally:
        job.kill()


def run(ctx: Context) -> list[Figure]:
    reps = ctx.params["detection_reps"]
    sibling = Figure(NAME, "worker exit → sibling SIGTERM", "ms")
    sibling_p99 = Figure(NAME, "worker exit → sibling SIGTERM", "ms", stat="p99")
    logged = Figure(NAME, "worker exit → failure logged", "ms")
    noticed = Figure(NAME, "worker exit → agent notices it (rally: events.jsonl)", "ms")
    noticed_p99 = Figure(NAME, "worker exit → agent notices it (rally: events.jsonl)", "ms", stat="p99")
    for rep in range(reps):
        for launcher in launcher_order(rep):
            result = ctx.record(NAME, one(ctx, launcher, rep))
            if not result.get("ok"):
                ctx.say(f"detection {launcher} rep {rep}: FAILED {result['error']}")
            for a in result.get("attempts", []):
                sibling.samples[launcher].append(a["sibling_sigterm_ms"])
                if a["failure_logged_ms"] is not None:
                    logged.samples[launcher].append(a["failure_logged_ms"])
                if a.get("agent_noticed_ms") is not None:
                    noticed.samples[launcher].append(a["agent_noticed_ms"])
            ctx.say(
                f"detection {launcher} rep {rep}: sibling SIGTERM "
                + ", ".join(f"{a['sibling_sigterm_ms']:.1f}" for a in result.get("attempts", []))
                + " ms; logged "
                + ", ".join(
                    f"{a['failure_logged_ms']:.1f}" if a["failure_logged_ms"] is not None else "?"
                    for a in result.get("attempts", [])
                )
                + " ms"
            )
    sibling_p99.samples = sibling.samples
    noticed_p99.samples = noticed.samples
    noticed.notes["torchrun"] = noticed_p99.notes["torchrun"] = "not recorded"
    noticed.target = "≤ 5 ms"
    value = noticed.value("rally")
    noticed.met = None if value is None else value <= 5.0
    noticed.comment = "torchrun records no such event; its 0.1 s monitor poll bounds it"
    sibling.comment = "same clock for both: the sibling's SIGTERM handler"
    logged.comment = "rally 'root cause' line vs torchrun 'failed (exitcode' line"
    return [sibling, sibling_p99, logged, noticed, noticed_p99]
