"""rally vs torchrun, side by side, in one run.

    python -m bench                 full run (about 20-25 minutes on 2 cores)
    python -m bench --quick         reduced sizes and repetitions (a few minutes)
    python -m bench --only launch,restart
    python bench/run.py --quick --skip multiagent

Benchmarks (each module's docstring says exactly what is measured and how):
    launch      launcher start -> every worker imported torch, joined gloo, did an all_reduce
    restart     SIGKILL of one worker -> every worker stepping again (--max-restarts 1)
    detection   a worker's exit -> the launcher stopping its sibling / logging the failure
                (5 failing attempts per launcher run: 5 samples quick, 20 full)
    multiagent  N agents on 127.0.0.1 (c10d) -> every worker running; agent peak RSS
    simulated   N simulated nodes (threads) in the rendezvous protocol, rally vs torch's handler
    overhead    agent CPU and RSS while 2 workers sleep
    preflight   N agents with --preflight -> the pre-flight check's cost (slowest node)

Prints a table (median, min-max, rally/torchrun ratio, target, met?) and writes every raw
number to bench/results/latest.json and the table to bench/results/latest.md (or the paths
given with --json/--md). Every process is started in its own session, cleaned up by pid and
process group, uses OS-assigned ports on 127.0.0.1, and runs under a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

from rich.console import Console
from rich.table import Table

from bench import common
from bench.common import LAUNCHERS, REPO, RESULTS, Context, Figure, summary
from bench.scratch import scratch_dir

BENCHMARKS = ("launch", "restart", "detection", "multiagent", "simulated", "overhead", "preflight")

QUICK = {
    "launch_nproc": [2, 8],
    "launch_reps": 2,
    "restart_nproc": [4],
    "restart_reps": 2,
    "detection_reps": 1,
    "multiagent_nodes": [2, 4, 8],
    "multiagent_reps": 1,
    "simulated_nodes": [64, 256, 1024],
    "simulated_reps": 1,
    "simulated_torch_reps": 1,
    "simulated_timeout": 20.0,
    "simulated_procs": 4,
    "simulated_stagger": [(64, 2.0)],
    "simulated_etcd_nodes": [64, 256, 1024],
    "overhead_reps": 1,
    "overhead_seconds": 10,
    "preflight_nodes": [2, 4, 8],
    "preflight_reps": 2,
}
FULL = {
    "launch_nproc": [1, 2, 4, 8],
    "launch_reps": 3,
    "restart_nproc": [2, 4],
    "restart_reps": 3,
    "detection_reps": 4,
    "multiagent_nodes": [2, 4, 8, 16, 32],
    "multiagent_reps": 2,
    "simulated_nodes": [64, 128, 256, 512, 1024],
    "simulated_reps": 3,
    "simulated_torch_reps": 1,
    "simulated_timeout": 60.0,
    "simulated_procs": 4,
    "simulated_stagger": [(64, 2.0), (256, 5.0), (1024, 10.0)],
    "simulated_etcd_nodes": [64, 256, 1024],
    "overhead_reps": 3,
    "overhead_seconds": 20,
    "preflight_nodes": [2, 4, 8],
    "preflight_reps": 3,
}

console = Console(stderr=True, highlight=False)


def module(name: str):
    import importlib

    return importlib.import_module(f"bench.{name}")


# ------------------------------------------------------------------ formatting
def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return f"{value:.3f} s" if value < 1 else f"{value:.2f} s"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "MB":
        return f"{value:.0f} MB"
    if unit == "% core":
        return f"{value:.2f} %"
    return f"{value:.3g} {unit}"


def cell(f: Figure, launcher: str) -> tuple[str, str]:
    """(statistic, min–max) for one launcher, or its note when it has no samples."""
    s = summary(f.samples.get(launcher, []))
    if not s["n"]:
        return f.notes.get(launcher, "failed" if f.samples.get(launcher) == [] else "—"), ""
    value = s["p99"] if f.stat == "p99" else s["median"]
    spread = f"{fmt(s['min'], f.unit)} – {fmt(s['max'], f.unit)}" if s["n"] > 1 else ""
    note = f" ({f.notes[launcher]})" if launcher in f.notes else ""
    return fmt(value, f.unit) + note, spread


def ratio_text(f: Figure) -> str:
    ratio, qualifier = f.ratio()
    if ratio is None:
        return "—"
    return f"{qualifier}{ratio:.2f}×" if ratio >= 0.01 else f"{qualifier}{ratio:.3f}×"


def met_text(f: Figure) -> str:
    if not f.target:
        return ""
    return {True: "yes", False: "NO", None: "n/a"}[f.met]


def rows(figures: list[Figure]) -> list[list[str]]:
    out = []
    for f in figures:
        r, r_spread = cell(f, "rally")
        t, t_spread = cell(f, "torchrun")
        n = "/".join(str(len(f.samples.get(k, []))) for k in LAUNCHERS)
        out.append(
            [f.bench, f.name, f.stat, n, r, r_spread, t, t_spread, ratio_text(f), f.target, met_text(f), f.comment]
        )
    return out


HEADERS = [
    "bench",
    "figure",
    "stat",
    "n (r/t)",
    "rally",
    "rally min–max",
    "torchrun",
    "torchrun min–max",
    "rally/torchrun",
    "target",
    "met?",
    "note",
]


def rich_table(figures: list[Figure], title: str) -> Table:
    table = Table(title=title, show_lines=False)
    for h in HEADERS:
        table.add_column(h, overflow="fold")
    for row, f in zip(rows(figures), figures, strict=True):
        style = {True: "green", False: "red"}.get(f.met) if f.target else None
        table.add_row(*row, style=style)
    return table


def markdown(figures: list[Figure], meta: dict) -> str:
    lines = [
        f"## rally vs torchrun — {meta['mode']} run, {meta['date']}",
        "",
        f"Machine: {meta['cpus']} CPUs, Python {meta['python']}, torch {meta['torch']}; rally at "
        f"`{meta['rally_commit'][:10]}`"
        f"{' (with uncommitted changes in ' + ', '.join(meta['rally_dirty']) + ')' if meta['rally_dirty'] else ''}. "
        + (
            f"**The rally tree changed during the run** (at the end: `{meta['rally_commit_end'][:10]}`"
            f"{', uncommitted changes in ' + ', '.join(meta['rally_dirty_end']) if meta['rally_dirty_end'] else ''}). "
            if meta.get("rally_changed_during_run")
            else ""
        )
        + f"Command: `{meta['command']}` ({meta['duration_s'] / 60:.1f} min). Load average at start: "
        f"{', '.join(f'{x:.1f}' for x in meta['loadavg_start'])}; at end: "
        f"{', '.join(f'{x:.1f}' for x in meta['loadavg_end'])}"
        + (
            f"; CPU busy just before a run (median over runs): {meta['cpu_busy_before_runs_median']:.0f} %."
            if meta.get("cpu_busy_before_runs_median") is not None
            else "."
        ),
        "",
        "Values are medians (p99 where the stat column says so) over n runs per launcher; "
        "rally/torchrun < 1 means rally is faster or smaller. Raw numbers: `bench/results/latest.json`; "
        "what each figure measures: the docstrings in `bench/*.py`.",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
    ]
    for row in rows(figures):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    if meta.get("failures"):
        lines += ["", "Failed runs:", ""]
        lines += [f"- {x}" for x in meta["failures"]]
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ metadata
def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def metadata(mode: str, argv: list[str]) -> dict:
    import torch  # version only; the bench process itself never uses it otherwise

    dirty = git("status", "--porcelain", "--", "launcher", "agent", "rendezvous")
    return {
        "mode": mode,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench", *argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "rally_commit": git("rev-parse", "HEAD").strip(),
        "rally_dirty": sorted({line[3:] for line in dirty.splitlines() if line}),
        "launchers": {k: common.launcher_exe(k) for k in LAUNCHERS},
        "loadavg_start": list(os.getloadavg()),
    }


# ------------------------------------------------------------------ main
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    parser.add_argument("--quick", action="store_true", help="reduced sizes and repetitions (a few minutes)")
    parser.add_argument(
        "--only", default="", metavar="A,B", help=f"run only these benchmarks ({', '.join(BENCHMARKS)})"
    )
    parser.add_argument("--skip", default="", metavar="A,B", help="skip these benchmarks")
    parser.add_argument("--reps", type=int, default=None, help="override every repetition count")
    parser.add_argument("--json", default=str(RESULTS / "latest.json"), help="where to write raw results")
    parser.add_argument("--md", default=str(RESULTS / "latest.md"), help="where to write the markdown table")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory with every run's logs")
    parser.add_argument(
        "--settle", type=float, default=None, help="max seconds to wait for an idle CPU before each run"
    )
    args = parser.parse_args(argv)
    for name in filter(None, (args.only + "," + args.skip).split(",")):
        if name not in BENCHMARKS:
            parser.error(f"unknown benchmark '{name}'; choose from {', '.join(BENCHMARKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    selected = [b for b in BENCHMARKS if (not args.only or b in args.only.split(",")) and b not in args.skip.split(",")]
    params = dict(QUICK if args.quick else FULL)
    if args.reps is not None:
        for key in params:
            if key.endswith("_reps"):
                params[key] = args.reps
    with scratch_dir(args.keep) as root:  # removed on every way out, signals included (bench/scratch.py)
        return run_all(args, argv, selected, params, root)


def run_all(args: argparse.Namespace, argv: list[str], selected: list[str], params: dict[str, Any], root: Path) -> int:
    ctx = Context(
        quick=args.quick,
        root=root,
        params=params,
        say=lambda m: console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {m}", markup=True),
        settle_limit=args.settle if args.settle is not None else 3.0,
    )

    meta = metadata("quick" if args.quick else "full", argv)
    meta["params"] = params
    meta["benchmarks"] = selected
    console.print(f"[bold]rally bench[/] ({meta['mode']}): {', '.join(selected)}; scratch {root}")
    t0 = time.monotonic()
    figures: list[Figure] = []
    timings = {}
    interrupted = False
    try:
        for name in selected:
            console.rule(name)
            started = time.monotonic()
            try:
                figures += module(name).run(ctx)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one broken benchmark must not lose the others
                import traceback

                ctx.record(
                    name, {"ok": False, "error": f"benchmark crashed: {exc!r}", "traceback": traceback.format_exc()}
                )
                console.print(f"[red]{name} crashed:[/] {exc!r}")
            finally:
                timings[name] = time.monotonic() - started
                leftovers = common.cleanup_all()
                if leftovers:
                    console.print(f"[yellow]cleaned up {len(leftovers)} leftover processes after {name}[/]")
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted; cleaning up and writing what was measured[/]")
    finally:
        leftovers = common.cleanup_all()
        meta["leftover_processes_killed_at_end"] = len(leftovers)
    meta["duration_s"] = time.monotonic() - t0
    meta["benchmark_durations_s"] = timings
    meta["loadavg_end"] = list(os.getloadavg())
    # Others edit rally while the bench runs: say so when the tree changed under it.
    meta["rally_commit_end"] = git("rev-parse", "HEAD").strip()
    dirty_end = git("status", "--porcelain", "--", "launcher", "agent", "rendezvous")
    meta["rally_dirty_end"] = sorted({line[3:] for line in dirty_end.splitlines() if line})
    meta["rally_changed_during_run"] = (meta["rally_commit_end"], meta["rally_dirty_end"]) != (
        meta["rally_commit"],
        meta["rally_dirty"],
    )
    meta["interrupted"] = interrupted
    busy = [r["cpu_busy_before"] for runs in ctx.raw.values() for r in runs if r.get("cpu_busy_before") is not None]
    meta["cpu_busy_before_runs_median"] = sorted(busy)[len(busy) // 2] if busy else None
    meta["failures"] = [
        f"{bench}: {run.get('launcher') or run.get('impl', '')} "
        f"{' '.join(f'{k}={run[k]}' for k in ('nproc', 'nodes', 'rep') if k in run)}: {run.get('error')}"
        for bench, runs in ctx.raw.items()
        for run in runs
        if not run.get("ok") and run.get("impl") != "torch"
    ]

    title = f"rally vs torchrun ({meta['mode']}, {meta['duration_s'] / 60:.1f} min)"
    Console(highlight=False, width=max(Console().width, 200)).print(rich_table(figures, title))
    result = {"meta": meta, "figures": [f.to_json() for f in figures], "runs": ctx.raw}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    Path(args.md).write_text(markdown(figures, meta))
    console.print(f"wrote {args.json} and {args.md}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
