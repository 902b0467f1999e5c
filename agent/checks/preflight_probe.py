"""The pre-flight probe: one process per node, forked from the worker template (torch is loaded)
or started plainly, run when a round forms and before the training script (agent/checks/preflight.py).

It measures, and writes as JSON to RALLY_PREFLIGHT_OUT:

* `compute`: the fastest of COMPUTE_REPEATS blocks of matrix products on one thread (the fastest,
  so a moment of contention from the other nodes' probes on a shared machine does not count; a
  CPU throttled by its cgroup or shared with a busy process is slow in every block);
* `allreduce`: one all-reduce of COLLECTIVE_MB over the job's backend (gloo, or NCCL where this
  node's workers would use GPUs), after a warm-up one, checked for the right sum;
* `link`: each node exchanges LINK_MB with every other node in turn (a round-robin schedule, so
  every pair is measured once and all pairs of a turn run at once); its fastest pair. A node
  with a bad link is slow with every partner; its partners are fast with someone else. With two
  nodes there is one pair and nobody can be told apart, so `link` is left out of the judgement.

Started by file path like agent/worker_side/bootstrap.py: nothing of rally is imported here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

COMPUTE_REPEATS = 5
COMPUTE_SIZE = 256  # 64 products of 256 x 256 float32: about 30 ms per block on one core here
COMPUTE_PRODUCTS = 64
COLLECTIVE_MB = 4
LINK_MB = 1
LINK_REPEATS = 3


def pairings(world: int) -> list[list[tuple[int, int]]]:
    """Round-robin turns (the circle method): every pair of ranks meets once, each rank once per turn."""
    players: list[int | None] = list(range(world)) + ([None] if world % 2 else [])
    turns = []
    for _ in range(len(players) - 1):
        half = len(players) // 2
        pairs = [(players[i], players[-1 - i]) for i in range(half)]
        turns.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return turns


def measure_compute(torch) -> float:  # the torch module
    a = torch.randn(COMPUTE_SIZE, COMPUTE_SIZE)
    best = float("inf")
    for _ in range(COMPUTE_REPEATS):
        started = time.perf_counter()
        for _ in range(COMPUTE_PRODUCTS):
            a = torch.tanh(a @ a)
        best = min(best, time.perf_counter() - started)
    return best


def measure_links(torch, dist, rank: int, world: int) -> dict[int, float]:
    """Seconds for LINK_MB each way with each partner (the fastest of LINK_REPEATS: a moment of CPU
    contention on a shared machine is not a slow link; a slow link is slow every time)."""
    send = torch.ones(LINK_MB * 2**18)
    receive = torch.empty_like(send)
    ack = torch.ones(1)
    times: dict[int, float] = {}
    for turn in pairings(world):
        partner = next((b if a == rank else a for a, b in turn if rank in (a, b)), None)
        if partner is None:
            continue
        for _ in range(LINK_REPEATS):
            started = time.perf_counter()
            # A send returns once the data is in the socket's buffer; the ack makes both sides
            # time the whole exchange, delivery included, in both directions.
            if rank < partner:
                dist.send(send, partner)
                # wait: short: a 1 MB exchange in the probe child, which the agent kills at PROBE_TIMEOUT_SECONDS
                dist.recv(receive, partner)
                dist.send(ack, partner)
            else:
                # wait: short: a 1 MB exchange in the probe child, which the agent kills at PROBE_TIMEOUT_SECONDS
                dist.recv(receive, partner)
                dist.send(send, partner)
                # wait: short: a 1 MB exchange in the probe child, which the agent kills at PROBE_TIMEOUT_SECONDS
                dist.recv(ack, partner)
            times[partner] = min(times.get(partner, float("inf")), time.perf_counter() - started)
    return times


def main() -> None:
    result: dict = {"compute": None, "allreduce": None, "link": None, "links": {}, "error": None}
    out = os.environ["RALLY_PREFLIGHT_OUT"]
    started = time.perf_counter()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        result["compute"] = measure_compute(torch)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = timedelta(seconds=float(os.environ["RALLY_PREFLIGHT_TIMEOUT"]))
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        prefixed = dist.PrefixStore(os.environ["RALLY_PREFLIGHT_PREFIX"], store)
        result["startup"] = time.perf_counter() - started - result["compute"]  # imports and the store's connect
        backend = os.environ.get("RALLY_PREFLIGHT_BACKEND", "gloo")
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        result["connect"] = (
            time.perf_counter() - started - result["compute"]
        )  # the store, then the backend's connections
        device = "cuda" if backend == "nccl" else "cpu"
        dist.all_reduce(torch.ones(1, device=device))  # warm-up: connections
        tensor = torch.ones(COLLECTIVE_MB * 2**18, device=device)
        began = time.perf_counter()
        dist.all_reduce(tensor)
        result["allreduce"] = time.perf_counter() - began
        if int(tensor[0].item()) != world:
            raise RuntimeError(f"all-reduce gave {tensor[0].item()}, not {world}")
        if backend == "gloo":
            links = measure_links(torch, dist, rank, world)
            result["links"] = {str(k): v for k, v in links.items()}
            result["link"] = min(links.values()) if links else None
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # any failure is the probe's answer
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        traceback.print_exc()
    result["seconds"] = time.perf_counter() - started
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the answer is written: skip tearing torch down (a few hundred ms the round would wait)


if __name__ == "__main__":
    main()
