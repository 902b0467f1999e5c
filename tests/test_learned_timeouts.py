"""`--heartbeat-timeout auto`: the hang timeout is learned from the job's own heartbeats (and each
section's from its durations), catches a hang within the safety factor of what it learned, never
trips on a checkpoint section three times longer than the step timeout, and is kept in the store
so a restart does not learn again. Real rally runs, real heartbeat files, a real TCPStore."""

from __future__ import annotations

import re

import pytest

from rally.agent.observe.learned_timeouts import LearnedTimeouts, LearningSettings
from rally.agent.worker_side import heartbeat_file
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import Store, connect_tcp_store, host_tcp_store
from rally.rendezvous.status.job_notes import load_timeouts, save_timeouts
from support.agents import write_script
from support.helpers import read_events, run_rally

# 15 beats 0.1 s apart, then (first attempt) a hang; after the restart 3 beats, then a hang again.
BEATS_THEN_HANG = """
import os, time
from rally import job
beats = 15 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 3
for step in range(beats):
    time.sleep(0.1)
    job.heartbeat(step)
print("last beat", time.monotonic(), flush=True)
def hung_here():
    while True:
        time.sleep(0.05)
hung_here()
"""

# Steps of 0.1 s; twice a checkpoint section of 3 s, far longer than the learned step timeout.
CHECKPOINTS = """
import time
from rally import job
for step in range(40):
    time.sleep(0.1)
    job.heartbeat(step)
    if step in (20, 30):
        with job.section("checkpoint"):
            time.sleep(3.0)
print("trained", flush=True)
"""

AUTO = [
    "--heartbeat-timeout",
    "auto",
    "--timeout-samples",
    "10",
    "--timeout-safety-factor",
    "4",
    "--timeout-floor",
    "0",
]


