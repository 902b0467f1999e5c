"""Simulated rendezvous: N nodes as threads spread over a few processes, one TCPStore.

    python -m bench.simrdzv --nodes N [--trials floor,rally,etcd,etcdfloor,torch] [--procs P] [--timeout S] [--profile]

Prints one JSON line per trial: {"impl", "nodes", "converged", "done", "elapsed", "store_ops", ...}.

How it runs:
* this (parent) process hosts the TCPStore server on 127.0.0.1, port 0 (OS-assigned), and
  does nothing else, so the server's thread has a core's worth of attention;
* P child processes each simulate N/P nodes as threads. Every node has its own TCPStore
  client connection (as a real node would), opened once and used by every trial;
* per trial, every node gets a fresh rendezvous object before the clock starts: rally's
  `rendezvous.protocol.Rendezvous` under a fresh key prefix, or torch's
  `DynamicRendezvousHandler` over a `C10dRendezvousBackend` with a fresh run id;
* when every child is ready the parent says "go" to all of them and takes t0
  (time.monotonic(), one clock for all processes on Linux); a node is done when its
  `next_round()` / `next_rendezvous()` returns. `elapsed` = last node done - t0;
* after `--timeout` the parent collects how many nodes finished, reports the trial as not
  converged, skips the remaining trials and kills the children. torch trials should come
  last: a converged torch handler keeps sending keep-alives to the store in the background.

`--stagger S` spreads the arrivals evenly over S seconds (node i starts at i/N * S), as
start-up skew between real nodes would; `elapsed` then includes S.

`etcd` runs rally's protocol on etcd instead: the parent starts one local etcd member
(bench/simetcd.py) beside the TCPStore, every node gets its own `EtcdStore` (its own HTTP
connection, opened before the clock starts), and besides the requests per node each trial
reports the mean wall time of a request, the Python client's own CPU time per request (the
calling thread's `time.thread_time`) and the etcd member's CPU time per request.

`etcdfloor` is the same for etcd: every node makes ETCD_FLOOR_OPS (3, as many requests as a rally
node makes on etcd) puts of a descriptor-sized value on the same member and nothing else.

`floor` is the harness's own floor: every node does 16 store `add`s (about as many store
calls as one rally node makes per round) and nothing else, i.e. how fast this machine can
serve N clients at all, with their Python threads sharing its cores.

`--switch-interval` (default SWITCH_INTERVAL, 0.5 s) is each child's `sys.setswitchinterval`: with
Python's 5 ms, the ~1,000 threads of a child that a close wakes at once force GIL switches on one
another every 5 ms, which at 4,096 nodes cost more than the store (see SWITCH_INTERVAL).

`--profile` adds, per trial: store calls, bytes and the commonest calls (count, median wall time) per
node in each phase (go -> last join -> closed -> last node done), the store server's queue in each
phase (a probe client's round trips, one every 5 ms), the closer's own calls in order, when the
woken nodes' reads started after the close, and the nodes' and the server's CPU time per node.

Caveat: the nodes' client-side CPU work shares this machine's cores (and each child's GIL).
torch's client work per operation grows with N (it pickles and base64-encodes the whole
state, every participant and heartbeat, on every compare-and-set); rally's does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# Each TCPStore client reverse-resolves its peer; with a resolver that drops queries every
# connect would stall 5 s (DESIGN.md). glibc reads this at the first lookup.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
# torch's handler would start a TCPStore server for the workers on rank 0: not part of the
# rendezvous being measured (rally's simulation starts none either).
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

FLOOR_OPS = 16
# The children's GIL switch interval. A simulated node is a thread, and a child holds ~1,000 of them;
# a real node has an interpreter of its own. With Python's 5 ms, the ~1,000 threads a close wakes
# at once each time out on the GIL every 5 ms and force a switch (a convoy): at 4,096 nodes that
# cost 3 to 30 s after the close, in the harness, not the store (docs/benchmarks.md). Threads here
# give the GIL up at every store call, so a long interval only stops the forced switches.
SWITCH_INTERVAL = 0.5
IMPLS = ("floor", "rally", "etcd", "etcdfloor", "torch")
ETCD_IMPLS = ("etcd", "etcdfloor")
# etcdfloor: every node makes as many etcd requests as a rally node on etcd does (3), each a put of a
# descriptor-sized value (writes are the dearer kind): how fast this machine serves N etcd clients.
ETCD_FLOOR_OPS = 3
ETCD_FLOOR_VALUE = "x" * 700


def raise_fd_limit(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = hard if hard == resource.RLIM_INFINITY else min(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ================================================================== child: some of the nodes
class Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.wall = 0.0  # seconds spent inside store calls, summed over every node's calls
        self.cpu = 0.0  # of which the calling thread's own CPU time (the Python client's cost)
        self.events: dict[str, float] = {}  # rally: when the last join / the close happened here
        self.log: list | None = None  # --profile: one (t, op, key kind, bytes out, bytes in, wall, closer) per call

    def record(self, op: str, key: str, out: int, back: int, t: float, wall: float, closer: bool) -> None:
        if self.log is not None:
            kind = re.sub(r"\d+", "#", key.split("/", 2)[-1] if key.startswith("rally/") else key)
            with self.lock:
                self.log.append((t, op, kind, out, back, wall, closer))

    def event(self, name: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.events[name] = max(self.events.get(name, 0.0), now)

    def bump(self, wall: float = 0.0, cpu: float = 0.0) -> None:
        with self.lock:
            self.calls += 1
            self.wall += wall
            self.cpu += cpu


def build_nodes(impl: str, trial: int, n: int, first: int, clients: list, counter: Counter, timeout: float) -> list:
    """One callable per simulated node that blocks until the node has its assignment."""
    nodes = []
    if impl == "rally":
        from rally.rendezvous.c10d.store import Store
        from rally.rendezvous.protocol import NodeInfo, Rendezvous, RendezvousSettings

        closer_thread = threading.local()

        class CountingStore(Store):
            def _call(self, fn, *a):
                t, wall, cpu = time.monotonic(), time.perf_counter(), time.thread_time()
                value = super()._call(fn, *a)
                counter.bump(time.perf_counter() - wall, time.thread_time() - cpu)
                name = getattr(fn, "__name__", "")
                if counter.log is not None:
                    if name == "compare_set" and "/closer/" in a[0] and value == a[2]:
                        closer_thread.won = True
                    key = a[0] if a and isinstance(a[0], str) else (a[0][0] if a and a[0] else "")
                    counter.record(
                        name, key, _size(a), _size(value), t, time.perf_counter() - wall,
                        getattr(closer_thread, "won", False),
                    )  # fmt: skip
                if name == "add" and a[1] == 1 and a[0].endswith("/joined"):
                    counter.event("last_join")
                elif name in ("set", "compare_set") and a[0].endswith("/closed"):
                    counter.event("closed")
                return value

        settings = RendezvousSettings(min_nodes=n, max_nodes=n, join_timeout=timeout + 30, last_call_timeout=30)
        for j, raw in enumerate(clients):
            i = first + j
            store = CountingStore(raw, f"rally/sim{trial}/", "the simulated store", lambda raw=raw: raw)
            me = NodeInfo(node_id=f"node{i:05d}:{i}:sim", host=f"node{i:05d}", addr="127.0.0.1", nproc=8)
            rdzv = Rendezvous(store, settings, me)
            nodes.append(lambda r=rdzv: r.next_round().group_rank)
    elif impl == "etcd":
        from bench.simetcd import CLOSER
        from rally.rendezvous.base.kv import Checked, Seen
        from rally.rendezvous.etcd.store import EtcdStore
        from rally.rendezvous.protocol import NodeInfo, Rendezvous, RendezvousSettings

        class CountingEtcdStore(EtcdStore):
            """Marks when the last node arrived and when the round was closed."""

            def arrive_holding(self, counter_name: str, value: str, also: str) -> tuple[int, int, Seen]:
                arrival = super().arrive_holding(counter_name, value, also)
                counter.event("last_join")
                return arrival

            def arrive_if_fresh(
                self, counter_name: str, value: str, also: str, hint: str, limit: int, ends: Sequence[str]
            ) -> tuple[tuple[int, int, Seen] | None, int, dict[str, Checked]]:
                outcome = super().arrive_if_fresh(counter_name, value, also, hint, limit, ends)
                if outcome[0] is not None:
                    counter.event("last_join")
                return outcome

            def set_once(self, name: str, value: str) -> tuple[bool, str]:
                outcome = super().set_once(name, value)
                if "/closer/" in name and outcome[0]:
                    CLOSER.won = True
                if name.endswith("/closed"):
                    counter.event("closed")
                return outcome

        settings = RendezvousSettings(min_nodes=n, max_nodes=n, join_timeout=timeout + 30, last_call_timeout=30)
        for j, client in enumerate(clients):
            i = first + j
            store = CountingEtcdStore(client, f"rally/sim{trial}/", timeout + 30)
            me = NodeInfo(node_id=f"node{i:05d}:{i}:sim", host=f"node{i:05d}", addr="127.0.0.1", nproc=8)
            rdzv = Rendezvous(store, settings, me)
            nodes.append(lambda r=rdzv: r.next_round().group_rank)
    elif impl == "etcdfloor":
        from rally.rendezvous.etcd.client import b64

        for j, client in enumerate(clients):
            key = b64(f"floor{trial}/{first + j}")

            def puts(client=client, key=key) -> int:
                for _ in range(ETCD_FLOOR_OPS):
                    client.call("/v3/kv/put", {"key": key, "value": b64(ETCD_FLOOR_VALUE)}, timeout + 30)
                return 0

            nodes.append(puts)
    elif impl == "torch":
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        class CountingProxy:
            """What C10dRendezvousBackend sees: the node's store, with its calls counted."""

            def __init__(self, store) -> None:
                self._store = store

            def __getattr__(self, name):
                fn = getattr(self._store, name)

                def call(*a, **k):
                    counter.bump()
                    return fn(*a, **k)

                return call

        rdzv_timeout = RendezvousTimeout(join=timedelta(seconds=timeout + 30))
        run_id = f"sim{trial}"
        for j, raw in enumerate(clients):
            i = first + j
            backend = C10dRendezvousBackend(CountingProxy(raw), run_id)
            handler = DynamicRendezvousHandler.from_backend(
                run_id, raw, backend, min_nodes=n, max_nodes=n, local_addr=f"node{i:05d}", timeout=rdzv_timeout
            )
            nodes.append(lambda h=handler: h.next_rendezvous().rank)
    else:  # floor
        for j, raw in enumerate(clients):
            key = f"floor{trial}/{first + j}"

            def ops(raw=raw, key=key) -> int:
                for _ in range(FLOOR_OPS):
                    counter.bump()
                    raw.add(key, 1)
                return 0

            nodes.append(ops)
    return nodes


