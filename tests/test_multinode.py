"""Several agents on 127.0.0.1 form one job through a c10d store, restart together, and re-form
when nodes leave or join. Workers are plain Python probes (no torch) that record their
environment, so these tests stay cheap."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from support.agents import AgentProcess, c10d_args, start_agent, stop_all, write_script
from support.helpers import eventually, free_port, is_alive, read_events

PROBE = """
import json, os, sys, time
record = {k: os.environ.get(k) for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "RALLY_ROUND", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
record["pid"] = os.getpid()
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(json.dumps(record) + "\\n")
mode, arg = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
rank, restart = int(record["RANK"]), int(record["TORCHELASTIC_RESTART_COUNT"])
if mode == "fail-rank-once" and rank == arg and restart == 0:
    deadline = time.time() + 30  # fail only once every worker of this round wrote its record
    while time.time() < deadline:
        with open(os.environ["PROBE_OUT"]) as f:
            mine = [json.loads(line) for line in f if line.strip()]
        if sum(r["RALLY_ROUND"] == record["RALLY_ROUND"] for r in mine) >= int(record["WORLD_SIZE"]):
            break
        time.sleep(0.02)
    sys.exit(3)
if mode == "until-world":          # run until the job has re-formed to `arg` workers
    while int(record["WORLD_SIZE"]) != arg:
        time.sleep(0.05)
if mode == "forever":
    while True:
        time.sleep(0.05)
"""


@pytest.fixture
def job(tmp_path: Path):
    """Start agents for one job; every process is killed at the end of the test."""
    started: list[AgentProcess] = []
    probe = write_script(tmp_path, "probe.py", PROBE)
    out = tmp_path / "records.jsonl"

    class Job:
        port = free_port()
        records_path = out

        def start(self, name: str, args: list[str], probe_args: list[str]) -> AgentProcess:
            agent = start_agent(name, tmp_path, [*args, str(probe), *probe_args], env={"PROBE_OUT": str(out)})
            started.append(agent)
            return agent

        def records(self) -> list[dict]:
            if not out.exists():
                return []
            return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]

    yield Job()
    stop_all(started)


def _finish(agents: list[AgentProcess], timeout: float = 60) -> list[int]:
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout))
        except Exception:
            raise AssertionError(f"{agent.name} did not finish:\n{agent.output()}") from None
    return codes


@pytest.mark.timeout(120)
def test_static_rendezvous_uses_the_given_node_ranks(job):
    port = job.port
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "static",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    agents = [job.start(f"n{rank}", [*common, "--node-rank", str(rank)], ["ok"]) for rank in (1, 0)]
    assert _finish(agents) == [0, 0], "\n".join(a.output() for a in agents)
    records = job.records()
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2, 3]
    assert {r["GROUP_RANK"] for r in records if int(r["RANK"]) >= 2} == {"1"}


def _node_major(records: list[dict]) -> None:
    """Three nodes of two workers each formed one job: node-major ranks, one store (MASTER_*)."""
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2, 3, 4, 5], records
    for r in records:
        assert r["WORLD_SIZE"] == "6" and r["GROUP_WORLD_SIZE"] == "3" and r["LOCAL_WORLD_SIZE"] == "2", r
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * 2 + int(r["LOCAL_RANK"]), r
    assert sorted(int(r["GROUP_RANK"]) for r in records) == [0, 0, 1, 1, 2, 2], records
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}) == 1, records


# Three agents forming one job with node-major ranks was a test of its own (three agents, six
# workers, all exiting 0); this job's two rounds show it, each of them (_node_major), so it is
# checked here, on the job the parity pass (.ci/run) runs too. (Two agents and three agents were
# two tests before that: three agents of two workers each show both, ranks over more than two nodes.)
@pytest.mark.timeout(120)
def test_worker_failure_on_one_node_restarts_every_node_with_one_restart_count(job):
    args = [*c10d_args(job.port, "3"), "--nproc-per-node", "2", "--max-restarts", "2"]
    agents = [job.start(f"n{i}", args, ["fail-rank-once", "3"]) for i in range(3)]
    codes = _finish(agents)
    assert codes == [0, 0, 0], "\n".join(a.output() for a in agents)
    records = job.records()
    assert len(records) == 12  # 6 workers, twice
    assert sorted(r["TORCHELASTIC_RESTART_COUNT"] for r in records) == ["0"] * 6 + ["1"] * 6
    for restart in ("0", "1"):
        _node_major([r for r in records if r["TORCHELASTIC_RESTART_COUNT"] == restart])
    for agent in agents:
        text = agent.output()
        assert "root cause: rank 3" in text and "exit code 3" in text
        assert "restart 1/2" in text


@pytest.mark.timeout(120)
def test_max_restarts_exhausted_fails_every_node_with_the_root_cause(job):
    args = [*c10d_args(job.port, "2"), "--nproc-per-node", "1", "--max-restarts", "0"]
    agents = [job.start(f"n{i}", args, ["fail-rank-once", "1"]) for i in range(2)]
    codes = _finish(agents)
    assert codes == [3, 3]
    for agent in agents:
        assert "no restarts left" in agent.output() and "root cause: rank 1" in agent.output()


def _store_host(agents: list[AgentProcess]) -> AgentProcess:
    assert eventually(lambda: any("hosting the rendezvous store" in a.output() for a in agents), 30)
    return next(a for a in agents if "hosting the rendezvous store" in a.output())


@pytest.mark.timeout(120)
def test_dead_node_is_dropped_and_survivors_continue_without_spending_a_restart(job, tmp_path):
    args = [*c10d_args(job.port, "2:3"), "--nproc-per-node", "1"]
    logs = {f"n{i}": tmp_path / f"logs{i}" for i in range(3)}
    agents = [job.start(name, [*args, "--log-dir", str(log)], ["until-world", "2"]) for name, log in logs.items()]
    assert eventually(lambda: len(job.records()) == 3, 60), [a.output() for a in agents]
    victim = next(a for a in agents if a is not _store_host(agents))
    victim_pids = victim.kill_node()
    survivors = [a for a in agents if a is not victim]
    codes = _finish(survivors, timeout=30)
    assert codes == [0, 0], "\n".join(a.output() for a in survivors)
    assert not any(is_alive(pid) for pid in victim_pids)
    second = [r for r in job.records() if r["WORLD_SIZE"] == "2"]
    assert len(second) == 2 and {r["TORCHELASTIC_RESTART_COUNT"] for r in second} == {"0"}
    assert all("sent no keep-alive" in a.output() for a in survivors)
    # Every worker's end is in events.jsonl: round 0's never noticed the dead node (no collective),
    # so the agent stopped it, and says so and why; round 1's exited by itself.
    for survivor in survivors:
        events = read_events(logs[survivor.name])
        started = {e["pid"] for e in events if e["event"] == "worker_started"}
        ended = {e["pid"] for e in events if e["event"] in ("worker_exited", "worker_stopped")}
        assert len(started) == 2 and started == ended, events
        stopped = [e for e in events if e["event"] == "worker_stopped"]
        assert [e["round"] for e in stopped] == [0] and "was lost" in stopped[0]["reason"], events
        assert stopped[0]["exit"].startswith("SIG"), stopped  # SIGTERM (or SIGKILL after the grace)


# An elastic range forming with fewer than its max after the last call was a test of its own (two
# agents of 1:3, each run to its end); this job's first round is exactly that (two of 2:3), checked
# before the third node comes.
@pytest.mark.timeout(120)
def test_new_node_joins_a_running_job_below_max(job):
    args = [*c10d_args(job.port, "2:3"), "--nproc-per-node", "1"]
    first = [job.start(f"n{i}", args, ["until-world", "3"]) for i in range(2)]
    assert eventually(lambda: len(job.records()) == 2, 60)
    assert {r["WORLD_SIZE"] for r in job.records()} == {"2"}, job.records()  # formed below max after the last call
    joiner = job.start("joiner", args, ["until-world", "3"])
    codes = _finish([*first, joiner])
    assert codes == [0, 0, 0], "\n".join(a.output() for a in [*first, joiner])
    assert sorted(int(r["RANK"]) for r in job.records() if r["WORLD_SIZE"] == "3") == [0, 1, 2]


@pytest.mark.timeout(120)
def test_node_beyond_max_waits_as_a_spare_and_replaces_a_lost_node(job):
    # A long last call: round 0 is the two nodes, never one of them alone (a busy machine can start
    # the second more than the default 1 s later), so the spare's round is round 1.
    args = [*c10d_args(job.port, "1:2", extra_conf="last_call_timeout=30"), "--nproc-per-node", "1"]
    agents = [job.start(f"n{i}", args, ["forever"]) for i in range(2)]
    assert eventually(lambda: sum(r["WORLD_SIZE"] == "2" for r in job.records()) == 2, 60)
    before = len(job.records())
    spare = job.start("spare", args, ["forever"])
    # its first line as a spare (the progress line "waiting as a spare" comes only 5 s later)
    assert eventually(lambda: "this node waits as its spare" in spare.output(), 30), spare.output()
    assert len(job.records()) == before  # the spare started no workers
    victim = next(a for a in agents if a is not _store_host(agents))
    victim.kill_node()
    joined = re.compile(r"round \d+: node \d of 2")
    assert eventually(lambda: joined.search(spare.output()), 30), "\n".join(a.output() for a in [*agents, spare])
    assert eventually(lambda: len(job.records()) == before + 2, 30)
    assert {r["WORLD_SIZE"] for r in job.records()[before:]} == {"2"}


@pytest.mark.timeout(120)
def test_standalone_store_survives_the_loss_of_any_compute_node(job, tmp_path):
    store_port = free_port()
    store = start_agent("store", tmp_path, ["store", "--port", str(store_port)])
    try:
        assert eventually(lambda: "listening" in store.output(), 30), store.output()
        args = [*c10d_args(store_port, "1:2"), "--nproc-per-node", "1"]
        agents = [job.start(f"n{i}", args, ["until-world", "1"]) for i in range(2)]
        assert eventually(lambda: len(job.records()) == 2, 60)
        agents[0].kill_node()  # with `rally store`, no compute node is special
        assert _finish([agents[1]], timeout=30) == [0]
        agents[1].kill_node()
    finally:
        store.popen.send_signal(signal.SIGTERM)
        store.wait(10)


@pytest.mark.timeout(120)
def test_losing_the_store_host_stops_the_others_with_a_clear_message(job):
    args = [*c10d_args(job.port, "1:2"), "--nproc-per-node", "1"]
    agents = [job.start(f"n{i}", args, ["forever"]) for i in range(2)]
    assert eventually(lambda: len(job.records()) == 2, 60)
    host = _store_host(agents)
    host.kill_node()
    other = next(a for a in agents if a is not host)
    code = other.wait(30)
    assert code != 0
    text = other.output()
    assert f"127.0.0.1:{job.port} is gone" in text and "rally store" in text
