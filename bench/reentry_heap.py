"""Who keeps what of each re-entry of `rally.job.run`: the C heap's growth per entry, by call site.

    python -m bench.reentry_heap [--entries 25] [--more 50]

tests/test_inprocess_restart.py bounds the anonymous RSS growth of 50 re-entries (160 KiB); this
names where what remains comes from. Two rally jobs, two ranks on gloo, a DDP model kept between
entries and a fault every entry (rank 1 raises; rank 0, waiting in a barrier, is released by
rally's abort), as that test's job. In each, heaptrack (Debian's `heaptrack` package) is attached
to rank 1 at its 5th entry and records every allocation from then on; at the process's end,
`heaptrack_print --print-leaks` lists what is still allocated, by the function that allocated it.
The first job runs `--entries` entries, the second `--entries + --more`: what is alive at a
process's end either way (the last round's group, the flight recorder's full ring, caches)
cancels out in the difference, and what is left, divided by `--more`, is what each re-entry keeps
for good. Python's own objects show as `_PyObject_Malloc` and friends (heaptrack sees C frames
only). Rank 0's anonymous RSS (no heaptrack in it) from the 5th entry to the last is printed too.

Measured (2026-12-04, torch 2.13.0+cpu, glibc 2.36, Python 3.11.7) in bench/results/reentry_heap.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS, Job, bench_env, commit, launcher_cmd, wait_until

ATTACH_AT = 5  # the entry at which heaptrack is attached (the test compares the 5th and the last)

WORKER = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job

    OUT = Path(os.environ["OUT"])
    ENTRIES = int(os.environ["ENTRIES"])
    ATTACH_AT = int(os.environ["ATTACH_AT"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = None  # kept between entries, as a script keeps its model
    entries = 0

    def anonymous_rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))

    def train():
        global ddp, entries
        entries += 1
        rank = job.context().rank
        with open(OUT / f"rss.{rank}", "a") as f:
            f.write(f"{anonymous_rss()}\\n")
        if entries == ATTACH_AT and rank == 1:
            (OUT / "pid").write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while not (OUT / "attached").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            ddp(torch.ones(4, 8)).sum().backward()
            opt.step()
        job.save({"model": model.state_dict()}, entries)
        job.wait_saved()
        dist.barrier()
        if entries < ENTRIES and rank == 1:
            raise ValueError(f"entry {entries}")  # rank 0 waits in the barrier: rally releases it
        dist.barrier()

    job.run(train)
    """
)

SIZE = re.compile(r"^([\d.]+)([KMG]?)B? leaked over (\d+) calls from$")
UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}  # heaptrack_print's units are decimal


@dataclass
class Site:
    function: str
    leaked: float  # bytes still allocated at the process's end
    calls: int  # allocations made from this function while heaptrack was attached


def leak_sites(report: str) -> dict[str, Site]:
    """heaptrack_print's "MEMORY LEAKS" section as {function: Site}, one per top-level block."""
    sites: dict[str, Site] = {}
    lines = report.splitlines()
    for number, line in enumerate(lines):
        match = SIZE.match(line)  # a top-level block: no indentation, the function on the next line
        if match and number + 1 < len(lines):
            function = lines[number + 1].strip()
            site = sites.setdefault(function, Site(function, 0.0, 0))
            site.leaked += float(match[1]) * UNITS[match[2]]
            site.calls += int(match[3])
    return sites


def owner(function: str) -> str:
    """Whose allocation a call site is, by the function's name."""
    if function.startswith(("c10d::", "torch::", "c10::", "at::", "gloo::", "pybind11::")):
        return "torch"
    if function in ("__add_to_environ", "__GI___tsearch", "setenv", "tsearch"):
        return "glibc setenv (the round's MASTER_PORT, RALLY_ROUND, ...; never freed, by design)"
    if function.startswith(("_Py", "Py", "new_keys_object", "list_", "dict")):
        return "Python objects"
    return "other"


