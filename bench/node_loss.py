"""A node lost under gloo, on c10d and on etcd: how long until the survivor trains again, and
whether the loss cost a restart (issue 30: a node loss is a node loss on every backend).

    python -m bench.node_loss [--backend c10d,etcd] [--reps 3] [--keep]

Per run: a store (`rally store --port 0`, or one local etcd member), two rally agents on 127.0.0.1
as two nodes with rally's defaults (`--nnodes 1:2`, keep-alive 1 s / 5 s, last call 30 s,
pre-flight on), one gloo worker each (bench/workers/node_loss.py). Once both step, the node of
group rank 1 is SIGKILLed as a whole (its agent's process group, then its workers'). The
survivor's rank fails first (gloo: "Connection closed by peer"); rally must take that as the lost
node's consequence once the node's liveness expires (its keep-alive counter stays still, or its
etcd lease runs out): the round ends `node_lost`, no restart is spent, and the next round closes
at once (the dead node is counted lost, so no last call). One line per run: the time from the kill
to the survivor's first step as a 1-node job (bound: keep_alive_timeout + 2 s = 7 s), the restart
count it runs with, and the phases from the survivor's events.jsonl, each after the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from bench.common import bench_env, launcher_cmd
from bench.scratch import scratch_dir
from bench.simetcd import LocalEtcd, two_free_ports

WORKER = Path(__file__).resolve().parent / "workers" / "node_loss.py"
KEEP_ALIVE_TIMEOUT = 5.0  # rally's default; the bound is this + 2 s
PHASES = ("worker_exited", "round_ended", "restart", "membership_change", "round_formed", "worker_started")
START_SECONDS = 180.0  # both nodes stepping (two torch imports and a pre-flight on 2 busy cores)


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A process in a session of its own (killed by its process group), output to `log`."""
    with open(log, "w") as handle:
        return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


@contextmanager
def store(backend: str, root: Path) -> Iterator[str]:
    """The rendezvous endpoint of a store started for one run, stopped after it."""
    if backend == "etcd":
        etcd = LocalEtcd(*two_free_ports())
        try:
            etcd.wait_ready()
            yield f"127.0.0.1:{etcd.client_port}"
        finally:
            etcd.stop()
        return
    log = root / "store.log"
    server = start([*launcher_cmd("rally"), "store", "--port", "0"], log, bench_env())
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"listening on port (\d+)", log.read_text())):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rally store did not start: {log.read_text()[-500:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{found.group(1)}"
    finally:
        kill_group(server)


def steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(what: str, ready: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {seconds:g} s")
        time.sleep(0.05)


def kill_node(agent: subprocess.Popen) -> float:
    """SIGKILL a node as a whole: its agent's process group first (a crashed node reports
    nothing), then each of its workers' groups; the kill's wall time."""
    groups = set()
    for process in psutil.Process(agent.pid).children(recursive=True):
        try:
            groups.add(os.getpgid(process.pid))
        except ProcessLookupError:
            pass
    groups.discard(agent.pid)
    killed_at = time.time()
    for group in [agent.pid, *groups]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=10)
    return killed_at


def one(backend: str, root: Path) -> dict:
    out = root / "steps.jsonl"
    run_id = f"node-loss-{uuid.uuid4().hex[:8]}"
    agents: list[subprocess.Popen] = []
    with store(backend, root) as endpoint:
        try:
            for i in range(2):
                argv = [
                    *launcher_cmd("rally"), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", backend,
                    "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
                    "--max-restarts", "3", "--log-dir", str(root / f"logs{i}"), str(WORKER), str(out),
                ]  # fmt: skip
                agents.append(start(argv, root / f"node{i}.log", bench_env()))
            wait_for(
                "both nodes stepping",
                lambda: {s["group_rank"] for s in steps(out) if s["world"] == 2} == {0, 1},
                START_SECONDS,
            )
            rank1 = next(s["pid"] for s in steps(out) if s["group_rank"] == 1)
            victim = next(a for a in agents if rank1 in {p.pid for p in psutil.Process(a.pid).children(recursive=True)})
            survivor = agents[1 - agents.index(victim)]
            killed_at = kill_node(victim)
            wait_for("the survivor training again", lambda: any(s["world"] == 1 for s in steps(out)), 60)
            first = min((s for s in steps(out) if s["world"] == 1), key=lambda s: s["t"])
            logs = root / f"logs{agents.index(survivor)}"
            events = [
                json.loads(line) for path in logs.glob("*/events.jsonl") for line in path.read_text().splitlines()
            ]
            phases = [
                f"{e['event']}{'(' + e['kind'] + ')' if 'kind' in e else ''} +{e['time'] - killed_at:.2f} s"
                for e in sorted(events, key=lambda e: e["time"])
                if e["time"] > killed_at and e["event"] in PHASES
            ]
            return {"back_after": first["t"] - killed_at, "restart_count": first["restart"], "phases": phases}
        finally:
            for agent in agents:
                if agent.poll() is None:
                    kill_group(agent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="c10d,etcd", help="comma-separated: c10d, etcd")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep each run's logs (the path is printed)")
    args = parser.parse_args()
    with scratch_dir(args.keep) as scratch:
        for backend in args.backend.split(","):
            for rep in range(args.reps):
                root = scratch / f"{backend}-{rep}"
                root.mkdir()
                run = one(backend, root)
                bound = "within" if run["back_after"] <= KEEP_ALIVE_TIMEOUT + 2 else "OVER"
                print(
                    f"{backend} run {rep}: training again {run['back_after']:.2f} s after the kill ({bound} the "
                    f"{KEEP_ALIVE_TIMEOUT + 2:g} s bound), restart count {run['restart_count']}; "
                    + ", ".join(run["phases"]),
                    flush=True,
                )


if __name__ == "__main__":
    main()
