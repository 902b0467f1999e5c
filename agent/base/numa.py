"""`--numa-binding`: each worker runs on the CPUs near its GPU, as torchrun 2.13 binds them.

Which CPUs are "near" is torch's own judgement (`torch.numa.binding`: the GPU's NUMA node, its
socket, an exclusive share of the node, or its core complex), so rally and torchrun bind the
same worker to the same CPUs. torchrun then wraps the command in `numactl`; rally needs no
extra program: the agent passes the CPU list in RALLY_CPU_AFFINITY and the worker's process
applies it with `sched_setaffinity` before anything runs (in the child before exec for plain
starts, first thing in the bootstrap for template-forked ones), so every thread the script
starts inherits it.

Worker (local rank i) uses GPU i, as torchrun assumes. Without GPUs there is nothing to bind
near and the launcher says so once (launcher/checks/worker_flags.py).
"""

from __future__ import annotations

import os
from functools import cache

AFFINITY_VARIABLE = "RALLY_CPU_AFFINITY"


class NumaBindingError(RuntimeError):
    """torch could not work out the CPUs near a GPU (the message says why)."""


@cache
def cpus_near_gpu(mode: str, gpu_index: int) -> frozenset[int]:
    """The logical CPUs torch binds the worker of `gpu_index` to in affinity mode `mode`."""
    try:  # feature detection: torch.numa.binding is newer than the oldest torch rally supports
        from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to
    except ImportError:
        from importlib.metadata import version

        raise NumaBindingError(
            f"--numa-binding {mode}: this torch ({version('torch')}) has no torch.numa.binding, which picks "
            "the CPUs; upgrade torch (2.13 has it)"
        ) from None

    try:
        cpus = _get_logical_cpus_to_bind_to(
            gpu_index=gpu_index, numa_options=NumaOptions(affinity_mode=AffinityMode(mode))
        )
    except Exception as exc:  # torch raises several types reading sysfs and CUDA
        raise NumaBindingError(f"--numa-binding {mode}: cannot find the CPUs near GPU {gpu_index}: {exc}") from exc
    if not cpus:
        raise NumaBindingError(f"--numa-binding {mode}: torch found no CPU near GPU {gpu_index}")
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def parse_cpus(text: str) -> set[int]:
    """'0,1,2' (what format_cpus writes) or ranges such as '0-3,8'."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            low, high = part.split("-", 1)
            out.update(range(int(low), int(high) + 1))
        elif part:
            out.add(int(part))
    return out


def apply_from_environment(env: dict[str, str] | os._Environ = os.environ) -> None:
    """In the worker's process: bind it (and so every thread it will start) to RALLY_CPU_AFFINITY."""
    text = env.get(AFFINITY_VARIABLE)
    if text:
        os.sched_setaffinity(0, parse_cpus(text))
