"""Benchmark 5 — rendezvous at scale, simulated: N nodes (threads) against one TCPStore.

    python -m bench.simrdzv --nodes N --trials floor,rally,rally,rally,torch --procs 4 --timeout T

rally: `rendezvous.protocol.Rendezvous(store, RendezvousSettings(min_nodes=N, max_nodes=N),
node).next_round()`; torch: `DynamicRendezvousHandler.from_backend(run_id, store,
C10dRendezvousBackend(store, run_id), min_nodes=N, max_nodes=N).next_rendezvous()`, torch's
own c10d rendezvous as torchrun uses it. Every node has its own TCPStore client; the clock
runs from one "go" to the last node holding its assignment (see bench/simrdzv.py for the
set-up; one process per N, whose connections serve every trial with fresh keys). Each trial
is capped at T seconds (20 quick, 60 full) and reported as "did not converge" past it; torch
is not run at sizes above one where it did not converge (except the largest in a full run).

rally on etcd (rows "N simulated nodes on etcd", for the sizes in `simulated_etcd_nodes`, when
`etcd` is installed): the same protocol and nodes, each node with its own `EtcdStore` (its own
HTTP connection) on one local etcd member that the harness starts (bench/simetcd.py; data on
disk, so writes pay etcd's fsync). Besides the time: requests per node, and per request the
Python client's own CPU time (the calling thread's) and etcd's (its process's CPU time over the
trial / requests). torch's etcd rendezvous is not run: it needs python-etcd and etcd's v2 API.

Also recorded: store calls per node (rally's protocol is meant to be O(1) per node; torch's
compare-and-set loop retries), and the harness floor: N nodes each doing 16 plain store
`add`s, i.e. how fast this 2-core machine can serve that many clients at all.

A second kind of row spreads the arrivals evenly over S seconds (`--stagger S`, as start-up
skew between real nodes would) and reports the time from the last scheduled arrival until
every node has its assignment (node i is scheduled at i/N * S, so the last at (N-1)/N * S),
with the store calls per node.
"""

from __future__ import annotations

import json
import shutil
import sys

from bench.common import REPO, Context, Figure, Job, bench_env, error_run, run_dir

NAME = "simulated"


def one(ctx: Context, nodes: int, trials: list[str], timeout: float, stagger: float = 0.0) -> list[dict]:
    """One bench.simrdzv process for `nodes`: its connections serve every trial in turn."""
    d = run_dir(ctx.root, NAME, f"n{nodes}-s{stagger:g}")
    busy = ctx.settle()
    argv = [
        sys.executable,
        "-m",
        "bench.simrdzv",
        "--nodes",
        str(nodes),
        "--trials",
        ",".join(trials),
        "--procs",
        str(ctx.params["simulated_procs"]),
        "--timeout",
        str(timeout + stagger),
        "--stagger",
        str(stagger),
    ]
    job = Job.start("simrdzv", argv, bench_env(), REPO, d)
    try:
        limit = 240 + len(trials) * (timeout + stagger + 30) + nodes * 0.1
        rc = job.wait(limit)
        results = [json.loads(line) for line in job.stdout().splitlines() if line.startswith("{")]
        if rc is None or len(results) != len(trials):
            message = f"exit code {rc}, {len(results)}/{len(trials)} results within {limit:.0f} s"
            results += [
                error_run({"impl": impl, "nodes": nodes, "converged": False}, job, message)
                for impl in trials[len(results) :]
            ]
        for r in results:
            r.update(argv=argv, cpu_busy_before=busy, ok=bool(r.get("converged")))
        return results
    finally:
        job.kill()


# The etcd rows' targets (issue 22): all assigned within this many seconds on this machine.
ETCD_TARGETS = {256: 2.0, 1024: 5.0}


def measure(
    ctx: Context,
    f: Figure,
    n: int,
    trials: list[str],
    timeout: float,
    stagger: float = 0.0,
    on_etcd: Figure | None = None,
) -> dict:
    """Run the trials for one N into figure `f` (and rally-on-etcd trials into `on_etcd`);
    return which impls converged."""
    ops: dict[str, list[float]] = {"rally": [], "torchrun": []}
    floor = None
    last_arrival = stagger * (n - 1) / n  # node i is scheduled at i/N * S
    converged = {"rally": False, "torch": False, "etcd": False}
    etcd_runs: list[dict] = []
    for result in one(ctx, n, trials, timeout, stagger):
        ctx.record(NAME, result)
        impl = result["impl"]
        if impl == "floor":
            floor = result
            continue
        if impl == "etcd":
            etcd_runs.append(result)
            converged["etcd"] = converged["etcd"] or bool(result.get("converged"))
            continue
        launcher = "rally" if impl == "rally" else "torchrun"
        if result.get("converged"):
            converged[impl] = True
            f.samples[launcher].append(result["elapsed"] - last_arrival)
            ops[launcher].append(result["store_ops_per_node"])
            ctx.say(
                f"simulated {impl} N={n}{f' over {stagger:g} s' if stagger else ''}: "
                f"{result['elapsed'] - last_arrival:.3f} s, "
                f"{result['store_ops_per_node']:.1f} store calls/node"
            )
        else:
            done = result.get("done")
            if result.get("skipped"):
                f.notes.setdefault(launcher, "not run (an earlier trial did not converge)")
            elif done is not None:
                f.notes[launcher] = f"did not converge in {timeout:g} s ({done}/{n} done)"
            else:
                f.notes[launcher] = f"failed: {result.get('error')}"
            f.censored_at[launcher] = timeout
            ctx.say(f"simulated {impl} N={n}: did not converge ({done}/{n} done) {result.get('error', '')}")
    parts = []
    if floor and floor.get("converged"):
        parts.append(f"floor {floor['elapsed'] - last_arrival:.2f} s")
    for launcher, label in (("rally", "rally"), ("torchrun", "torch")):
        if ops[launcher]:
            parts.append(f"{label} {sum(ops[launcher]) / len(ops[launcher]):.0f} calls/node")
    f.comment = "; ".join(parts)
    if on_etcd is not None:
        etcd_figure(ctx, on_etcd, n, etcd_runs, timeout, c10d_ops=ops["rally"], c10d_times=f.samples["rally"])
    return converged


