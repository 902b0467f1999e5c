"""Goodput side by side in one run: the share of a job's wall time kept as training progress.

    python -m bench.goodput                            240 s per run, rank 1 killed every 60 s
    python -m bench.goodput --duration 60 --kill-every 20 --only rally,torchrun     a short look

The job (bench/workers/goodput.py, its docstring has the details): 2 ranks in lockstep over gloo,
a 400 MB state (25 x 2000 x 2000 float32) overwritten in place every step, 0.1 s of compute a
step. Every ``--kill-every`` seconds from the launch the bench SIGKILLs rank 1; the launcher
restarts both ranks, which resume from their newest checkpoint. Each method checkpoints at its
own optimal interval (Young: sqrt(2 x its measured save stall x the time between failures)).
Every run lasts ``--duration`` seconds from the launch; its **progress** is the last step reached
by then, and its **goodput** that progress over the failure-free ideal's: the same job with no
checkpoint and no failure, run under torchrun and under rally (the better of the two counts, so
no launcher's own start-up is taken as the ideal).

Rows: rally (``rally.job.save``, the memory tier persisted to ``--checkpoint-dir`` in the
background), torchrun + ``torch.save`` (rank 0, fsync, atomic rename; with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as in bench/restart.py: with its default its restarted
gloo ranks read the killed attempt's addresses and fail or hang) and DLRover 0.6.1's flash
checkpoint under its ``dlrover-run`` (bench/shim/dlrover_run.py; from the interpreter in
``RALLY_BENCH_DLROVER_PYTHON``, as bench/checkpoint.py; without it, its row says so). Where the
time went, as seconds of the run: **saves** (the steps' stall in ``save``), **restarts** (each
kill until both ranks step again: the launcher's share, kill -> the new rank 0 running the
script's first line, then the script's own start: imports, ``init_process_group``, the reload),
**redone** (steps computed again because they came after the last checkpoint, x the step time).
rally's share is then broken down phase by phase (PHASES below, median and range over the kills),
from the timestamps in its agent's own ``events.jsonl`` (under ``--log-dir``) and every new rank's
first line: the kill, the agent noticing it, the other workers stopped, the restart decided, the
next round formed, its set-up, the forks, the script running.
Writes bench/results/goodput.md and goodput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/goodput.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import psutil

from bench import common
from bench.checkpoint import DLROVER_SHIM, dlrover_python
from bench.common import REPO, RESULTS, Job
from bench.scratch import scratch_dir

WORKER = REPO / "bench" / "workers" / "goodput.py"
RUNS = ("ideal_torchrun", "ideal_rally", "rally", "torchrun", "dlrover")
LABELS = {
    "ideal_torchrun": "failure-free ideal, torchrun (no checkpoint, no kill)",
    "ideal_rally": "failure-free ideal, rally (no checkpoint, no kill)",
    "rally": "rally, `rally.job.save` (memory tier)",
    "torchrun": "torchrun + `torch.save` (rank 0, fsync)",
    "dlrover": "DLRover 0.6.1 flash checkpoint",
}
METHOD = {
    "ideal_torchrun": "none",
    "ideal_rally": "none",
    "rally": "rally",
    "torchrun": "torch_save",
    "dlrover": "dlrover",
}
MAX_RESTARTS = "100"
EXIT_GRACE = 60.0
"""Seconds past the run's end allowed for the job to stop (a restart under way finishes first)."""


def command(name: str, run: Path, until: float, mtbf: float) -> list[str]:
    work = [str(WORKER), "--method", METHOD[name], "--dir", str(run / "ckpt"), "--events", str(run / "events.jsonl"),
            "--pid-file", str(run / "rank1.pid"), "--until", f"{until:.3f}", "--mtbf", str(mtbf)]  # fmt: skip
    if name == "dlrover":
        return [dlrover_python() or "python", str(DLROVER_SHIM), "--standalone", "--nproc_per_node", "2",
                "--max_restarts", MAX_RESTARTS, *work]  # fmt: skip
    if name.endswith("torchrun"):
        return [*common.launcher_cmd("torchrun"), "--standalone", "--nproc-per-node", "2",
                "--max-restarts", MAX_RESTARTS, *work]  # fmt: skip
    extra = ["--checkpoint-dir", str(run / "ckpt")] if name == "rally" else []
    return [*common.launcher_cmd("rally"), "--standalone", "--nproc-per-node", "2", "--max-restarts", MAX_RESTARTS,
            "--log-dir", str(run / "logs"), *extra, *work]  # fmt: skip