def _size(value) -> int:
    """Bytes a store call carries: its keys and values (a profile's bytes per node)."""
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8 if isinstance(value, int) else 0


def run_trial(nodes: list, first: int, counter: Counter, n: int = 0, stagger: float = 0.0) -> dict:
    """Start one thread per node, say "ready", run on "go", report when done or asked."""
    count = len(nodes)
    lock = threading.Lock()
    start = threading.Event()
    report = threading.Event()  # every node here is done, or the parent asks for a report
    done_at: list[float | None] = [None] * count
    ranks: list[int | None] = [None] * count
    errors: list[str] = []
    remaining = [count]
    ops_done: list[tuple[int, float, float] | None] = [None]  # (calls, wall, cpu) when the last node here finished
    before = (counter.calls, counter.wall, counter.cpu)
    counter.events.clear()

    def node(j: int) -> None:
        start.wait()
        if stagger:  # arrivals spread evenly over `stagger` seconds, as with start-up skew
            time.sleep(stagger * (first + j) / max(n, 1))
        try:
            ranks[j] = nodes[j]()
            done_at[j] = time.monotonic()
        except Exception as exc:  # reported, not raised
            text = str(exc).strip().splitlines()
            with lock:
                errors.append(f"node {first + j}: {type(exc).__name__}: {text[0] if text else ''}")
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                ops_done[0] = (counter.calls, counter.wall, counter.cpu)
                report.set()

    for j in range(count):
        threading.Thread(target=node, args=(j,), daemon=True).start()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        os._exit(1)
    start.set()

    def listen() -> None:
        if sys.stdin.readline().strip() == "report":
            report.set()

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    report.wait()
    with lock:
        calls, wall, cpu = ops_done[0] or (counter.calls, counter.wall, counter.cpu)
        result = {
            "done_at": list(done_at),
            "ranks": list(ranks),
            "errors": list(errors),
            "store_ops": calls - before[0],
            "client_wall": wall - before[1],
            "client_cpu": cpu - before[2],
            "events": dict(counter.events),
            "log": list(counter.log or []),
        }
        if counter.log is not None:
            counter.log.clear()
    print(json.dumps(result), flush=True)
    if remaining[0]:
        return {"stop": True}
    # The parent sends "next" (or "report" we must swallow) before the next trial's "ready".
    listener.join()
    return {"stop": False}