@pytest.mark.timeout(120)
def test_a_hang_is_caught_within_the_safety_factor_of_the_learned_interval_and_a_restart_does_not_relearn(tmp_path):
    script = write_script(tmp_path, "w.py", BEATS_THEN_HANG)
    done = run_rally(
        ["--standalone", "--log-dir", str(tmp_path / "logs"), *AUTO, "--max-restarts", "1", str(script)],
        cwd=tmp_path,
        timeout=100,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    learned = re.findall(
        r"heartbeat timeout learned (\d+\.\d+) s: 4 x the longest of \d+ intervals \((\d+\.\d+) s\)", out
    )
    assert len(learned) == 1, out  # printed once; the restarted workers were not learned from again
    timeout, longest = float(learned[0][0]), float(learned[0][1])
    assert 0.1 <= longest <= 1.5 and timeout == pytest.approx(4 * longest, abs=0.06), out
    hangs = [e for e in read_events(tmp_path / "logs") if e["event"] == "worker_hung"]
    assert len(hangs) == 2, out  # the second after only 3 beats: the learned value held across the restart
    for hang in hangs:
        assert f"--heartbeat-timeout auto, learned {timeout:.2f} s" in hang["reason"], hang
        silent = float(re.search(r"sent no heartbeat for (\d+\.\d) s", hang["reason"]).group(1))
        # caught past the timeout, within one heartbeat read (a tenth of it, at most 1 s) and a loaded machine's slack
        assert timeout - 0.05 <= silent <= timeout * 1.1 + 1.5, (silent, timeout)  # (silent is rounded to 0.1 s)


@pytest.mark.timeout(120)
def test_a_checkpoint_section_three_times_longer_than_the_step_timeout_never_trips_it(tmp_path):
    script = write_script(tmp_path, "w.py", CHECKPOINTS)
    done = run_rally(
        ["--standalone", "--log-dir", str(tmp_path / "logs"), *AUTO, str(script)], cwd=tmp_path, timeout=100
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "trained" in out and "hung" not in out, out
    timeout = float(re.search(r"heartbeat timeout learned (\d+\.\d+) s", out).group(1))
    assert 3.0 >= 3 * timeout, out  # the checkpoint really was 3x longer than the step timeout
    section = float(
        re.search(r"timeout of section 'checkpoint' learned (\d+\.\d+) s: 4 x the longest of 1 completion", out).group(
            1
        )
    )
    assert section == pytest.approx(12.0, abs=1.0), out  # learned from the first checkpoint (3 s)
    assert {e["kind"] for e in read_events(tmp_path / "logs") if e["event"] == "timeout_learned"} == {
        "heartbeat",
        "section",
    }


@pytest.mark.timeout(30)
def test_the_worker_measures_the_longest_interval_and_section_itself(tmp_path):
    """Exactly, not from the agent's reads: a 0.3 s gap among 0.01 s ones, a section's running longest."""
    import time

    path = heartbeat_file.create(tmp_path / "hb")
    writer = heartbeat_file.HeartbeatWriter(path)
    for pause in (0.0, 0.01, 0.3, 0.01):
        time.sleep(pause)
        writer.beat()
    entered = time.monotonic_ns()
    writer.set_section("checkpoint", entered, 0)
    time.sleep(0.2)
    writer.set_section("", 0, 0)
    writer.section_done("checkpoint", entered)
    writer.beat()  # measured from the section's exit, not across the section
    record = heartbeat_file.read_record(path)
    assert record.intervals == 4 and 0.3 <= record.longest_interval_ns / 1e9 < 0.45
    assert (record.done_section, record.done_count) == ("checkpoint", 1) and 0.2 <= record.done_longest_ns / 1e9 < 0.35
    said: list[str] = []
    learner = LearnedTimeouts(LearningSettings(factor=3, samples=4, floor=0.5), said.append, lambda *a, **k: None)
    learner.observe(record)
    assert learner.heartbeat == pytest.approx(3 * record.longest_interval_ns / 1e9)
    assert learner.section_timeout("checkpoint/save") == pytest.approx(
        3 * record.done_longest_ns / 1e9
    )  # nested: the outer's
    floored = LearnedTimeouts(LearningSettings(factor=3, samples=4, floor=5), said.append, lambda *a, **k: None)
    floored.observe(record)
    assert floored.heartbeat == 5 and len(said) == 4
    unlearned = LearnedTimeouts(LearningSettings(factor=3, samples=5, floor=0), [].append, lambda *a, **k: None)
    unlearned.observe(record)
    assert unlearned.heartbeat is None  # 4 intervals of the 5 it waits for
    said[2:] = []
    assert len(said) == 2
    learner.observe(record)  # nothing new: nothing printed
    assert len(said) == 2


@pytest.mark.timeout(30)
def test_learned_timeouts_survive_in_the_store_merged_by_maximum():
    server = host_tcp_store(0, 10, loopback_only=True)

    def connect() -> Store:
        def reconnect():
            return connect_tcp_store("127.0.0.1", server.port, 5, 5)

        return Store(reconnect(), "rally/job/", "the test store", reconnect, Signer("t"))

    a, b = connect(), connect()
    save_timeouts(a, {"heartbeat": 2.0, "sections": {"checkpoint": 30.0}})
    save_timeouts(b, {"heartbeat": 1.0, "sections": {"eval": 9.0}})
    assert load_timeouts(a) == {"heartbeat": 2.0, "sections": {"checkpoint": 30.0, "eval": 9.0}}
    said: list[str] = []
    fresh = LearnedTimeouts(LearningSettings(), said.append, lambda *a, **k: None)
    fresh.merge(load_timeouts(b), "the store")
    assert fresh.heartbeat == 2.0 and fresh.section_timeout("eval") == 9.0
    assert said and "not learning them again" in said[0]
    a.set("timeouts-garbage", "x")  # a foreign value elsewhere changes nothing
    b.raw.set("rally/job/job/timeouts", b"not signed")
    assert load_timeouts(a) is None  # an unsigned value reads as nothing, never as a timeout
