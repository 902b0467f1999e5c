"""Fault matrix: every step after the workers' exit is bounded and says what it waits for ("a job that never ended").

    the store frozen as the workers finish        -> one line naming the store, exit 1, within read_timeout
    the checkpoint holder SIGSTOPped (no --checkpoint-dir)
                                                  -> the job ends 0 within seconds: nothing was to be
                                                     made durable, so no flush is waited for
    the checkpoint holder SIGSTOPped (--checkpoint-dir, a step saved)
                                                  -> one line naming the holder and the step that did not
                                                     reach the disk, exit 1, within the holder's bounds
    the orphan guard or the template SIGSTOPped   -> the job ends 0, within their stop bounds

and a short soak (`test_short_jobs_end_beside_attacked_neighbours`): short jobs beside jobs whose
helpers are SIGSTOPped, SIGKILLed and starved; a job that is late gets its agent's stacks dumped
(the agent's own faulthandler on rally's stack signal) into the failure. bench/never_ended.py is
the longer soak.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import Store, connect_tcp_store
from rally.rendezvous.protocol import NodeInfo, RendezvousSettings, RoundChannel
from support.helpers import (
    ProcessTracker,
    Result,
    clean_env,
    over_and_over,
    procs,  # noqa: F401 - a fixture
    write_probe,
)
from support.live_rally import LiveRally
from support.never_ended import HELPERS, run_jobs_beside_attacks, run_or_dump_stacks


def _store_port(store: LiveRally) -> int:
    store.wait_line("listening on port", 60)
    line = next(line for _, line in store.lines if "listening on port" in line)
    return int(line.split("port")[1].split()[0].strip(";,."))


@pytest.fixture
def stuttering_store(tmp_path: Path, procs: ProcessTracker) -> Iterator[int]:
    """A `rally store` that is stopped 60 ms out of every 61 (SIGSTOP, SIGCONT): a store whose answers
    come late, as an agent's own store does on a loaded machine (tests/test_job_end_bounded.py's
    a CI run where a finished job never ended). Yields its port."""
    store = LiveRally(["store", "--port", "0"], tmp_path, clean_env(), procs)
    port = _store_port(store)
    stutter = [
        (lambda: store.proc.send_signal(signal.SIGSTOP), 0.06),
        (lambda: store.proc.send_signal(signal.SIGCONT), 0.001),
    ]
    try:
        with over_and_over(stutter):  # 60 ms stopped, 1 ms running
            yield port
    finally:
        store.proc.send_signal(signal.SIGCONT)


ROUNDS = 30


@pytest.mark.timeout(120)
def test_the_last_success_record_ends_the_round_however_late_the_store_answers(stuttering_store: int) -> None:
    """The CI run's job that never ended: the last node to report success checked the others'
    records with a 10 ms store wait; a late answer (a loaded machine) read as "not all reported",
    so nobody ended the round and the agent waited for ever with its workers done. A single
    node is always the last: each of these rounds must end."""

    def reconnect():  # noqa: ANN202 - torch's TCPStore
        return connect_tcp_store("127.0.0.1", stuttering_store, 30, 30)

    store = Store(reconnect(), "rally/late-answers/", "the test store", reconnect, Signer("t"))
    settings = RendezvousSettings(min_nodes=1, max_nodes=1)
    me = NodeInfo(node_id="a:id", host="a", addr="127.0.0.1", nproc=2)
    missed = []
    for r in range(ROUNDS):
        end = RoundChannel(store, settings, me, r, 1, 0).report_success()
        if end is None:
            missed.append(r)
    assert not missed, f"rounds {missed} of {ROUNDS} were left without an end after their only node reported success"


STOP_STORE_AND_FINISH = """
    import os, signal
    if os.environ["RANK"] == "0":
        os.kill(int(os.environ["STORE_PID"]), signal.SIGSTOP)
    print("done", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_store_frozen_as_the_workers_finish_ends_the_job_with_one_line(tmp_path: Path, procs: ProcessTracker) -> None:
    """The workers' last act freezes the store: every store call after their exit (the success
    record, the acknowledgement, the job's close) is bounded by the store probe. Before: the
    success record's `set` blocked the main thread in torch's client for ever."""
    store = LiveRally(["store", "--port", "0"], tmp_path, clean_env(), procs)
    port = _store_port(store)
    write_probe(tmp_path / "probe.py", STOP_STORE_AND_FINISH)
    conf = "read_timeout=3,join_timeout=60,keep_alive_interval=0.5,keep_alive_timeout=3,is_host=false"
    args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "frozen-at-end", "--local-addr", "127.0.0.1", "--rdzv-conf", conf,
            "--nproc-per-node", "2", "probe.py"]  # fmt: skip
    try:
        result = run_or_dump_stacks(args, tmp_path, clean_env(STORE_PID=str(store.proc.pid)), 40)
    finally:
        store.proc.send_signal(signal.SIGCONT)
    assert result.returncode == 1, result.describe()
    assert "has not answered" in result.stderr or "frozen" in result.stderr, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert result.elapsed < 3 + 30, result.describe()  # read_timeout, plus start-up on a loaded machine
    print(f"MEASURED store frozen as the workers finish (read_timeout 3 s): exit 1 after {result.elapsed:.1f} s")


