"""Goodput side by side in one run: the share of a job's wall time kept as training progress.

    python -m bench.goodput                            240 s per run, rank 1 killed every 60 s
    python -m bench.goodput --duration 60 --kill-every 20 --only rally,torchrun     a short look
    python -m bench.goodput --setup-seconds 20 --fault-every 60 --alternate      the realistic job

With ``--alternate`` the faults alternate, starting with a **soft fault** (rank 1's training
function raises an exception: the bench creates a file its next step renames and raises on) and
then a SIGKILL of rank 1. ``--setup-seconds`` gives every process a set-up before its training
function (a sleep standing for the model's and data's construction, bench/workers/goodput.py says
why). The rows then include rally with ``rally.job.run`` (the function re-entered in the surviving
processes; ``rally_run_spare`` with ``--warm-spares 1`` when rally has that option, else the row
says it is not available) and NVIDIA's in-process ``Wrapper`` under torchrun (``nvrx``: its sources
from nvidia-resiliency-ext, found through ``RALLY_BENCH_NVRX_SRC``; without it the row says how to
get them; an exception is restarted in-process, a SIGKILL by torchrun's whole restart). Per fault:
fault -> every rank stepping again, and whether the survivors' pids stayed the same (both ranks
for an exception, rank 0 for a SIGKILL). "Stepping again" is the moment the *last* rank begins
its first step of the next entry of the function (each rank's ``stepping`` line, after its
``load_latest`` and its copy into the model): what the job waits for before it trains again.
It used to be rank 0's first step *done*, which also counted that step's compute and all-reduce
(0.1-0.2 s of training, not of recovery); that figure stays in goodput_setup.json
(``first_step_done``). For rally's in-process rows the interval is then broken down phase by
phase (REENTRY_PHASES) from the agent's events.jsonl and every rank's re-entry timestamps.

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
Writes bench/results/goodput.md and goodput.json (kills only, no set-up); with a set-up,
goodput_setup.*; with ``--alternate`` and no set-up, goodput_setup0.* (the pair the "same whether the
set-up takes 0 s or 20 s" comparison reads).
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
RUNS = ("ideal_torchrun", "ideal_rally", "rally_run", "rally_run_spare", "rally", "torchrun", "nvrx", "dlrover")
DEFAULT_RUNS = ("ideal_torchrun", "ideal_rally", "rally", "torchrun", "dlrover")
"""Without ``--alternate``: the rows of the kills-only benchmark, as before."""
LABELS = {
    "ideal_torchrun": "failure-free ideal, torchrun (no checkpoint, no kill)",
    "ideal_rally": "failure-free ideal, rally (no checkpoint, no kill)",
    "rally_run": "rally, `rally.job.run` + `rally.job.save` (in-process restart)",
    "rally_run_spare": "rally, `rally.job.run` + `--warm-spares 1`",
    "rally": "rally, `rally.job.save` (memory tier, whole restarts)",
    "torchrun": "torchrun + `torch.save` (rank 0, fsync)",
    "nvrx": "torchrun + NVIDIA `inprocess.Wrapper` + `torch.save`",
    "dlrover": "DLRover 0.6.1 flash checkpoint",
}
METHOD = {
    "ideal_torchrun": "none",
    "ideal_rally": "none",
    "rally_run": "rally",
    "rally_run_spare": "rally",
    "rally": "rally",
    "torchrun": "torch_save",
    "nvrx": "torch_save",
    "dlrover": "dlrover",
}
REENTER = {"rally_run": "rally", "rally_run_spare": "rally", "nvrx": "nvrx"}
NVRX_ENV = "RALLY_BENCH_NVRX_SRC"
NVRX_HOWTO = (
    f"not available: set {NVRX_ENV} to nvidia-resiliency-ext's src directory (git archive of "
    "github.com/NVIDIA/nvidia-resiliency-ext's src/, plus a directory holding defusedxml and httpx, "
    "joined by ':')"
)


def nvrx_paths() -> str | None:
    """The directories NVIDIA's Wrapper is imported from (``RALLY_BENCH_NVRX_SRC``), or None."""
    value = os.environ.get(NVRX_ENV, "")
    paths = [p for p in value.split(os.pathsep) if p]
    if not paths or not any((Path(p) / "nvidia_resiliency_ext" / "inprocess" / "wrap.py").is_file() for p in paths):
        return None
    return os.pathsep.join(paths)