def child(args: argparse.Namespace) -> None:
    n, first, count = args.nodes, args.first, args.count
    trials = args.trials.split(",")
    raise_fd_limit(3 * count + 256)  # an etcd node holds a connection and, while it waits, a watch
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    threading.stack_size(512 * 1024)
    from torch.distributed import TCPStore

    op_timeout = timedelta(seconds=args.timeout + 30)
    counter = Counter()
    if args.profile:
        counter.log = []
    clients = []
    if set(trials) - set(ETCD_IMPLS):
        clients = [TCPStore("127.0.0.1", args.port, is_master=False, timeout=op_timeout) for _ in range(count)]
    etcd_clients = []
    if set(trials) & set(ETCD_IMPLS):
        from bench.simetcd import etcd3gw_clients, etcd_clients

        connect_etcd = etcd3gw_clients if args.etcd_client == "etcd3gw" else etcd_clients
        etcd_clients = connect_etcd(args.etcd_port, count, counter)
    for trial, impl in enumerate(trials):
        own = etcd_clients if impl in ETCD_IMPLS else clients
        nodes = build_nodes(impl, trial, n, first, own, counter, args.timeout)
        if run_trial(nodes, first, counter, n, args.stagger)["stop"]:
            break
    time.sleep(args.timeout + 60)  # the parent kills us
    os._exit(0)


