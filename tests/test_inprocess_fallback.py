"""In-process restarts are bounded and honest (docs/restartable.md): they spend
the job's one restart budget, and a loop of fast failures that saves nothing newer falls back to
restarting the processes, said in one line and recorded as a whole restart; and in a job of
several nodes one node's whole restart (here a rank whose teardown failed: its state in doubt) is
every node's.

Real rally, two workers inside `rally.job.run`, a script without torch (the rule is the agent's;
a worker's entry costs milliseconds, so the failures come well within BURST_SECONDS): rank 1
raises until the job has failed FAILURES times (counted in a file, across processes), rank 0
waits in the function for it each time.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from rally.agent.rounds.reentry import BURST_LIMIT, BURST_SECONDS
from support.agents import StoreProcess, c10d_args, start_agent, stop_all
from support.helpers import clean_env, rally_status, read_events, run_rally

TRAIN = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from rally import job

    OUT = Path(os.environ["OUT"])
    FAILURES = int(os.environ["FAILURES"])
    entries = 0

    def train():
        global entries
        entries += 1
        rank = job.context().rank
        with open(OUT / f"entries.{rank}", "a") as f:
            f.write(f"{entries} {os.getpid()}\\n")
        failed = OUT / "failures"
        if rank == 1:
            while entries == 1 and not (OUT / "entries.0").exists():  # rank 0 in rally.job.run too: a rank
                time.sleep(0.01)  # not yet there when another fails is restarted whole, with every other
            n = len(failed.read_text()) if failed.exists() else 0
            if n < FAILURES:
                with open(failed, "a") as f:
                    f.write("x")
                raise ValueError(f"injected failure {n + 1}")
            (OUT / "finish").touch()
        deadline = time.monotonic() + 60
        while not (OUT / "finish").exists():  # rank 0: in the function while rank 1 fails
            assert time.monotonic() < deadline, "rank 1 never finished"
            time.sleep(0.02)

    job.run(train)
    """
)


def _run(tmp: Path, failures: int, max_restarts: int) -> tuple[object, Path, Path]:
    out, logs = tmp / "out", tmp / "logs"
    out.mkdir()
    script = tmp / "train.py"
    script.write_text(TRAIN)
    argv = ["--nproc-per-node", "2", "--max-restarts", str(max_restarts), "--log-dir", str(logs), str(script)]
    result = run_rally(argv, cwd=tmp, env=clean_env(OUT=str(out), FAILURES=str(failures)), timeout=150)
    return result, out, logs


def _entries(out: Path, rank: int) -> list[tuple[int, int]]:
    """(entry number in its process, pid) of each entry of `rank`'s function."""
    return [(int(e), int(p)) for e, p in (line.split() for line in (out / f"entries.{rank}").read_text().splitlines())]


@pytest.mark.timeout(200)
def test_fast_failures_without_progress_fall_back_to_a_whole_restart_said_in_one_line(tmp_path: Path) -> None:
    failures = BURST_LIMIT + 1  # the last of them finds the burst: its restart is a whole one
    result, out, logs = _run(tmp_path, failures, max_restarts=failures + 1)
    text = result.describe()  # type: ignore[attr-defined]
    assert result.returncode == 0, text  # type: ignore[attr-defined]
    why = (
        f"restarting the worker processes instead of re-entering them: {BURST_LIMIT} in-process restarts in a "
        f"row, each within {BURST_SECONDS:g} s of the last, saved no newer checkpoint"
    )
    assert result.stderr.count(why) == 1, text  # type: ignore[attr-defined]
    assert result.stderr.count("re-entering the training function in every worker") == BURST_LIMIT, text  # type: ignore[attr-defined]
    assert f"restarting all workers (restart {failures} of {failures + 1})" in result.stderr, text  # type: ignore[attr-defined]
    events = read_events(logs)
    restarts = [(e["restart_count"], e["in_process"]) for e in events if e["event"] == "restart"]
    assert restarts == [(n, n <= BURST_LIMIT) for n in range(1, failures + 1)], restarts
    refused = [e for e in events if e["event"] == "reentry_refused"]
    assert [e["reason"] for e in refused] == [why.split(": ", 1)[1]], refused
    shown = rally_status([str(logs)], Path("/"))  # the job is over: from events.jsonl, a whole restart last
    assert f"last restart: round {BURST_LIMIT} ended (worker_failed): rank 1" in shown.stdout, shown.describe()
    report = json.loads(next(logs.glob("*/report.json")).read_text())
    assert [a.get("recovery") for a in report["attempts"][:failures]] == ["in-process"] * BURST_LIMIT + [None]
    # rank 1 entered BURST_LIMIT + 1 times in its first process, then once in a new one; so did rank 0,
    # but for the entries whose round ended before it was back in the function (it then left at once)
    assert [e for e, _ in _entries(out, 1)] == [*range(1, BURST_LIMIT + 2), 1], text
    for rank in (0, 1):
        entries = _entries(out, rank)
        assert len({p for _, p in entries[:-1]}) == 1 and entries[-1] == (1, entries[-1][1]), (rank, entries)
        assert entries[-1][1] != entries[0][1], (rank, entries)