def has_warm_spares() -> bool:
    """Whether this rally has ``--warm-spares`` (an unknown option is exit 2 before --version)."""
    import subprocess

    # wait: rally --version prints and exits; bounded by the timeout
    cmd = [*common.launcher_cmd("rally"), "--warm-spares=1", "--version"]
    return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0


MAX_RESTARTS = "100"
EXIT_GRACE = 60.0
"""Seconds past the run's end allowed for the job to stop (a restart under way finishes first)."""


def command(name: str, run: Path, until: float, mtbf: float, setup: float = 0.0) -> list[str]:
    work = [str(WORKER), "--method", METHOD[name], "--dir", str(run / "ckpt"), "--events", str(run / "events.jsonl"),
            "--pid-file", str(run / "rank1.pid"), "--until", f"{until:.3f}", "--mtbf", str(mtbf),
            "--setup-seconds", str(setup), "--raise-file", str(run / "raise"),
            "--reenter", REENTER.get(name, "none")]  # fmt: skip
    if name == "dlrover":
        return [dlrover_python() or "python", str(DLROVER_SHIM), "--standalone", "--nproc_per_node", "2",
                "--max_restarts", MAX_RESTARTS, *work]  # fmt: skip
    if name.endswith("torchrun") or name == "nvrx":
        return [*common.launcher_cmd("torchrun"), "--standalone", "--nproc-per-node", "2",
                "--max-restarts", MAX_RESTARTS, *work]  # fmt: skip
    extra = ["--checkpoint-dir", str(run / "ckpt")] if METHOD[name] == "rally" else []
    if name == "rally_run_spare":
        extra.append("--warm-spares=1")
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


def run_once(
    name: str, root: Path, duration: float, kill_every: float, setup: float = 0.0, alternate: bool = False
) -> dict[str, Any]:
    run = root / name
    (run / "ckpt").mkdir(parents=True)
    launched = time.time()
    until = launched + duration
    # torchrun's restarts need a fresh store per round in torch 2.13 (as in bench/restart.py): with
    # its default the restarted gloo ranks read the killed attempt's addresses (research notes 1.6)
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if name.endswith("torchrun") or name == "nvrx" else {}
    if name == "nvrx":
        extra["PYTHONPATH"] = os.pathsep.join(p for p in (nvrx_paths(), os.environ.get("PYTHONPATH")) if p)
        extra["TORCH_CPP_LOG_LEVEL"] = "error"
    cmd = command(name, run, until, kill_every, setup)
    job = Job.start(name, cmd, common.bench_env(extra or None), REPO, run)
    kills: list[float] = []
    raises = 0
    killed: set[int] = set()
    try:
        if not name.startswith("ideal"):
            next_kill = launched + kill_every
            while next_kill < until and time.time() < until and job.alive():
                time.sleep(max(0.0, min(0.05, next_kill - time.time())))
                if time.time() < next_kill:
                    continue
                if alternate and (raises + len(kills)) % 2 == 0:
                    # A soft fault: rank 1's next step renames this file away and raises (its time logged).
                    (run / "raise").write_text("")
                    raises += 1
                    next_kill += kill_every
                # Retried every 50 ms until rank 1 of the current attempt is up to be killed.
                elif (at := kill_rank1(job, run / "rank1.pid", killed)) is not None:
                    kills.append(at)
                    next_kill += kill_every
        code = job.wait(until - time.time() + EXIT_GRACE)
    finally:
        job.kill()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    faults = sorted([(at, "SIGKILL") for at in kills] + [(e["t"], "exception") for e in events if e["e"] == "raised"])
    result = analyze(events, faults, launched, until)
    if name == "rally":  # where rally's share went, from its agent's own event log
        result["phases"] = restart_phases(agent_events(run / "logs"), events, [t for t, _ in faults])
    if REENTER.get(name) == "rally":  # where an in-process restart went: the agent's and the ranks' marks
        result["reentry_phases"] = reentry_phases(agent_events(run / "logs"), events, faults)
    if code != 0:
        result["error"] = f"exit {code}: {job.tail(6)}"
    return result


