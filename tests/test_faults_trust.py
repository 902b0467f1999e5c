"""Nothing outside the job steers it (the store's side): a stranger who can reach the
rendezvous store's port bumps, decrements and deletes keys; two unrelated jobs share a port; an
agent is frozen; the token comes in every documented way. Real agents, a real `rally store`, a
real stranger (a TCPStore client without the job's token).

README's "Fault matrix" and "Job token: what a stranger can do" list what these tests prove.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from support.agents import cluster, job_args, write_script  # noqa: F401 - cluster is a fixture
from support.helpers import eventually, run_rally
from test_faults_membership import PLAIN_WORKER

TOKEN = "the-job-secret"

# Records RANK and GROUP_RANK once, then sleeps; RANK 1 sleeps SLOW_RANK_SECONDS and leaves a marker.
RANKS_WORKER = """
import json, os, time
out = os.environ["PROBE_OUT"]
with open(out, "a") as f:
    f.write(json.dumps({"t": time.time(), "node": os.environ["PROBE_NODE"], "rank": int(os.environ["RANK"]),
                        "group_rank": int(os.environ["GROUP_RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                        "round": int(os.environ["RALLY_ROUND"])}) + "\\n")
if os.environ["RANK"] == "1":
    time.sleep(float(os.environ.get("SLOW_RANK_SECONDS", "0")))
    open(os.environ["PROBE_OUT"] + ".rank1-done", "w").close()
else:
    time.sleep(float(os.environ.get("OTHER_RANK_SECONDS", "0")))
release = os.environ.get("RELEASE_FILE")  # wait (at most 90 s) until the test says so
deadline = time.time() + 90
while release and not os.path.exists(release) and time.time() < deadline:
    time.sleep(0.05)
"""

FAILING_WORKER = """
import json, os, time
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(json.dumps({"t": time.time(), "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                        "round": int(os.environ["RALLY_ROUND"])}) + "\\n")
time.sleep(float(os.environ.get("FAIL_AFTER", "0.3")))
raise SystemExit(1)
"""


def stranger(port: int):
    """A client of the store without any token: it can do what any TCPStore client can."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # as the agent: no 5 s reverse lookup
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "rally: error" in line]


# ------------------------------------------------------------------ 1. faked success
# Same under load: the job's end is decided by signed records, never the counter the stranger bumps;
# where the token is read from, and what it signs.
# The job's token comes in both documented ways of --rdzv-conf, token= on one node and token_file=
# on the other (7. below): that was a job of its own (two more agents and a store), checked here
# on this one's records.
@pytest.mark.same_under_load
@pytest.mark.timeout(180)
def test_a_strangers_success_counter_ends_nothing(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    secret = tmp_path / "secret.txt"
    secret.write_text(TOKEN + "\n")
    env = {"SLOW_RANK_SECONDS": "5", "OTHER_RANK_SECONDS": "1"}
    client = stranger(store.port)  # connected first: a client's connect can take seconds (DNS)
    agents = [
        cluster.agent(f"n{i}", [*job_args(store.port, "2", extra=conf), str(script)], env=env)
        for i, conf in enumerate((f"token={TOKEN}", f"token_file={secret}"))
    ]
    assert eventually(lambda: len(cluster.records()) == 2, 90), "\n".join(a.output() for a in agents)
    client.add("rally/testjob/0/succeeded", 1)  # before rank 0 ends: its node's report made it 2 of 2
    faked_at = time.monotonic()
    time.sleep(3)  # rank 0 has ended (after 1 s): its node's report and the stranger's make 2 of 2
    assert all(a.popen.poll() is None for a in agents), "\n".join(a.output() for a in agents)
    codes = [a.wait(60) for a in agents]
    done = Path(str(cluster.out) + ".rank1-done")
    assert codes == [0, 0] and done.exists(), "\n".join(a.output() for a in agents)
    assert time.monotonic() - faked_at > 3, "the job ended before rank 1 finished"
    for agent in agents:
        assert "job succeeded: 2 workers on 2 nodes finished" in agent.output(), agent.output()
    _the_job_signed_with(store.port, TOKEN)


def _the_job_signed_with(port: int, token: str) -> None:
    """What the job wrote verifies with `token`, not with another one: the token was really in use."""
    from rally.rendezvous.base.token import Signer
    from rally.rendezvous.c10d.store import Store, UntrustedValue, connect_tcp_store

    def reconnect():
        return connect_tcp_store("127.0.0.1", port, 5, 5)

    assert Store(reconnect(), "rally/testjob/", "the store", reconnect, Signer(token)).get("0/closed")
    with pytest.raises(UntrustedValue, match="different job token"):
        Store(reconnect(), "rally/testjob/", "the store", reconnect, Signer("other")).get("0/closed")


# ------------------------------------------------------------------ 2. duplicate ranks
# Same under load: the counter is moved at a fixed point; ranks come from the claimed slots, not timing.
@pytest.mark.same_under_load
@pytest.mark.timeout(180)
def test_a_decremented_arrival_counter_never_gives_two_nodes_one_rank(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    args = [*job_args(store.port, "1:2", extra="last_call_timeout=60,join_timeout=120"), str(script)]  # both in round 0
    env = {"RALLY_JOB_TOKEN": TOKEN, "SLOW_RANK_SECONDS": "3", "OTHER_RANK_SECONDS": "3"}
    client = stranger(store.port)
    first = cluster.agent("n0", args, env=env)
    assert eventually(lambda: client.add("rally/testjob/0/joined", 0) == 1, 60), first.output()
    assert client.add("rally/testjob/0/joined", -1) == 0  # the next node would get index 0 again
    second = cluster.agent("n1", args, env=env)
    codes = [first.wait(90), second.wait(90)]
    text = first.output() + second.output()
    assert codes == [0, 0], text
    round0 = [r for r in cluster.records() if r["round"] == 0]
    assert sorted(r["rank"] for r in round0) == [0, 1] and {r["world"] for r in round0} == {2}, round0
    assert sorted(r["group_rank"] for r in round0) == [0, 1], round0
    assert "node 0 of 2" in text and "node 1 of 2" in text, text


# ------------------------------------------------------------------ 3. restart budget reset
@pytest.mark.timeout(180)
def test_deleting_a_rounds_record_is_tampering_not_a_fresh_restart_budget(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "fail.py", FAILING_WORKER)
    # The stranger deletes a round's record 0.3 s after it appears, and only a deletion before the
    # agent reads it again (the round's end) is seen: its client is made and its thread started before
    # the agent, and each worker lives 2 s. Started after the agent, with workers of 0.3 s, a busy CPU
    # (.ci/run's CPU-hog pass) once had it miss round 0's record: the agent formed round 1 first.
    client = stranger(store.port)
    stop = threading.Event()
    deleted: list[str] = []

    def delete_closed_records() -> None:
        for r in range(10):
            key = f"rally/testjob/{r}/closed"
            while not stop.is_set() and not client.check([key]):
                time.sleep(0.01)
            if stop.is_set():
                return
            time.sleep(0.3)
            client.delete_key(key)
            deleted.append(key)

    deleter = threading.Thread(target=delete_closed_records, daemon=True)
    deleter.start()
    try:
        agent = cluster.agent(
            "n0",
            [*job_args(store.port, "1"), "--max-restarts", "2", str(script)],
            env={"RALLY_JOB_TOKEN": TOKEN, "FAIL_AFTER": "2"},
        )
        code = agent.wait(90)
    finally:
        stop.set()
        deleter.join(15)
    text = agent.output()
    starts = cluster.records()
    assert code == 1, text
    assert len(starts) <= 3 and [r["restart"] for r in starts] == list(range(len(starts))), starts
    tampering = [line for line in error_lines(text) if "tampering" in line]  # besides the worker's root cause
    assert len(tampering) == 1 and "'rally/testjob/0/closed' is missing" in tampering[0], text
    assert "Traceback" not in text and deleted, deleted


# ------------------------------------------------------------------ 7. the documented token flags
# token= and token_file= in --rdzv-conf, on one job's two nodes, which agree: checked on the job of
# 1. above (test_a_strangers_success_counter_ends_nothing).


# ------------------------------------------------------------------ 9. waits are bounded and say what they wait for
# Same under load: the counter is moved before the agent starts; the slots decide, not timing.
@pytest.mark.same_under_load
@pytest.mark.timeout(180)
def test_an_arrival_counter_pushed_past_max_makes_no_node_a_spare(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    stranger(store.port).add("rally/testjob/0/joined", 7)  # as if 7 nodes had died between add and claim
    agent = cluster.agent(
        "n0", [*job_args(store.port, "1", extra="join_timeout=5"), str(script)], env={"RALLY_JOB_TOKEN": TOKEN}
    )
    assert agent.wait(60) == 0, agent.output()
    assert [r["world"] for r in cluster.records()] == [1]


# Same under load: the spare waits for a slot that never comes; join_timeout is a clock deadline.
@pytest.mark.same_under_load
@pytest.mark.timeout(180)
def test_a_spare_of_a_full_job_gives_up_at_join_timeout_saying_what_it_waited_for(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    env = {"RALLY_JOB_TOKEN": TOKEN, "OTHER_RANK_SECONDS": "60"}
    member = cluster.agent("member", [*job_args(store.port, "1", extra="join_timeout=8"), str(script)], env=env)
    assert eventually(lambda: cluster.records(), 60), member.output()
    began = time.monotonic()
    spare = cluster.agent("spare", [*job_args(store.port, "1", extra="join_timeout=8"), str(script)], env=env)
    code = spare.wait(60)
    took = time.monotonic() - began
    text = spare.output()
    assert code == 2 and took < 8 + 15, (took, text)
    assert re.search(r"waiting as a spare: round 0 runs with 1 of at most 1 nodes; .*join_timeout in \d+ s", text), text
    lines = error_lines(text)
    assert len(lines) == 1 and "as its spare" in lines[0] and "--rdzv-id" in lines[0], text
    assert member.popen.poll() is None and len(cluster.records()) == 1


# Same under load: no other node ever comes; the line's interval and join_timeout are clock deadlines.
@pytest.mark.same_under_load
@pytest.mark.timeout(180)
def test_a_node_waiting_for_others_says_so_on_the_console_and_in_rally_status(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    agent = cluster.agent("n0", [*job_args(store.port, "2", extra="join_timeout=10"), str(script)])
    line = re.compile(r"waiting for 1 more node: 1 of 2 joined \(\S+\); join_timeout in (\d+) s")
    found = eventually(lambda: line.search(agent.output()), 30)
    assert found and int(found.group(1)) <= 10, agent.output()
    status = run_rally(
        ["status", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "testjob"], cwd=tmp_path, timeout=60
    )
    assert status.returncode == 0 and line.search(status.stdout), status.describe()
    assert agent.wait(40) == 2, agent.output()
    assert "did not form" in agent.output()


# ------------------------------------------------------------------ 11. two unrelated jobs, one port
@pytest.mark.timeout(180)
def test_two_jobs_on_one_store_with_the_default_run_id_get_one_line_naming_the_clash(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    defaults = [
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{store.port}",
        "--nproc-per-node",
        "1",
    ]
    release = tmp_path / "release"
    first = cluster.agent("job1", [*defaults, str(script)], env={"RELEASE_FILE": str(release)})
    assert eventually(lambda: cluster.records(), 60), first.output()
    second = cluster.agent("job2", [*defaults, str(script)])
    clash = eventually(lambda: re.search(r"run id 'none' at .* is in use by a running job.*", second.output()), 60)
    release.touch()  # job 1 may end now
    assert clash, second.output()
    assert f"(pid {first.popen.pid})" in clash.group(0) and "--rdzv-id" in clash.group(0), clash.group(0)
    assert first.wait(60) == 0, first.output()
    assert second.wait(60) == 2, second.output()
    lines = error_lines(second.output())
    assert len(lines) == 1 and "run id 'none'" in lines[0] and "already ended (succeeded" in lines[0], second.output()
    assert "this node ran nothing" in lines[0] and "--rdzv-id" in lines[0], lines
    assert [r["node"] for r in cluster.records()] == ["job1"]


# ------------------------------------------------------------------ 12. a frozen agent
@pytest.mark.timeout(180)
def test_a_frozen_agent_says_it_was_left_behind_not_that_the_store_froze(cluster, tmp_path):
    store = cluster.store()
    script = write_script(tmp_path, "plain.py", PLAIN_WORKER)
    args = [*job_args(store.port, "1:2"), str(script)]
    agents = [cluster.agent(f"n{i}", args, env={"RALLY_JOB_TOKEN": TOKEN}) for i in range(2)]
    assert eventually(lambda: {r["node"] for r in cluster.records() if r["world"] == 2} == {"n0", "n1"}, 90), "\n".join(
        a.output() for a in agents
    )
    frozen, survivor = agents
    os.kill(frozen.popen.pid, signal.SIGSTOP)  # the agent only; its worker runs on
    stopped_at = time.time()
    try:
        assert eventually(
            lambda: [r for r in cluster.records() if r["node"] == "n1" and r["world"] == 1 and r["t"] > stopped_at],
            30,
        ), survivor.output()
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    code = frozen.wait(30)
    text = frozen.output()
    assert code == 1 and "left behind" in text and "store is frozen" not in text and "Traceback" not in text, text
    assert survivor.popen.poll() is None, survivor.output()


# ------------------------------------------------------------------ 13. bad input residue of the token
# Same under load: bad input, rejected before anything starts.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_an_empty_job_token_variable_is_one_line_not_no_token(tmp_path):
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    from support.helpers import clean_env

    result = run_rally(
        ["--standalone", "--nproc-per-node", "1", str(script)],
        cwd=tmp_path,
        env=clean_env(RALLY_JOB_TOKEN=""),
        timeout=60,
    )
    assert result.returncode == 2, result.describe()
    lines = [line for line in result.stderr_lines if line.strip()]
    assert len(lines) == 1 and "RALLY_JOB_TOKEN is set but empty" in lines[0], result.describe()
    status = run_rally(
        ["status", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x"],
        cwd=tmp_path,
        env=clean_env(RALLY_JOB_TOKEN=""),
        timeout=60,
    )
    assert status.returncode == 2 and "RALLY_JOB_TOKEN is set but empty" in status.stderr, status.describe()


# ------------------------------------------------------------------ in-process: replays and node binding
@pytest.fixture
def server():
    from rally.rendezvous.c10d.store import host_tcp_store

    store = host_tcp_store(0, 10, loopback_only=True)
    yield store
    del store


def _node(server, name: str, settings, token: str = TOKEN):
    from rally.rendezvous.base.token import Signer
    from rally.rendezvous.c10d.store import Store, connect_tcp_store
    from rally.rendezvous.protocol import NodeInfo, Rendezvous

    def reconnect():
        return connect_tcp_store("127.0.0.1", server.port, 5, 5)

    me = NodeInfo(node_id=f"{name}:id", host=name, addr=f"{name}.addr", nproc=1)
    return Rendezvous(Store(reconnect(), "rally/job/", "the test store", reconnect, Signer(token)), settings, me)


FAST = dict(
    min_nodes=1,
    max_nodes=1,
    join_timeout=5,
    last_call_timeout=0.3,
    keep_alive_interval=0.05,
    keep_alive_timeout=0.5,
    close_timeout=1.5,
)


# Same under load: in-process, the test copies the record between two calls; a signature check.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_record_replayed_from_an_earlier_round_is_named_as_such(server):
    from rally.rendezvous.c10d.store import UntrustedValue
    from rally.rendezvous.protocol import RendezvousSettings, RoundEnd

    a = _node(server, "a", RendezvousSettings(**FAST))
    a.join_round().channel.end(RoundEnd("worker_failed", "x", "a"))
    raw = a.store.raw
    raw.set("rally/job/1/closed", raw.get("rally/job/0/closed"))  # a genuine value, copied forward
    with pytest.raises(UntrustedValue) as caught:
        a.next_round()
    text = str(caught.value)
    assert "'rally/job/1/closed'" in text and "stale or replayed" in text and "rally/job/0/closed" in text, text
    assert "different job token" not in text and "\n" not in text


# Same under load: in-process, the record is written before the call; a signature check.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_an_assignment_is_bound_to_the_node_it_was_made_for(server):
    from rally.rendezvous.c10d.store import UntrustedValue
    from rally.rendezvous.protocol import RendezvousSettings

    s = RendezvousSettings(**{**FAST, "max_nodes": 2})
    a, b = _node(server, "a", s), _node(server, "b", s)
    record = {"members": 1, "restart_count": 0, "membership_changes": 0, "stalled_restarts": 0, "checkpoint_step": None}
    b.store.set("0/closed", json.dumps(record))
    others = {
        "round": 0, "group_rank": 0, "group_world_size": 1, "rank_offset": 0, "world_size": 1, "restart_count": 0,
        "membership_changes": 0, "watch_rank": None, "watch_host": "", "master_host": "b.addr", "stalled_restarts": 0,
        "checkpoint_step": None, "node_id": "b:id",
    }  # fmt: skip
    b.store.set("0/assign/0/0", json.dumps(others))  # signed with the job's token, but made for b
    with pytest.raises(
        UntrustedValue, match=r"'rally/job/0/assign/0/0' .* made for node 'b:id', not this node \(a:id\)"
    ):
        a.next_round()


# Same under load: in-process, each fault is made between two calls of the protocol.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_deleted_round_end_is_tampering_and_a_moved_round_counter_is_corrected(server):
    from rally.rendezvous.c10d.store import StoreTampered
    from rally.rendezvous.protocol import RendezvousSettings, RoundEnd

    s = RendezvousSettings(**FAST)
    a = _node(server, "a", s)
    a.join_round().channel.end(RoundEnd("worker_failed", "x", "a"))
    a.store.raw.add("rally/job/current", 40)  # a late joiner must still find round 1
    late = _node(server, "late", replace(s))
    joined = late.join_round()
    assert joined.assignment.round == 1
    joined.channel.end(RoundEnd("worker_failed", "y", "late"))
    late.store.raw.delete_key("rally/job/1/end")
    with pytest.raises(StoreTampered, match=r"'rally/job/1/end' is missing"):
        late.next_round()


# Same under load: in-process, the counter is moved before the call; what is counted is store requests.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_an_arrival_past_a_moved_counter_asks_whether_the_slots_are_full_without_waiting(server):
    """A node whose arrival counter reads past MAX (a stranger moved it, or nodes died between
    their count and their claim) asks once whether every slot is taken. It used to ask with a
    10 ms store wait, which ran out in full whenever a slot was free; now it is one CHECK
    request and no wait at all, free slot or full round."""
    from rally.rendezvous.arrival import claim_arrival_slot
    from rally.rendezvous.protocol import RendezvousSettings

    s = RendezvousSettings(**{**FAST, "max_nodes": 2})
    a, b, c = _node(server, "a", s), _node(server, "b", s), _node(server, "c", s)
    waits: list[float] = []
    for node in (a, b, c):
        real = node.store.wait

        def counted(names, timeout, real=real):
            waits.append(timeout)
            return real(names, timeout)

        node.store.wait = counted  # the real store's wait, counted
    a.store.add("0/joined", 7)  # as if 7 nodes had counted themselves in and died before claiming
    first = claim_arrival_slot(a, 0, a.me)
    second = claim_arrival_slot(b, 0, b.me)
    late = claim_arrival_slot(c, 0, c.me)
    assert first is not None and second is not None and {first.slot, second.slot} == {0, 1}
    assert late is None  # both slots taken: a spare
    assert waits == [], waits  # main: one 0.01 s wait per claim past MAX