def etcd_figure(
    ctx: Context, f: Figure, n: int, runs: list[dict], timeout: float, c10d_ops: list[float], c10d_times: list[float]
) -> None:
    """rally's protocol on one local etcd member: time, requests per node, and what one request
    costs the Python client (the calling thread's CPU) and etcd (its process's CPU / requests)."""
    done = [r for r in runs if r.get("converged")]
    for r in runs:
        if r.get("converged"):
            f.samples["rally"].append(r["elapsed"])
        else:
            f.notes["rally"] = (
                f"did not converge in {timeout:g} s ({r.get('done')}/{n} done) {r.get('error', '')}".strip()
            )
            f.censored_at["rally"] = timeout
    f.notes["torchrun"] = "not run: torch's etcd rendezvous needs the python-etcd package and etcd's v2 API"
    if n in ETCD_TARGETS:
        f.target = f"≤ {ETCD_TARGETS[n]:g} s"
        value = f.value("rally")
        f.met = value is not None and value <= ETCD_TARGETS[n]
    if not done:
        return

    def mean(key: str) -> float:
        return sum(r[key] for r in done) / len(done)

    c10d = f"; c10d {sum(c10d_ops) / len(c10d_ops):.0f}" if c10d_ops else ""
    on_c10d = f"; rally on c10d {sorted(c10d_times)[len(c10d_times) // 2]:.2f} s" if c10d_times else ""
    f.comment = (
        f"{mean('store_ops_per_node'):.1f} requests/node{c10d}; per request: Python client "
        f"{mean('client_cpu_ms_per_request'):.2f} ms CPU, etcd {mean('store_cpu_ms_per_request'):.2f} ms CPU, "
        f"wall {mean('request_wall_ms'):.1f} ms{on_c10d}"
    )
    ctx.say(f"simulated rally on etcd N={n}: {f.value('rally'):.3f} s; {f.comment}")


def run(ctx: Context) -> list[Figure]:
    sizes = ctx.params["simulated_nodes"]
    reps, torch_reps = ctx.params["simulated_reps"], ctx.params["simulated_torch_reps"]
    timeout = ctx.params["simulated_timeout"]
    etcd_sizes = ctx.params.get("simulated_etcd_nodes", []) if shutil.which("etcd") else []
    figures = []
    torch_failed_at: int | None = None
    for n in sizes:
        f = Figure(NAME, f"{n} simulated nodes: all assigned", "s")
        # Once torch did not converge, larger sizes will not either: skip them, except the
        # largest size in a full run (the target compares 1024 nodes).
        skip_torch = torch_failed_at is not None and (ctx.quick or n != max(sizes))
        on_etcd = Figure(NAME, f"{n} simulated nodes on etcd: all assigned", "s") if n in etcd_sizes else None
        trials = (
            ["floor"]
            + ["rally"] * reps
            + (["etcd"] * reps if on_etcd else [])
            + ([] if skip_torch else ["torch"] * torch_reps)
        )
        if skip_torch:
            f.notes["torchrun"] = f"not run (did not converge at {torch_failed_at})"
            f.censored_at["torchrun"] = timeout
        converged = measure(ctx, f, n, trials, timeout, on_etcd=on_etcd)
        if "torch" in trials and not converged["torch"]:
            torch_failed_at = torch_failed_at or n
        if n == 1024:
            f.target = "≤ 1 s and faster than torch"
            r, t = f.value("rally"), f.value("torchrun")
            f.met = False if r is None else (r <= 1.0 and (t is None or r < t))
        figures.append(f)
        if on_etcd is not None:
            figures.append(on_etcd)
    # Arrivals spread out, as start-up skew between real nodes spreads them: every arrival
    # wakes the nodes already waiting, so store calls per node grow with N.
    for n, stagger in ctx.params["simulated_stagger"]:
        f = Figure(NAME, f"{n} nodes arriving over {stagger:g} s: all assigned after the last arrival", "s")
        run_torch = torch_failed_at is None or n < torch_failed_at
        trials = ["floor"] + ["rally"] * reps + (["torch"] * torch_reps if run_torch else [])
        if not run_torch:
            f.notes["torchrun"] = f"not run (did not converge at {torch_failed_at})"
            f.censored_at["torchrun"] = timeout
        measure(ctx, f, n, trials, timeout, stagger)
        figures.append(f)
    return figures