@pytest.mark.timeout(200)
def test_in_process_restarts_spend_the_jobs_restart_budget(tmp_path: Path) -> None:
    result, out, logs = _run(tmp_path, failures=99, max_restarts=2)
    text = result.describe()  # type: ignore[attr-defined]
    assert result.returncode != 0, text  # type: ignore[attr-defined]
    assert "job failed: no restarts left (--max-restarts 2)" in result.stderr, text  # type: ignore[attr-defined]
    assert "raised ValueError: injected failure 3" in result.stderr, text  # type: ignore[attr-defined]
    events = read_events(logs)
    assert [(e["restart_count"], e["in_process"]) for e in events if e["event"] == "restart"] == [(1, True), (2, True)]
    assert len((out / "failures").read_text()) == 3
    assert [e for e, _ in _entries(out, 1)] == [1, 2, 3], text  # every failure re-entered, none restarted
    report = json.loads(next(logs.glob("*/report.json")).read_text())
    assert report["outcome"] == "failed", report


DOUBT = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from rally import job
    from rally.agent.worker_side import restartable

    OUT = Path(os.environ["OUT"])
    failed = OUT / "failed"
    if os.environ["RANK"] == "1" and not failed.exists():  # rank 1's first process: its teardown fails
        def _broken():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        restartable._destroy_process_groups = _broken

    def train():
        rank = job.context().rank
        with open(OUT / f"entries.{rank}", "a") as f:
            f.write(f"{os.getpid()}\\n")
        if rank == 1 and not failed.exists():
            while not (OUT / "entries.0").exists():  # rank 0 in rally.job.run too
                time.sleep(0.01)
            failed.touch()
            raise ValueError("injected failure")
        if rank == 1:
            (OUT / "finish").touch()
        deadline = time.monotonic() + 60
        while not (OUT / "finish").exists():  # rank 0: in the function while rank 1 fails
            assert time.monotonic() < deadline, "rank 1 never finished"
            time.sleep(0.02)

    job.run(train)
    """
)


@pytest.mark.timeout(200)
def test_a_rank_in_doubt_on_one_node_restarts_every_node_whole(tmp_path: Path) -> None:
    """Two nodes (two agents on loopback, one worker each, a standalone `rally store`): rank 1 raises,
    then its teardown fails (its state is in doubt). Its node restarts its worker and says why; the
    other node, whose rank 0 parked fine, restarts its worker too (they shared one world), saying
    which node and why: one whole restart of the job, counted once on each node."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(DOUBT)
    store = StoreProcess(tmp_path)
    args = [*c10d_args(store.port, "2"), "--nproc-per-node", "1", "--max-restarts", "2"]
    agents = [
        start_agent(f"n{i}", tmp_path, [*args, "--log-dir", str(tmp_path / f"logs{i}"), str(script)], {"OUT": str(out)})
        for i in (0, 1)
    ]
    try:
        codes = [agent.wait(150) for agent in agents]
    finally:
        stop_all(agents)
        store.stop()
    text = "\n".join(agent.output() for agent in agents)
    assert codes == [0, 0], text
    for rank in (0, 1):  # a new process for each rank, on both nodes
        pids = (out / f"entries.{rank}").read_text().split()
        assert len(pids) == 2 and pids[0] != pids[1], (rank, pids, text)
    why = (
        "rank 1's state is in doubt: it could not tear torch.distributed down (RuntimeError: CUDA error: an "
        "illegal memory access was encountered)"
    )
    instead = "restarting the worker processes instead of re-entering them: "
    outputs = {i: agent.output() for i, agent in enumerate(agents)}
    doubting = next(i for i, output in outputs.items() if f"{instead}{why}" in output)
    other = outputs[1 - doubting]
    assert re.search(rf"{re.escape(instead)}node 1 \([^)]*\) restarts its workers: {re.escape(why)}", other), text
    for i in (0, 1):
        assert "re-entering the training function" not in outputs[i], text
        events = read_events(tmp_path / f"logs{i}")
        restarts = [(e["restart_count"], e["in_process"]) for e in events if e["event"] == "restart"]
        assert restarts == [(1, False)], (i, restarts)
        assert len([e for e in events if e["event"] == "reentry_refused"]) == 1, (i, events)