def analyze(
    events: list[dict[str, Any]], faults: list[tuple[float, str]], launched: float, until: float
) -> dict[str, Any]:
    """Progress and where the time went, from rank 0's events, every entry's and the faults' times.

    An entry of the training function is rank 0's ``en`` (pid.n): a fault ends the entry rank 0
    entered last before it, and every rank steps again at rank 0's first step of another entry
    (the ranks step in lockstep: rank 0's step ends with an all-reduce of every rank's)."""
    entered = [e for e in events if e["e"] == "entered"]
    starts = [e for e in events if e["e"] == "stepping"]
    events = [e for e in events if e.get("rank", 0) == 0]  # rank 0's view (every rank logs its start)
    steps = [e for e in events if e["e"] == "step" and e["t"] <= until]
    saves = [e for e in events if e["e"] == "save" and e["t"] <= until]
    step_time = statistics.median(e["seconds"] for e in steps) if steps else 0.0
    per_fault, launcher_share, redone = [], [], 0
    for at, kind in faults:
        # The entry rank 0 was in: its last `entered` before the fault (its last step may be logged
        # after the fault: rank 1 raises before rank 0's all-reduce of the step before returns).
        ended = next((e["en"] for e in reversed(entered) if e["rank"] == 0 and e["t"] < at), None)
        stepping = next((e for e in steps if e["t"] > at and e.get("en") != ended), None)
        again = every_rank_stepping(starts, entered, at)
        start = next((e for e in events if e["e"] == "start" and e["at"] > at), None)
        if start is not None and (stepping is None or start["at"] < stepping["t"]):
            launcher_share.append(start["at"] - at)  # a new process's first line (a whole restart)
        resumed = next(
            (e for e in events if e["e"] == "resumed" and stepping and e.get("en") == stepping.get("en")), None
        )
        last = max((e["step"] for e in steps if e.get("en") == ended), default=None)
        if last is not None and stepping is not None:
            # every step the ended entry made (one may finish after the fault) is done again from the load
            redone += last - (resumed["step"] if resumed else 0)
        survivors = (0, 1) if kind == "exception" else (0,)
        kept = []
        for rank in survivors:
            old = [e["pid"] for e in entered if e["rank"] == rank and e["t"] < at]
            new = [e["pid"] for e in entered if e["rank"] == rank and e["t"] > at]
            if old and new:
                kept.append(old[-1] == new[0])
        per_fault.append({
            "kind": kind,
            "at": at - launched,
            "stepping": None if again is None else max(e["t"] for e in again) - at,
            "first_step_done": None if stepping is None else stepping["t"] - at,
            "pids_kept": all(kept) if kept else None,
        })  # fmt: skip
    intervals = [e["steps"] for e in events if e["e"] == "interval"]
    first_step = steps[0]["t"] - launched if steps else None
    restarts = [f["stepping"] for f in per_fault if f["stepping"] is not None]
    return {
        "progress": max((e["step"] for e in steps), default=0),
        "step_time": step_time,
        "first_step_after": first_step,
        "saves": len(saves),
        "stall": statistics.median(e.get("stall", e["seconds"]) for e in saves) if saves else None,
        "save_seconds": sum(e["seconds"] for e in saves),
        "interval": statistics.median(intervals) if intervals else None,
        "kills": len(faults),
        "faults": per_fault,
        "restart": restarts,
        "launcher_share": launcher_share,
        "restart_seconds": sum(restarts),
        "redone_steps": redone,
        "redone_seconds": redone * step_time,
    }