# ================================================================== parent: the store and the clock
def parent(args: argparse.Namespace) -> None:
    n, procs = args.nodes, max(1, min(args.procs, args.nodes))
    trials = args.trials.split(",")
    needed = 3 * n + 512 if set(trials) & set(ETCD_IMPLS) else n + 512  # etcd: a connection and a watch per node
    fd_limit = raise_fd_limit(needed)
    if fd_limit < needed - 448:
        for impl in trials:
            emit({"impl": impl, "nodes": n, "converged": False, "error": f"fd limit {fd_limit} too low"})
        return
    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=args.timeout + 30),
    )
    base, extra = divmod(n, procs)
    children: list[subprocess.Popen] = []
    first = 0
    t_setup = time.monotonic()
    etcd = None
    try:
        if set(trials) & set(ETCD_IMPLS):
            from bench.simetcd import LocalEtcd, two_free_ports

            etcd = LocalEtcd(*two_free_ports())
            etcd.wait_ready()
        for p in range(procs):
            count = base + (1 if p < extra else 0)
            children.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.simrdzv",
                        "--child",
                        "--trials",
                        args.trials,
                        "--nodes",
                        str(n),
                        "--first",
                        str(first),
                        "--count",
                        str(count),
                        "--port",
                        str(server.port),
                        "--timeout",
                        str(args.timeout),
                        "--stagger",
                        str(args.stagger),
                        "--etcd-port",
                        str(etcd.client_port if etcd else 0),
                        *(["--profile"] if args.profile else []),
                        "--switch-interval",
                        str(args.switch_interval),
                        "--etcd-client",
                        args.etcd_client,
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                )
            )
            first += count
        stopped = False
        for trial, impl in enumerate(trials):
            base_result = {
                "impl": impl,
                "nodes": n,
                "procs": procs,
                "trial": trial,
                "timeout": args.timeout,
                "stagger": args.stagger,
                "switch_interval": args.switch_interval,
                **({"etcd_client": args.etcd_client} if impl in ETCD_IMPLS else {}),
            }
            if stopped:
                emit({**base_result, "converged": False, "skipped": True, "error": "an earlier trial did not converge"})
                continue
            setup_deadline = time.monotonic() + 120 + n * 0.05
            lines = [_readline(c, setup_deadline) for c in children]
            if any(line != "ready" for line in lines):
                emit({**base_result, "converged": False, "error": f"a child did not get ready ({lines})"})
                stopped = True
                continue
            setup = time.monotonic() - t_setup
            etcd_cpu = etcd.cpu_seconds() if etcd and impl in ETCD_IMPLS else None
            probe = QueueProbe(server.port, args.timeout) if args.profile else None
            cpu_before = cpu_seconds(children) if args.profile else (0.0, 0.0)
            t0 = time.monotonic()
            for c in children:
                c.stdin.write("go\n")
                c.stdin.flush()
            deadline = t0 + args.timeout
            done_at, ranks, errors, ops, client_wall, client_cpu = [], [], [], 0, 0.0, 0.0
            events: dict[str, float] = {}
            log: list = []
            complete = True
            for c in children:
                line = _readline(c, deadline)
                if not line:  # not converged in time: ask for what this child has so far
                    complete = False
                    _send(c, "report")
                    line = _readline(c, time.monotonic() + 10)
                if line:
                    part = json.loads(line)
                    done_at += part["done_at"]
                    ranks += part["ranks"]
                    errors += part["errors"]
                    ops += part["store_ops"]
                    client_wall += part["client_wall"]
                    client_cpu += part["client_cpu"]
                    log += part.get("log", [])
                    for k, v in part.get("events", {}).items():
                        events[k] = max(events.get(k, 0.0), v)
            probes = probe.stop() if probe else []
            cpu_after = cpu_seconds(children) if args.profile else (0.0, 0.0)
            store_cpu = etcd.cpu_seconds() - etcd_cpu if etcd_cpu is not None else None
            finished = [d for d in done_at if d is not None]
            unique = len({r for r in ranks if r is not None})
            ranked = n if impl not in ("floor", "etcdfloor") else 1  # floors rank nobody: all answer 0
            converged = complete and len(finished) == n and not errors and unique == ranked
            emit(
                {
                    **base_result,
                    "converged": converged,
                    "done": len(finished),
                    "elapsed": (max(finished) - t0) if converged else None,
                    "median_node": (sorted(finished)[len(finished) // 2] - t0) if finished else None,
                    "setup": setup,
                    "store_ops": ops,
                    "store_ops_per_node": ops / n,
                    # per store request: its wall time, the Python client's own CPU time (the calling
                    # thread's), and (etcd) the etcd member's CPU time over the trial
                    "request_wall_ms": 1000 * client_wall / ops if ops else None,
                    "client_cpu_ms_per_request": 1000 * client_cpu / ops if ops else None,
                    "store_cpu_ms_per_request": 1000 * store_cpu / ops if ops and store_cpu is not None else None,
                    # rally only: when the last node joined and when the round was closed
                    **{f"{k}_at": v - t0 for k, v in events.items()},
                    "errors": errors[:5],
                    "error_count": len(errors),
                    **(
                        {
                            "profile": {
                                "nodes_cpu_ms_per_node": round(1000 * (cpu_after[0] - cpu_before[0]) / n, 3),
                                "server_cpu_ms_per_node": round(1000 * (cpu_after[1] - cpu_before[1]) / n, 3),
                                **profile(log, probes, t0, events, finished, n),
                            }
                        }
                        if args.profile
                        else {}
                    ),  # fmt: skip
                }
            )
            if not complete:
                stopped = True
                continue
            for c in children:
                _send(c, "next")
            t_setup = time.monotonic()
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
            c.wait()
        if etcd is not None:
            etcd.stop()


def cpu_seconds(children: list[subprocess.Popen]) -> tuple[float, float]:
    """CPU time (user + system) so far of the simulated nodes' processes, and of this process
    (the store server's thread; the probe's share is small)."""
    import psutil

    def used(pid: int) -> float:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system

    return sum(used(c.pid) for c in children), used(os.getpid())


class QueueProbe:
    """The store server's queue during a trial: a client of its own sends one `check` every 5 ms
    and records how long the answer took (a request waits behind everything queued before it)."""

    def __init__(self, port: int, timeout: float) -> None:
        from torch.distributed import TCPStore

        self.client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout + 30))
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(0.005):
            t = time.monotonic()
            self.client.check(["probe"])
            self.samples.append((t, time.monotonic() - t))

    def stop(self) -> list[tuple[float, float]]:
        self.done.set()
        self.thread.join()
        return self.samples


