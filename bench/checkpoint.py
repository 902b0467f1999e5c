"""Checkpoints side by side in one run: torch.save, DCP async_save, rally's memory tier, DLRover.

    python -m bench.checkpoint                 400 MB state, 2 repetitions per method
    python -m bench.checkpoint --mb 100 --reps 1 --only rally,dlrover

Each run is a 2-worker job on this machine running bench/workers/ckpt.py (its docstring has the
details): every rank holds the same ``--mb`` MB state, saves it 5 times 1.5 s apart, rank 1 is
SIGKILLed, the launcher restarts both workers, and they reload the newest step. Per method:

- **stall**: how long ``save`` keeps the training loop waiting (rank 0): the call, plus for rally's
  overlapped saves the wait of the next optimizer step's fence for the copy (the next step computes
  0.1 s on every rank first, see the worker); the median of the steady-state saves (the 3rd to
  the 5th; the first two of the memory tiers allocate and map their shared memory, reported as
  "first saves"), and **of it, the fence's wait** (the part of the copy the next step's compute
  did not hide); the **ratio** is to a plain ``copy_`` of the same
  tensors into preallocated ones, measured in the same worker just before;
- **saves dropped**: saves the method skipped (DLRover skips a save to memory while its agent
  still persists the previous one; rally skips an overlapped save that would have to overwrite the
  newest step in memory while the other copy is persisted; those are left out of the stall and
  durability figures, and the reload checks the newest step it did save);
- **durable after**: from the call until the step is on disk (rally: ``job.durable_steps()``;
  DCP: its future; DLRover: the file), when that happens within the 1.5 s between saves;
- **reload**: after the restart, from the call until the state is back in the model's tensors
  (load + ``copy_``; DCP loads in place), and where it came from; also divided by the plain copy
  of the same run, since on a shared machine the load moves between runs. Each method's modules
  are imported when the worker starts, as a script imports at its top, not inside the timed
  call. rally's restarted workers map their node's copy and fault its pages in while they start
  (agent/checkpoint/core/resume_prefetch.py, on every restart), so its reload is mostly the copy.

rally (with its memory tier, overlapped; the same not overlapped: ``RALLY_CKPT_OVERLAP=0``; and
without the tier: ``RALLY_MEMORY_TIER=0``, the disk path whose ``load_latest`` is item 8's) and
the two torch methods run under rally (``--checkpoint-dir`` only for rally's own);
DLRover 0.6.1 runs under its ``dlrover-run`` (bench/shim/dlrover_run.py adds the argument torch
2.13 needs) from the interpreter in ``RALLY_BENCH_DLROVER_PYTHON`` (default
/work/venvs/dlrover/bin/python, a venv with ``dlrover[k8s,torch]==0.6.1`` and protobuf beside the
pinned torch); without it, its row says so. Methods alternate order between repetitions.
rally's rows write every save to disk as it comes (``RALLY_CKPT_PERSIST_SHARE=1``), as DLRover's
disk saves and the torch methods do, so that "durable after" compares the same thing and the
stalls include the disk copy's competition; by default rally's holder writes to disk at most 1%
of a core's time (bench/goodput.py runs the default).
Writes bench/results/checkpoint.json and checkpoint.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/checkpoint.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

from bench import common
from bench.common import REPO, RESULTS, Job
from bench.scratch import scratch_dir

METHODS = (
    "torch_save",
    "dcp_async",
    "rally_disk",
    "rally_sync",
    "rally",
    "dlrover",
    "dcp_save_sharded",
    "dcp_async_sharded",
    "rally_sharded",
)
LABELS = {
    "torch_save": "plain `torch.save` (rank 0)",
    "dcp_async": "`torch.distributed.checkpoint.async_save`",
    "rally_disk": "`rally.job.save`, memory tier off (torch.save + fsync, rank 0)",
    "rally_sync": "rally memory tier, not overlapped (`RALLY_CKPT_OVERLAP=0`)",
    "rally": "rally memory tier (`rally.job.save`, overlapped with the next step)",
    "dlrover": "DLRover 0.6.1 flash checkpoint (StorageType.DISK)",
    "dcp_save_sharded": "sharded: `torch.distributed.checkpoint.save` (every rank)",
    "dcp_async_sharded": "sharded: `torch.distributed.checkpoint.async_save` (every rank)",
    "rally_sharded": "sharded: rally memory tier (`rally.job.save` of DTensors, every rank)",
}
WORKER = REPO / "bench" / "workers" / "ckpt.py"
DLROVER_SHIM = REPO / "bench" / "shim" / "dlrover_run.py"
RUN_TIMEOUT = 240.0


def dlrover_python() -> str | None:
    path = os.environ.get("RALLY_BENCH_DLROVER_PYTHON", "/work/venvs/dlrover/bin/python")
    return path if Path(path).exists() else None


def command(method: str, run: Path, mb: int, compute: float = 0.1) -> list[str]:
    work = [
        str(WORKER),
        "--method",
        method,
        "--dir",
        str(run / "ckpt"),
        "--mb",
        str(mb),
        "--out",
        str(run / "result.json"),
        "--compute",
        str(compute),
    ]
    if method == "dlrover":
        return [
            dlrover_python() or "python",
            str(DLROVER_SHIM),
            "--standalone",
            "--nproc_per_node",
            "2",
            "--max_restarts",
            "1",
            *work,
        ]
    extra = ["--checkpoint-dir", str(run / "ckpt")] if method.startswith("rally") else []
    return [sys.executable, "-m", "rally", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--log-dir", str(run / "logs"), *extra, *work]  # fmt: skip


def run_once(method: str, root: Path, rep: int, mb: int, keep: bool, compute: float = 0.1) -> dict:
    run = root / f"{method}-{rep}"
    started = time.time()
    (run / "ckpt").mkdir(parents=True)
    every_save_to_disk = {"RALLY_CKPT_PERSIST_SHARE": "1"}  # as DLRover's DISK saves: see the docstring
    env = common.bench_env(
        {"RALLY_MEMORY_TIER": "0"}
        if method == "rally_disk"
        else {"RALLY_CKPT_OVERLAP": "0", **every_save_to_disk}
        if method == "rally_sync"
        else every_save_to_disk
    )
    job = Job.start(method, command(method, run, mb, compute), env, REPO, run)
    try:
        code = job.wait(RUN_TIMEOUT)
    finally:
        job.kill()
    try:
        result = json.loads((run / "result.json").read_text())
    except (OSError, ValueError):
        result = {}
    if not keep:
        shutil.rmtree(run / "ckpt", ignore_errors=True)  # 400 MB a step: the disk would fill up
    left = shm_left_since(started)
    if left:  # DLRover leaves its shared memory behind: say so, then free it
        result["shm_left_mb"] = sum(p.stat().st_size for p in left) / 1e6
        for path in left:
            path.unlink(missing_ok=True)
    if code != 0 or "reload" not in result:
        return {"error": f"exit {code}: {job.tail(8)}", **result}
    return result


def shm_left_since(started: float) -> list[Path]:
    """Files a run left in /dev/shm (DLRover names its segments ``<job>_ckpt_shm_<rank>``)."""
    found = []
    for path in Path("/dev/shm").glob("*_ckpt_shm_*"):
        try:
            if path.stat().st_mtime >= started - 1:
                found.append(path)
        except OSError:
            continue
    return found


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "reload" in r]
    if not ok:
        return {"error": runs[-1].get("error", "no run") if runs else "not run"}

    def kept(r: dict) -> list[tuple[float, float | None]]:  # (stall, durable after) of the saves made, from the 3rd
        return [
            (s, d)
            for i, (s, d) in enumerate(zip(r["stalls"], r["durable_after"], strict=False), 1)
            if i > 2 and i not in r.get("dropped", [])
        ]

    steady = [s for r in ok for s, _ in kept(r)]
    fences = [f for r in ok for i, f in enumerate(r.get("fences", []), 1) if i > 2 and i not in r.get("dropped", [])]
    first = [s for r in ok for s in r["stalls"][:2]]
    copy = statistics.median(r["copy"] for r in ok)
    durable = [d for r in ok for _, d in kept(r) if d is not None]
    dropped = sum(len(r.get("dropped", [])) for r in ok)
    if not steady:
        return {"error": f"every steady-state save was dropped ({dropped} of {sum(len(r['stalls']) for r in ok)})"}
    return {
        "stall": statistics.median(steady),
        "stall_range": (min(steady), max(steady)),
        "fence": statistics.median(fences) if fences else None,
        "first": max(first),
        "copy": copy,
        "ratio": statistics.median(s / r["copy"] for r in ok for s, _ in kept(r)),
        "dropped": f"{dropped} of {sum(len(r['stalls']) for r in ok)}",
        "durable": statistics.median(durable) if durable else None,
        "reload": statistics.median(r["reload"] for r in ok),
        "reload_ratio": statistics.median(r["reload"] / r["copy"] for r in ok),
        "reload_range": (min(r["reload"] for r in ok), max(r["reload"] for r in ok)),
        "source": "/".join(sorted({r["reload_source"] for r in ok})),
        "runs": len(ok),
        "shm_left": max((r.get("shm_left_mb", 0) for r in runs), default=0),
    }


def table(summary: dict[str, dict], mb: int) -> str:
    lines = [
        f"| {mb} MB state, 2 workers | stall per save (median, min–max) | of it, the fence's wait "
        "| ratio to a plain copy | first saves "
        "| saves dropped | durable after | reload (median, min–max) | reload ÷ plain copy | reloaded from | "
        "left in /dev/shm after the job |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, s in summary.items():
        if "error" in s:
            lines.append(f"| {LABELS[method]} | {s['error'][:120]} | | | | | | | | | |")
            continue
        lines.append(
            f"| {LABELS[method]} | {s['stall']:.3f} s ({s['stall_range'][0]:.3f}–{s['stall_range'][1]:.3f}) | "
            f"{'—' if s.get('fence') is None else format(s['fence'], '.3f') + ' s'} | "
            f"{s['ratio']:.2f}× (copy {s['copy']:.3f} s) | {s['first']:.3f} s | {s['dropped']} | "
            f"{'—' if s['durable'] is None else format(s['durable'], '.2f') + ' s'} | "
            f"{s['reload']:.3f} s ({s['reload_range'][0]:.3f}–{s['reload_range'][1]:.3f}) | "
            f"{s['reload_ratio']:.2f}× | {s['source']} | "
            f"{format(s['shm_left'], '.0f') + ' MB' if s['shm_left'] else 'nothing'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=400, help="state size per rank in MB (default 400)")
    parser.add_argument("--reps", type=int, default=2, help="runs per method (default 2)")
    parser.add_argument("--only", default=",".join(METHODS), help="methods to run, comma-separated")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--compute", type=float, default=0.1, help="seconds the step after each save computes (default 0.1)"
    )
    args = parser.parse_args(argv)
    methods = [m for m in METHODS if m in args.only.split(",")]
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = os.getloadavg()
    with scratch_dir(args.keep) as root:  # removed on every way out, signals included (bench/scratch.py)
        for rep in range(args.reps):
            for method in methods if rep % 2 == 0 else list(reversed(methods)):
                if method == "dlrover" and dlrover_python() is None:
                    runs[method].append({"error": "not installed (RALLY_BENCH_DLROVER_PYTHON)"})
                    continue
                print(f"{time.strftime('%H:%M:%S')} {method} run {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
                runs[method].append(run_once(method, root, rep, args.mb, args.keep, args.compute))
    summary = {m: summarize(r) for m, r in runs.items()}
    text = table(summary, args.mb)
    commit = common.commit()
    header = common.run_header("Checkpoint benchmark", "bench.checkpoint", argv or sys.argv[1:], started, load_start)
    print(header + "\n\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint.md").write_text(header + "\n\n" + text + "\n")
    (RESULTS / "checkpoint.json").write_text(
        json.dumps({"date": started, "commit": commit, "mb": args.mb, "runs": runs, "summary": summary}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