def every_rank_stepping(
    starts: list[dict[str, Any]], entered: list[dict[str, Any]], at: float
) -> list[dict[str, Any]] | None:
    """Each rank's first ``stepping`` (an entry's first step beginning) of an entry other than the
    one it was in at the fault `at`; None unless every rank of the world at the fault has one."""
    ranks = {e["rank"] for e in entered if e["t"] < at}
    found = []
    for rank in sorted(ranks):
        was_in = next((e["en"] for e in reversed(entered) if e["rank"] == rank and e["t"] < at), None)
        first = next((e for e in starts if e["rank"] == rank and e["t"] > at and e["en"] != was_in), None)
        if first is None:
            return None
        found.append(first)
    return found or None


REENTRY_PHASES = {
    "detect": "fault -> the agent knows (`worker_raised`: the exception's message; `worker_exited`: the pidfd)",
    "abort": "-> every survivor read the agent's abort (round ended in the store, decided)",
    "leave": "-> every survivor left the training function (interrupted, or its collective released)",
    "teardown": "-> every survivor parked (saves settled, connections shut, groups destroyed, gc)",
    "round": "-> every rank read `enter` (round acknowledged, the next one formed, its store and checkpoint round)",
    "init": "-> every rank inside the function (rally's `init_process_group`: store, full mesh)",
    "load": "-> every rank's `load_latest` returned (the memory tier's copy mapped)",
    "copy": "-> every rank's copy into the model done (the script's own work)",
    "step": "-> every rank's first step begins",
}
"""An in-process restart as the agent (its events.jsonl) and every rank (rally's re-entry
`timeline`, the bench worker's ``stepping`` line) lived it; each mark is the last rank's."""


def reentry_phases(
    agent: list[dict[str, Any]], worker: list[dict[str, Any]], faults: list[tuple[float, str]]
) -> list[dict[str, Any]]:
    """Each in-process restart's seconds per phase (REENTRY_PHASES), with the teardown's parts."""
    entered = [e for e in worker if e["e"] == "entered"]
    starts = [e for e in worker if e["e"] == "stepping"]
    out = []
    for at, kind in faults:
        again = every_rank_stepping(starts, entered, at)
        noticed = next((e for e in agent if e["time"] >= at and e["event"] in ("worker_raised", "worker_exited")), None)
        if again is None or noticed is None:
            continue
        survivors = [e for e in again if e.get("points", {}).get("parked", 0) > at]
        marks = [at, noticed["time"], _last(survivors, "abort", at), _last(survivors, "left", at),
                 _last(survivors, "parked", at), _last(again, "enter", at), max(e["entered"] for e in again),
                 max(e["called"] for e in again), max(e["loaded"] for e in again),
                 max(e["t"] for e in again)]  # fmt: skip
        # a phase with no mark (no rank read `enter`: a fresh replacement's entry) counts as 0 s
        filled: list[float] = [at]
        for m in marks[1:]:
            filled.append(max(filled[-1], m if m is not None else filled[-1]))
        phases: dict[str, Any] = {name: filled[i + 1] - filled[i] for i, name in enumerate(REENTRY_PHASES)}
        phases["kind"], phases["total"] = kind, filled[-1] - at
        # the teardown begins once a survivor is out of the function *and* told to abort (a rank whose
        # collective failed, or that raised, leaves first and waits for the abort)
        parts = {"settle": ("begun", "settled"), "close": ("settled", "closed"), "destroy": ("closed", "destroyed"),
                 "gc": ("destroyed", "collected"), "say parked": ("collected", "parked")}  # fmt: skip
        for name, (a, b) in parts.items():
            took = []
            for e in survivors:
                p = {**e["points"], "begun": max(e["points"].get("left", 0), e["points"].get("abort", 0))}
                if p.get(a, 0) > at and p.get(b, 0) > at:
                    took.append(p[b] - p[a])
            phases[f"teardown: {name}"] = max(took) if took else None
        out.append(phases)
    return out


