"""bench/goodput.py's per-fault figures: fault -> every rank stepping again is measured to the
moment the last rank begins its first step of the *next* entry of the training function (each
rank's ``stepping`` line; a step of the entry the fault ended, still finishing, does not count,
and neither does the first step's own compute), and a survivor's pid kept or not is told from the
``entered`` lines. The figures the issue holds rally to (an exception <= 0.3 s, survivors' pids
unchanged) are read from these, so a wrong attribution would pass or fail the wrong launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.goodput import analyze  # noqa: E402


def entered(t: float, rank: int, pid: int, n: int) -> dict:
    return {"e": "entered", "t": t, "rank": rank, "pid": pid, "en": f"{pid}.{n}"}


def stepping(t: float, rank: int, en: str) -> dict:
    return {"e": "stepping", "t": t, "rank": rank, "pid": int(en.split(".")[0]), "en": en, "entered": t, "loaded": t}


def step(t: float, s: int, en: str) -> dict:
    return {"e": "step", "t": t, "a": 0, "step": s, "seconds": 0.1, "en": en}


@pytest.mark.timeout(30)
def test_an_exception_reentered_in_the_same_processes() -> None:
    events = [entered(1.0, 0, 100, 1), entered(1.0, 1, 101, 1)]
    events += [step(1.0 + 0.1 * s, s, "100.1") for s in range(1, 11)]  # steps 1..10, the last at 2.0
    events.append(step(2.15, 11, "100.1"))  # rank 0's step finishing after the fault: not "stepping again"
    events += [entered(2.2, 0, 100, 2), entered(2.2, 1, 101, 2)]
    events.append({"e": "resumed", "t": 2.25, "a": 0, "step": 8, "seconds": 0.01, "en": "100.2"})
    events += [stepping(1.01, 0, "100.1"), stepping(1.02, 1, "101.1")]  # the ended entry's: not "again"
    events += [stepping(2.2, 0, "100.2"), stepping(2.25, 1, "101.2")]  # every rank stepping again at 2.25
    events += [step(2.3 + 0.1 * i, 9 + i, "100.2") for i in range(5)]
    r = analyze(events, [(2.1, "exception")], launched=0.0, until=10.0)
    (fault,) = r["faults"]
    assert fault["kind"] == "exception"
    assert fault["stepping"] == pytest.approx(0.15)  # the last rank's first step begins: 2.25 - 2.1
    assert fault["first_step_done"] == pytest.approx(0.2)  # rank 0's first step ends: 2.3 - 2.1, not 2.15 - 2.1
    assert fault["pids_kept"] is True  # both ranks: the same pids entered again
    assert r["redone_steps"] == 11 - 8
    assert r["progress"] == 13


@pytest.mark.timeout(30)
def test_a_whole_restart_changes_the_survivors_pid() -> None:
    events = [entered(1.0, 0, 100, 1), entered(1.0, 1, 101, 1), step(1.5, 1, "100.1"), step(1.6, 2, "100.1")]
    events += [entered(5.0, 0, 200, 1), entered(5.0, 1, 201, 1), stepping(5.4, 1, "201.1")]
    r = analyze([*events, step(5.5, 3, "200.1")], [(2.0, "SIGKILL")], launched=0.0, until=10.0)
    assert r["faults"][0]["stepping"] is None  # rank 0 not stepping yet: not every rank
    events += [stepping(5.35, 0, "200.1"), step(5.5, 3, "200.1")]
    r = analyze(events, [(2.0, "SIGKILL")], launched=0.0, until=10.0)
    (fault,) = r["faults"]
    assert fault["stepping"] == pytest.approx(3.4)
    assert fault["pids_kept"] is False  # rank 0, the survivor, is a new process


@pytest.mark.timeout(60)
def test_bad_input_is_one_line_and_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.goodput", "--only", "rally,nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "bench.goodput: unknown run 'nope'; the runs: "
        + ", ".join(
            ["ideal_torchrun", "ideal_rally", "rally_run", "rally_run_spare", "rally", "torchrun", "nvrx", "dlrover"]
        )
    ]


@pytest.mark.timeout(30)
def test_the_ended_entrys_first_step_logged_after_the_fault_is_not_stepping_again() -> None:
    """Rank 1 raises at its second step while rank 0 is still in the first step's all-reduce: rank
    0's step 1 is logged after the fault and belongs to the entry the fault ended."""
    events = [entered(1.0, 0, 100, 1), entered(1.0, 1, 101, 1), step(1.25, 1, "100.1")]
    events += [stepping(1.01, 0, "100.1"), stepping(1.02, 1, "101.1")]
    events += [entered(1.5, 0, 100, 2), entered(1.5, 1, 101, 2), stepping(1.55, 0, "100.2")]
    events += [stepping(1.6, 1, "101.2"), step(1.7, 1, "100.2")]
    r = analyze(events, [(1.2, "exception")], launched=0.0, until=10.0)
    assert r["faults"][0]["first_step_done"] == pytest.approx(0.5)
    assert r["faults"][0]["stepping"] == pytest.approx(0.4)


@pytest.mark.timeout(30)
def test_an_in_process_restart_is_broken_into_phases_that_add_up() -> None:
    """Each phase ends at the last rank's mark; a spare (no abort, no parking) counts from its enter."""
    from bench.goodput import REENTRY_PHASES, reentry_phases

    fault = 10.0
    agent = [{"event": "worker_exited", "time": 10.2}]
    survivor = {"abort": 10.25, "left": 10.21, "settled": 10.26, "closed": 10.26, "destroyed": 10.27,
                "collected": 10.28, "parked": 10.28, "enter": 10.32}  # fmt: skip
    worker = [entered(1.0, 0, 100, 1), entered(1.0, 1, 101, 1)]
    worker.append({**stepping(10.6, 0, "100.2"), "entered": 10.35, "called": 10.36, "loaded": 10.5,
                   "points": survivor})  # fmt: skip
    worker.append({**stepping(10.62, 1, "300.1"), "entered": 10.36, "called": 10.4, "loaded": 10.55,
                   "points": {"enter": 10.33}})  # fmt: skip
    (phases,) = reentry_phases(agent, worker, [(fault, "SIGKILL")])
    assert phases["detect"] == pytest.approx(0.2)
    assert phases["abort"] == pytest.approx(0.05)
    assert phases["leave"] == pytest.approx(0.0)  # left (a lost peer's error) before the abort: no time of its own
    assert phases["teardown"] == pytest.approx(0.03)
    assert phases["round"] == pytest.approx(0.05)  # to the spare's enter, the later of the two
    assert phases["init"] == pytest.approx(0.03)
    assert phases["load"] == pytest.approx(0.04)
    assert phases["copy"] == pytest.approx(0.15)
    assert phases["step"] == pytest.approx(0.07)
    assert phases["teardown: settle"] == pytest.approx(0.01)  # from the abort, not from its earlier leaving
    assert phases["teardown: gc"] == pytest.approx(0.01)
    assert sum(phases[k] for k in REENTRY_PHASES) == pytest.approx(phases["total"]) == pytest.approx(0.62)