def run_job(workdir: Path, entries: int) -> tuple[dict[str, Site], list[int]]:
    """One job of `entries` entries with heaptrack attached to rank 1 at ATTACH_AT: its leak
    sites, and rank 0's anonymous RSS (KiB) at every entry."""
    out = workdir / "out"
    out.mkdir(parents=True)
    script = workdir / "reentry.py"
    script.write_text(WORKER)
    env = bench_env({"OUT": str(out), "ENTRIES": str(entries), "ATTACH_AT": str(ATTACH_AT)})
    # torch's flight recorder keeps the last TORCH_FR_BUFFER_SIZE collectives of the process (2000 by
    # default) in one ring: 16 is full before the 5th entry, as in the test
    env["TORCH_FR_BUFFER_SIZE"] = "16"
    argv = [*launcher_cmd("rally"), "--nproc-per-node", "2", "--max-restarts", str(entries)]
    job = Job.start("rally", [*argv, "--log-dir", str(workdir / "logs"), str(script)], env, workdir, workdir)
    tracer: subprocess.Popen[str] | None = None
    try:
        if not wait_until(lambda: (out / "pid").exists() or not job.alive(), timeout=120):
            raise RuntimeError(f"rank 1 never reached its {ATTACH_AT}th entry:\n{job.tail()}")
        pid = (out / "pid").read_text()
        tracer = subprocess.Popen(
            ["heaptrack", "-p", pid], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert tracer.stdout is not None
        for line in tracer.stdout:  # heaptrack says so once its library is in the process
            if "injection finished" in line:
                break
        else:
            raise RuntimeError("heaptrack could not attach to rank 1 (it needs ptrace: run as root)")
        (out / "attached").touch()
        if job.wait(timeout=60 + entries) != 0:
            raise RuntimeError(f"the job failed:\n{job.tail()}")
        tracer.communicate(timeout=60)
    finally:
        job.kill()
        if tracer is not None and tracer.poll() is None:
            tracer.kill()
            tracer.wait()
    trace = next(workdir.glob("heaptrack.*.zst"))
    report = subprocess.run(
        ["heaptrack_print", "-f", str(trace), "--print-leaks", "1", "--print-peaks", "0",
         "--print-allocators", "0", "--print-temporary", "0"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rss = [int(line) for line in (out / "rss.0").read_text().split()]
    return leak_sites(report), rss


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=25, help="entries of the first job (at least 10)")
    parser.add_argument("--more", type=int, default=50, help="how many more the second job runs")
    args = parser.parse_args()
    if args.entries < 2 * ATTACH_AT or args.more < 10:
        parser.error(f"--entries must be at least {2 * ATTACH_AT} and --more at least 10")
    missing = [tool for tool in ("heaptrack", "heaptrack_print") if shutil.which(tool) is None]
    if missing:
        print(f"bench.reentry_heap: {' and '.join(missing)} not found: apt-get install heaptrack", file=sys.stderr)
        return 2

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="rally-reentry-heap-") as tmp:
        short, short_rss = run_job(Path(tmp) / "short", args.entries)
        long, long_rss = run_job(Path(tmp) / "long", args.entries + args.more)

    rows = []
    for function in sorted(set(short) | set(long)):
        a, b = short.get(function, Site(function, 0, 0)), long.get(function, Site(function, 0, 0))
        kept = (b.leaked - a.leaked) / args.more
        if abs(kept) >= 1:
            rows.append((owner(function), function, kept, (b.calls - a.calls) / args.more))
    rows.sort(key=lambda row: -row[2])
    by_owner: dict[str, float] = {}
    for who, _, kept, _ in rows:
        by_owner[who] = by_owner.get(who, 0.0) + kept

    entries = args.entries + args.more
    rss_growth = long_rss[-1] - long_rss[ATTACH_AT - 1]
    lines = [
        f"Re-entry heap, {started}, {os.cpu_count()} CPUs, rally at `{commit()[:10]}`, torch {torch_version()}, "
        f"glibc {platform.libc_ver()[1]}, Python {platform.python_version()}, "
        f"`python -m bench.reentry_heap --entries {args.entries} --more {args.more}`, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}: "
        f"what each of {args.more} more re-entries keeps allocated (rank 1, heaptrack from its {ATTACH_AT}th entry, "
        f"job of {entries} entries less job of {args.entries})",
        "",
        "| owner | bytes kept per entry |",
        "|---|---|",
        *(f"| {who} | {kept:+.0f} |" for who, kept in sorted(by_owner.items(), key=lambda item: -item[1])),
        f"| **all** | **{sum(by_owner.values()):+.0f}** |",
        "",
        "| owner | allocated in | bytes kept per entry | allocations per entry |",
        "|---|---|---|---|",
        *(
            f"| {who.split(' (')[0]} | `{function[:90]}` | {kept:+.0f} | {calls:.1f} |"
            for who, function, kept, calls in rows
        ),
        "",
        f"Rank 0 (no heaptrack), anonymous RSS from its {ATTACH_AT}th entry to its {entries}th: "
        f"{rss_growth:+d} KiB ({rss_growth * 1024 / (entries - ATTACH_AT):+.0f} B an entry); "
        f"in the {args.entries}-entry job {short_rss[-1] - short_rss[ATTACH_AT - 1]:+d} KiB.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reentry_heap.md").write_text(text)
    (RESULTS / "reentry_heap.json").write_text(
        json.dumps(
            {"started": started, "args": vars(args), "rows": rows, "by_owner": by_owner, "rss_kib": long_rss}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