def _last(lines: list[dict[str, Any]], key: str, at: float) -> float | None:
    """The latest of the ranks' re-entry mark `key` after the fault at `at` (None: no rank has one)."""
    values = [p[key] for e in lines if (p := e.get("points", {})).get(key, 0) > at]
    return max(values) if values else None


def reentry_table(results: dict[str, dict[str, Any]]) -> str:
    """Fault -> every rank stepping again, phase by phase, per in-process row: median (range) per fault kind."""
    tables = []
    for name, r in results.items():
        phases = r.get("reentry_phases", [])
        if not phases:
            continue
        kinds = [k for k in ("exception", "SIGKILL") if any(p["kind"] == k for p in phases)]
        heads = " | ".join(f"{k}: median (min - max)" for k in kinds)
        lines = [f"| {LABELS[name]}: in-process restart, phase by phase (the last rank's marks) | {heads} |"]
        lines.append("|---|" + "---|" * len(kinds))
        parts = [k for k in phases[0] if k.startswith("teardown: ")]
        for key in [*REENTRY_PHASES, *parts, "total"]:
            text = REENTRY_PHASES.get(key) or f"(of teardown: {key.split(': ')[-1]}, the slowest survivor's)"
            cells = []
            for kind in kinds:
                values = [p[key] for p in phases if p["kind"] == kind and p.get(key) is not None]
                cells.append(
                    f"{statistics.median(values):.3f} s ({min(values):.3f} - {max(values):.3f})" if values else "—"
                )
            label = "**fault -> every rank stepping again**" if key == "total" else text
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


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


def median_of(faults: list[dict[str, Any]], kind: str) -> str:
    values = [f["stepping"] for f in faults if f["kind"] == kind and f["stepping"] is not None]
    count = sum(1 for f in faults if f["kind"] == kind)
    return f"{fmt(statistics.median(values) if values else None, '.3f')} ({len(values)} of {count})" if count else "—"


def kept_of(faults: list[dict[str, Any]]) -> str:
    known = [f["pids_kept"] for f in faults if f["pids_kept"] is not None]
    return f"{sum(known)} of {len(known)}" if known else "—"