def kill_rank1(job: Job, pid_file: Path, killed: set[int]) -> float | None:
    """SIGKILL the current rank 1 (a descendant of this job, not killed before); the time, or None."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    if pid in killed or pid not in {p.pid for p in job.refresh()}:
        return None  # not started yet in this attempt, or not ours
    try:
        psutil.Process(pid).send_signal(signal.SIGKILL)
    except psutil.Error:
        return None
    killed.add(pid)
    return time.time()


def run_once(name: str, root: Path, duration: float, kill_every: float) -> dict[str, Any]:
    run = root / name
    (run / "ckpt").mkdir(parents=True)
    launched = time.time()
    until = launched + duration
    # torchrun's restarts need a fresh store per round in torch 2.13 (as in bench/restart.py): with
    # its default the restarted gloo ranks read the killed attempt's addresses (research notes 1.6)
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if name.endswith("torchrun") else None
    job = Job.start(name, command(name, run, until, kill_every), common.bench_env(extra), REPO, run)
    kills: list[float] = []
    killed: set[int] = set()
    try:
        if not name.startswith("ideal"):
            next_kill = launched + kill_every
            while next_kill < until and time.time() < until and job.alive():
                time.sleep(max(0.0, min(0.05, next_kill - time.time())))
                # Retried every 50 ms until rank 1 of the current attempt is up to be killed.
                if time.time() >= next_kill and (at := kill_rank1(job, run / "rank1.pid", killed)) is not None:
                    kills.append(at)
                    next_kill += kill_every
        code = job.wait(until - time.time() + EXIT_GRACE)
    finally:
        job.kill()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    result = analyze(events, kills, launched, until)
    if name == "rally":  # where rally's share went, from its agent's own event log
        result["phases"] = restart_phases(agent_events(run / "logs"), events, kills)
    if code != 0:
        result["error"] = f"exit {code}: {job.tail(6)}"
    return result


def analyze(events: list[dict[str, Any]], kills: list[float], launched: float, until: float) -> dict[str, Any]:
    """Progress and where the time went, from rank 0's events and the kill times."""
    events = [e for e in events if e.get("rank", 0) == 0]  # rank 0's view (every rank logs its start)
    steps = [e for e in events if e["e"] == "step" and e["t"] <= until]
    saves = [e for e in events if e["e"] == "save" and e["t"] <= until]
    step_time = statistics.median(e["seconds"] for e in steps) if steps else 0.0
    restarts, launcher_share, redone = [], [], 0
    for kill in kills:
        # The attempt the kill ended: rank 0 of that attempt may still finish a step after the kill.
        ended = max((e["a"] for e in events if e["e"] == "start" and e["at"] < kill), default=0)
        later = [e for e in events if e["a"] > ended]
        before = [e["step"] for e in steps if e["a"] == ended]
        start = next((e for e in later if e["e"] == "start"), None)
        resumed = next((e for e in later if e["e"] == "resumed"), None)
        stepping = next((e for e in later if e["e"] == "step" and e["t"] <= until), None)
        if start is not None:
            launcher_share.append(start["at"] - kill)
        if stepping is not None:
            restarts.append(stepping["t"] - kill)
        if before:
            redone += max(before) - (resumed["step"] if resumed else 0)
    intervals = [e["steps"] for e in events if e["e"] == "interval"]
    first_step = steps[0]["t"] - launched if steps else None
    return {
        "progress": max((e["step"] for e in steps), default=0),
        "step_time": step_time,
        "first_step_after": first_step,
        "saves": len(saves),
        "stall": statistics.median(e.get("stall", e["seconds"]) for e in saves) if saves else None,
        "save_seconds": sum(e["seconds"] for e in saves),
        "interval": statistics.median(intervals) if intervals else None,
        "kills": len(kills),
        "restart": restarts,
        "launcher_share": launcher_share,
        "restart_seconds": sum(restarts),
        "redone_steps": redone,
        "redone_seconds": redone * step_time,
    }


PHASES = {
    "notice": "kill -> agent notices (the killed rank's pidfd: includes the kernel freeing its memory)",
    "stop": "-> the checkpoint tier's round closed, the other workers stopped (`round_ended`)",
    "decide": "-> the end acknowledged in the store, restart decided (`restart`)",
    "rendezvous": "-> the next round formed (`round_formed`)",
    "setup": "-> workers' store, pre-flight, the checkpoint tier's round open (`workers_starting`)",
    "fork": "-> every new worker forked from the template (last `worker_started`)",
    "script": "-> every new worker runs the script's first line",
}


def agent_events(log_dir: Path) -> list[dict[str, Any]]:
    """The rally agent's events.jsonl (one run directory under ``--log-dir``)."""
    lines = [line for path in sorted(log_dir.glob("*/events.jsonl")) for line in path.read_text().splitlines()]
    return [json.loads(line) for line in lines if line.strip()]


