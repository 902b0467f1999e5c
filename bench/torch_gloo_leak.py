"""What torch itself keeps of every gloo process group made and destroyed in one process, without
rally: the in-use growth behind the last few KB an entry of tests/test_inprocess_restart.py's 50
re-entries (docs/restartable.md).

    python bench/torch_gloo_leak.py [--groups 200] [--threads 2]

One process, a world of 1 on a HashStore: each cycle makes a gloo group, runs one all_reduce
(executed on the group's worker threads, as every collective is) and destroys it; the Python
garbage is collected and glibc's free memory trimmed after each. Prints glibc's bytes in use
(`mallinfo2().uordblks`) per cycle after a warm-up of 10, and the process's anonymous RSS. Measured
with torch 2.13.0+cpu, glibc 2.36: ~0.45 KB a group with the default 2 worker threads,
~0.13 KB more per extra worker thread: `c10d::RankLocal<WorkRegistry>::get()` adds an entry per
thread that ever runs a collective's work to a static map keyed by a thread id never reused
(~130 B each), and `ProcessGroupGloo`'s constructor keeps 184 B (an LD_PRELOAD allocation tracker
named those call sites; see docs/restartable.md).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200, help="groups made and destroyed after the warm-up")
    parser.add_argument("--threads", type=int, default=2, help="gloo worker threads per group (torch's default: 2)")
    args = parser.parse_args()
    if args.groups < 1 or args.threads < 1:
        parser.error("--groups and --threads must be at least 1")

    # torch's flight recorder keeps the process's last TORCH_FR_BUFFER_SIZE collectives (2000 by
    # default) for good, across groups: a short ring, full within the warm-up, leaves what groups keep
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "16")
    import torch
    import torch.distributed as dist

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2

    def cycle() -> None:
        store = dist.HashStore()
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._threads = args.threads
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, pg_options=options)
        dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
        gc.collect()
        libc.malloc_trim(0)

    def anonymous_rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))

    for _ in range(10):
        cycle()
    in_use, rss = libc.mallinfo2().uordblks, anonymous_rss()
    for _ in range(args.groups):
        cycle()
    grown, rss_grown = libc.mallinfo2().uordblks - in_use, anonymous_rss() - rss
    print(
        f"{args.groups} gloo groups ({args.threads} worker threads each), torch {torch.__version__}: "
        f"glibc in use {grown / args.groups:+.0f} B a group, anonymous RSS {rss_grown / args.groups:+.2f} KB a group"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
