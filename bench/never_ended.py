"""The long soak of "the job that never ended": short jobs beside jobs whose helper processes
(the checkpoint holder, the orphan guard, the worker template) are SIGSTOPped, SIGKILLed and
starved, for as long as asked. tests/test_job_end_bounded.py runs the same soak for 20 s in CI.

    python bench/never_ended.py --seconds 600 --short 3 --attacked 2 --late 25 [--keep DIR]

Prints each job that was late (its agent's stacks, dumped by rally's stack signal, included) or
failed, then one line: jobs run, the longest, how many were late. Exit 1 if any was late or a
short job did not exit 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.never_ended import run_jobs_beside_attacks  # noqa: E402 - tests/ is put on the path just above


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to keep starting jobs")
    parser.add_argument("--late", type=float, default=25.0, help="seconds after its workers' exit a job is late")
    parser.add_argument("--short", type=int, default=3, help="loops of short jobs")
    parser.add_argument("--attacked", type=int, default=2, help="loops of jobs whose helpers are attacked")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the jobs' logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="never-ended-") as scratch:
        root = args.keep or Path(scratch)
        jobs = run_jobs_beside_attacks(root, args.seconds, args.late, args.short, args.attacked, args.seed)
    bad = [j for j in jobs if j.late or (j.name.startswith("short") and j.returncode != 0)]
    for job in bad:
        print(job.describe(), "\n")
    longest = max((j.elapsed for j in jobs), default=0.0)
    print(f"{len(jobs)} jobs, longest {longest:.1f} s, {sum(j.late for j in jobs)} late, {len(bad)} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