def table(results: dict[str, dict[str, Any]], duration: float, kill_every: float, setup: float, alternate: bool) -> str:
    ideal = max((results[n]["progress"] for n in ("ideal_torchrun", "ideal_rally") if n in results), default=0)
    torchrun = results.get("torchrun", {}).get("progress")
    what = "exception and SIGKILL of rank 1 alternating" if alternate else "rank 1 SIGKILLed"
    lines = [
        f"| {duration:.0f} s, set-up {setup:.0f} s, {what} every {kill_every:.0f} s | save stall (median) "
        "| checkpoint every | kill -> script running (launcher) "
        "| exception -> every rank stepping again (the last rank's first step begins) "
        "| SIGKILL -> every rank stepping again (the same) | survivors' pids kept | steps reached | goodput "
        "| ÷ torchrun | lost to saves | lost to restarts | redone |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "progress" not in r:
            lines.append(f"| {LABELS[name]} | {r.get('error', '')[:200]} |" + " |" * 11)
            continue
        goodput = r["progress"] / ideal if ideal else None
        versus = r["progress"] / torchrun if torchrun and not name.startswith("ideal") else None
        share = r["launcher_share"]
        faults = r.get("faults", [])
        lines.append(
            f"| {LABELS[name]}{' (' + r['error'][:60] + ')' if 'error' in r else ''} | {fmt(r['stall'], '.3f')} | "
            f"{fmt(r['interval'], '.0f', ' steps')} | "
            f"{fmt(statistics.median(share) if share else None)} | "
            f"{median_of(faults, 'exception')} | {median_of(faults, 'SIGKILL')} | {kept_of(faults)} | "
            f"{r['progress']} | {fmt(goodput, '.3f', '')} | {fmt(versus, '.2f', '×')} | "
            f"{fmt(r['save_seconds'], '.1f')} | {fmt(r['restart_seconds'], '.1f')} | "
            f"{r['redone_steps']} steps ({fmt(r['redone_seconds'], '.1f')}) |"
        )
    return "\n".join(lines)


def fault_table(results: dict[str, dict[str, Any]]) -> str:
    """Every fault of every row: its kind, when, fault -> every rank stepping again, pids kept."""
    lines = ["| row | fault | at | -> every rank stepping again | survivors' pids kept |", "|---|---|---|---|---|"]
    for name, r in results.items():
        for f in r.get("faults", []):
            kept = {True: "yes", False: "no", None: "—"}[f["pids_kept"]]
            lines.append(f"| {LABELS[name]} | {f['kind']} | {f['at']:.1f} s | {fmt(f['stepping'], '.3f')} | {kept} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=240.0, help="seconds per run from launch (default 240)")
    parser.add_argument("--kill-every", "--fault-every", dest="kill_every", type=float, default=60.0,
                        help="seconds between faults of rank 1 (default 60)")  # fmt: skip
    parser.add_argument("--setup-seconds", type=float, default=0.0,
                        help="each process's set-up before its training function (a sleep; default 0)")  # fmt: skip
    parser.add_argument("--alternate", action="store_true",
                        help="alternate an exception in rank 1's training function with its SIGKILL")  # fmt: skip
    parser.add_argument("--only", default=None, help="runs, comma-separated: " + ",".join(RUNS))
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else (RUNS if args.alternate else DEFAULT_RUNS)
    if unknown := [r for r in only if r not in RUNS]:
        parser.exit(2, f"bench.goodput: unknown run {unknown[0]!r}; the runs: {', '.join(RUNS)}\n")
    if args.duration <= 0 or args.kill_every <= 0 or args.setup_seconds < 0:
        parser.exit(2, "bench.goodput: --duration and --fault-every must be above 0, --setup-seconds at least 0\n")
    wanted = [r for r in RUNS if r in only]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    with scratch_dir(args.keep) as root:  # removed on every way out (bench/scratch.py)
        for name in wanted:
            if name == "dlrover" and dlrover_python() is None:
                results[name] = {"error": "not installed (RALLY_BENCH_DLROVER_PYTHON)"}
                continue
            if name == "nvrx" and nvrx_paths() is None:
                results[name] = {"error": NVRX_HOWTO}
                continue
            if name == "rally_run_spare" and not has_warm_spares():
                results[name] = {"error": "not available: this rally has no --warm-spares"}
                continue
            print(f"{time.strftime('%H:%M:%S')} {name} ({args.duration:.0f} s)", file=sys.stderr, flush=True)
            try:
                results[name] = run_once(name, root, args.duration, args.kill_every, args.setup_seconds, args.alternate)
            except (OSError, ValueError) as exc:
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    text = table(results, args.duration, args.kill_every, args.setup_seconds, args.alternate)
    if faults := fault_table(results):
        text += f"\n\n{faults}"
    if phases := phase_table(results.get("rally", {}).get("phases", [])):
        text += f"\n\n{phases}"
    if reentry := reentry_table(results):
        text += f"\n\n{reentry}"
    args_given = argv if argv is not None else sys.argv[1:]
    header = common.run_header("Goodput benchmark", "bench.goodput", args_given, started, load_start)
    print(header + "\n\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "goodput_setup" if args.setup_seconds else "goodput_setup0" if args.alternate else "goodput"
    (RESULTS / f"{stem}.md").write_text(header + "\n\n" + text + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps({"date": started, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