def restart_phases(agent: list[dict[str, Any]], worker: list[dict[str, Any]], kills: list[float]) -> list[dict]:
    """Each kill's restart as rally's agent lived it: seconds per phase (PHASES), from the agent's
    event timestamps and every new rank's first line (same clock: time.time() on one machine)."""
    out = []
    for kill in kills:
        after = [e for e in agent if e["time"] >= kill]
        noticed = next((e for e in after if e["event"] == "worker_exited"), None)
        ended = next((e for e in after if e["event"] == "round_ended"), None)
        decided = next((e for e in after if e["event"] in ("restart", "membership_change")), None)
        formed = next((e for e in after if e["event"] == "round_formed"), None)
        if None in (noticed, ended, decided, formed):
            continue
        r = formed["round"]
        starting = next((e for e in after if e["event"] == "workers_starting" and e["round"] == r), None)
        started = [e["time"] for e in after if e["event"] == "worker_started" and e["round"] == r]
        firsts = [e["at"] for e in worker if e["e"] == "start" and e["a"] == formed["restart_count"]]
        script = max(firsts) if len(firsts) == len(started) else None  # every new worker's first line
        marks = [kill, noticed["time"], ended["time"], decided["time"], formed["time"],
                 starting["time"] if starting else formed["time"], max(started, default=None), script]  # fmt: skip
        if None in marks:
            continue
        phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
        phases["stop_workers"] = ended.get("stop_seconds")  # of "stop": the workers alone
        phases["total"] = marks[-1] - kill
        out.append(phases)
    return out


def phase_table(phases: list[dict[str, Any]]) -> str:
    """rally's share of a restart, phase by phase: median and range over the kills."""
    if not phases:
        return ""
    lines = ["| rally's share of a restart, phase by phase (agent's events.jsonl) | median | min - max |"]
    lines.append("|---|---|---|")
    for name, label in [*PHASES.items(), ("total", "**kill -> script running (rally's share)**")]:
        values = [p[name] for p in phases]
        lines.append(f"| {label} | {statistics.median(values):.3f} s | {min(values):.3f} - {max(values):.3f} s |")
    stops = [p["stop_workers"] for p in phases if p.get("stop_workers") is not None]
    if stops:
        lines.append(f"| (of stop: stopping the workers alone) | {statistics.median(stops):.3f} s | "
                     f"{min(stops):.3f} - {max(stops):.3f} s |")  # fmt: skip
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".2f", unit: str = " s") -> str:
    return "—" if value is None else format(value, spec) + unit


def table(results: dict[str, dict[str, Any]], duration: float, kill_every: float) -> str:
    ideal = max((results[n]["progress"] for n in ("ideal_torchrun", "ideal_rally") if n in results), default=0)
    torchrun = results.get("torchrun", {}).get("progress")
    lines = [
        f"| {duration:.0f} s, rank 1 SIGKILLed every {kill_every:.0f} s | save stall (median) | checkpoint every "
        "| kill -> script running (launcher) | kill -> stepping again | steps reached | goodput | ÷ torchrun "
        "| lost to saves | lost to restarts | redone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "progress" not in r:
            lines.append(f"| {LABELS[name]} | {r.get('error', '')[:160]} |" + " |" * 9)
            continue
        goodput = r["progress"] / ideal if ideal else None
        versus = r["progress"] / torchrun if torchrun and not name.startswith("ideal") else None
        share = r["launcher_share"]
        restart = r["restart"]
        lines.append(
            f"| {LABELS[name]}{' (' + r['error'][:60] + ')' if 'error' in r else ''} | {fmt(r['stall'], '.3f')} | "
            f"{fmt(r['interval'], '.0f', ' steps')} | "
            f"{fmt(statistics.median(share) if share else None)} | "
            f"{fmt(statistics.median(restart) if restart else None)} ({len(restart)} of {r['kills']}) | "
            f"{r['progress']} | {fmt(goodput, '.3f', '')} | {fmt(versus, '.2f', '×')} | "
            f"{fmt(r['save_seconds'], '.1f')} | {fmt(r['restart_seconds'], '.1f')} | "
            f"{r['redone_steps']} steps ({fmt(r['redone_seconds'], '.1f')}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=240.0, help="seconds per run from launch (default 240)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills of rank 1 (default 60)")
    parser.add_argument("--only", default=",".join(RUNS), help="runs, comma-separated: " + ",".join(RUNS))
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    wanted = [r for r in RUNS if r in args.only.split(",")]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    with scratch_dir(args.keep) as root:  # removed on every way out (bench/scratch.py)
        for name in wanted:
            if name == "dlrover" and dlrover_python() is None:
                results[name] = {"error": "not installed (RALLY_BENCH_DLROVER_PYTHON)"}
                continue
            print(f"{time.strftime('%H:%M:%S')} {name} ({args.duration:.0f} s)", file=sys.stderr, flush=True)
            try:
                results[name] = run_once(name, root, args.duration, args.kill_every)
            except (OSError, ValueError) as exc:
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    text = table(results, args.duration, args.kill_every)
    if phases := phase_table(results.get("rally", {}).get("phases", [])):
        text += f"\n\n{phases}"
    args_given = argv if argv is not None else sys.argv[1:]
    header = common.run_header("Goodput benchmark", "bench.goodput", args_given, started, load_start)
    print(header + "\n\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "goodput.md").write_text(header + "\n\n" + text + "\n")
    (RESULTS / "goodput.json").write_text(json.dumps({"date": started, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