STOP_HOLDER_AND_FINISH = """
    import os, signal
    {save}
    if os.environ["RANK"] == "0":
        os.kill(int(os.environ["RALLY_CKPT_HOLDER_PID"]), signal.SIGSTOP)
    print("done", flush=True)
"""
# 64 MB: the holder is stopped while it still persists (or just before), once the agent heard of the save.
SAVE_A_STEP = """import glob, time, torch; from rally import job
    job.save({'w': torch.zeros(1 << 24)}, 7)
    while not any('checkpoint_saved' in open(f).read() for f in glob.glob('logs/*/events.jsonl')):
        time.sleep(0.01)"""


def _standalone(tmp_path: Path, body: str, *flags: str, timeout: float = 45) -> Result:
    write_probe(tmp_path / "probe.py", body)
    args = ["--standalone", "--nproc-per-node", "2", *flags, "probe.py"]
    return run_or_dump_stacks(args, tmp_path, clean_env(), timeout)


@pytest.mark.timeout(120)
def test_a_stopped_checkpoint_holder_without_a_checkpoint_dir_does_not_hold_the_job(tmp_path: Path) -> None:
    """Nothing was to be made durable, so the job's end asks no flush of a holder that cannot
    answer. Before: the round's close waited 10 s for it, the flush --shutdown-timeout + 1 s, its
    stop 5 s more (about 46 s of a finished job)."""
    result = _standalone(tmp_path, STOP_HOLDER_AND_FINISH.format(save=""))
    assert result.returncode == 0, result.describe()
    assert "did not answer" in result.stderr and "stopped (SIGSTOP)" in result.stderr, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert result.elapsed < 40, result.describe()  # start-up on a loaded machine; the end itself takes seconds
    print(f"MEASURED finished job with its holder SIGSTOPped (no checkpoint dir): exit 0 after {result.elapsed:.1f} s")


@pytest.mark.timeout(120)
def test_a_stopped_checkpoint_holder_is_one_line_naming_the_step_that_never_reached_the_disk(tmp_path: Path) -> None:
    """Before: the agent waited ~46 s for the stopped holder, killed it, and exited 0 with step 7 in
    memory only (silently lost). Now: one line naming the step, exit 1, without waiting for it."""
    ck = tmp_path / "ck"
    flags = ("--checkpoint-dir", str(ck), "--log-dir", "logs")
    result = _standalone(tmp_path, STOP_HOLDER_AND_FINISH.format(save=SAVE_A_STEP), *flags)
    if result.returncode == 0:  # only if the holder wrote it before it was stopped
        assert list(ck.glob("step_7*")), f"exit 0 with step 7 in memory only\n{result.describe()}"
    else:
        assert result.returncode == 1, result.describe()
        assert "checkpoint step 7 never reached" in result.stderr, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert result.elapsed < 40, result.describe()


STOP_HELPERS_AND_FINISH = """
    import os, signal, psutil
    if os.environ["RANK"] == "0":
        agent = next(p for p in psutil.Process().parents() if "-m rally" in " ".join(p.cmdline()))
        stopped = set()
        for proc in agent.children():
            for needle in {needles!r}:
                if needle in " ".join(proc.cmdline()):
                    os.kill(proc.pid, signal.SIGSTOP)
                    stopped.add(needle)
        assert stopped == set({needles!r}), stopped
    print("done", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_stopped_guard_and_template_do_not_hold_the_job(tmp_path: Path) -> None:
    """The orphan guard and the worker template SIGSTOPped while the workers run: the job still
    ends 0, within their stop bounds, saying what it killed. (The two were a job each, a
    parametrization of one test: each helper's stop is bounded on its own, so one job stopping
    both shows both bounds, and their sum is still within the bound below.)"""
    body = STOP_HELPERS_AND_FINISH.format(needles=[HELPERS["guard"], HELPERS["template"]])
    result = _standalone(tmp_path, body)
    assert result.returncode == 0, result.describe()
    assert "the orphan guard" in result.stderr and "did not stop within" in result.stderr, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert result.elapsed < 40, result.describe()


@pytest.mark.timeout(150)
def test_short_jobs_end_beside_attacked_neighbours(tmp_path: Path) -> None:
    """The soak, bounded: for 20 s, short jobs beside jobs whose holder, guard or template is
    SIGSTOPped, SIGKILLed or starved. Every job ends within 25 s of its workers' exit, short ones
    with exit 0; a late one's agent stacks are in the failure. (bench/never_ended.py runs it longer.)"""
    jobs = run_jobs_beside_attacks(tmp_path, seconds=20, late=25, short_loops=1, attacked_loops=1)
    late = [job for job in jobs if job.late]
    assert not late, "\n\n".join(job.describe() for job in late)
    failed = [job for job in jobs if job.name.startswith("short") and job.returncode != 0]
    assert not failed, "\n\n".join(job.describe() for job in failed)
    assert len(jobs) >= 2, [job.name for job in jobs]
    print(f"MEASURED soak: {len(jobs)} jobs, longest {max(job.elapsed for job in jobs):.1f} s")