def profile(log: list, probes: list, t0: float, events: dict[str, float], finished: list[float], n: int) -> dict:
    """Where a trial's time went, by phase (go -> last join -> closed -> last node done): store
    calls and bytes per node, the commonest calls, the server's queue (probe round trips), and
    the closer's own calls in order."""
    end = max(finished, default=t0)
    bounds = [("to_last_join", t0, events.get("last_join", t0)), ("join_to_close", events.get("last_join", t0),
              events.get("closed", t0)), ("close_to_done", events.get("closed", t0), end)]  # fmt: skip
    phases = {}
    for name, start, stop in bounds:
        calls = [c for c in log if start <= c[0] < stop or (name == "close_to_done" and c[0] >= stop)]
        kinds: dict[str, list[float]] = {}
        for c in calls:
            kinds.setdefault(f"{c[1]} {c[2]}", []).append(c[5])
        rtts = sorted(r for t, r in probes if start <= t < stop)
        phases[name] = {
            "seconds": round(stop - start, 3),
            "calls_per_node": round(len(calls) / n, 2),
            "bytes_per_node": round(sum(c[3] + c[4] for c in calls) / n),
            # the commonest calls: how many, and their median wall time (ms)
            "top_calls": [
                (kind, len(walls), round(1000 * sorted(walls)[len(walls) // 2], 1))
                for kind, walls in sorted(kinds.items(), key=lambda kv: -len(kv[1]))[:6]
            ],
            "queue_ms_p50": round(1000 * rtts[len(rtts) // 2], 2) if rtts else None,
            "queue_ms_max": round(1000 * rtts[-1], 2) if rtts else None,
        }
    closer = sorted(c for c in log if c[6])
    close_at = next((c[0] for c in closer if c[1] in ("compare_set", "txn") and c[2] == "#/closed"), None)
    wake: dict[str, list] = {}
    if close_at is not None:  # after the close: when each node's reads started, and how long they took
        for op, kind in (("get", "#/closed"), ("compare_set", "#/assign/#/#")):
            calls = sorted(c for c in log if c[1] == op and c[2] == kind and c[0] >= close_at)
            starts, walls = [c[0] - close_at for c in calls], sorted(c[5] for c in calls)
            wake[f"{op} {kind}"] = [
                round(starts[int(q * (len(starts) - 1))], 3) if starts else None for q in (0.0, 0.5, 0.9, 1.0)
            ] + [
                round(1000 * walls[len(walls) // 2], 1) if walls else None,
                round(1000 * walls[-1], 1) if walls else None,
            ]
        wake["done"] = [round(d - close_at, 3) for d in sorted(finished)[:: max(1, len(finished) // 4)]]
    return {
        "after_close": wake,  # per read: start time after the close (min, p50, p90, max), wall ms (p50, max)
        "phases": phases,
        "bytes_per_node": round(sum(c[3] + c[4] for c in log) / n),
        "closer": [(round(c[0] - t0, 3), c[1], c[2], round(1000 * c[5], 1), c[3] + c[4]) for c in closer][:40],
    }


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def _send(proc: subprocess.Popen, line: str) -> None:
    try:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    except OSError:
        pass


def _readline(proc: subprocess.Popen, deadline: float) -> str:
    """One line from a child's stdout, or "" if none arrives before `deadline`."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return ""
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if ready:
            return proc.stdout.readline().strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--trials", default="floor,rally,torch", help=f"comma-separated, from {', '.join(IMPLS)}")
    parser.add_argument("--procs", type=int, default=4, help="child processes that share the nodes")
    parser.add_argument("--timeout", type=float, default=60.0, help="per trial")
    parser.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="spread the nodes' arrivals evenly over this many seconds (default: all at once)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="rally: calls, bytes and the server's queue by phase, the closer's calls"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=SWITCH_INTERVAL,
        help=f"the children's sys.setswitchinterval (default {SWITCH_INTERVAL:g} s; 0: Python's own 0.005 s)",
    )
    parser.add_argument(
        "--etcd-client",
        choices=("rally", "etcd3gw"),
        default="rally",
        help="etcd trials: rally's own HTTP client, or etcd3gw's (pip install etcd3gw) under it (issue 28)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--etcd-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(t not in IMPLS for t in args.trials.split(",")):
        parser.error(f"--trials: choose from {', '.join(IMPLS)}")
    if args.child:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        child(args)
        return
    parent(args)
    os._exit(0)


if __name__ == "__main__":
    main()
