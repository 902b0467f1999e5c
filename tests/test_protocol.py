"""The rendezvous protocol in-process: real TCPStore (port 0), one thread and one connection per
simulated node. Rank assignment, last call, node loss, crash-loop arithmetic, closer death,
spares, relaunches, and hostile store contents, in seconds."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from rally.rendezvous.base.records import BarrierMark, SuccessRecord
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import (
    Store,
    StoreEndpoint,
    StoreUnavailable,
    UntrustedValue,
    connect_tcp_store,
    host_tcp_store,
    open_tcp_store,
)
from rally.rendezvous.liveness import silent_peer
from rally.rendezvous.protocol import (
    JobClosed,
    NodeInfo,
    Rendezvous,
    RendezvousError,
    RendezvousSettings,
    Round,
    RoundEnd,
)

pytestmark = pytest.mark.timeout(60)

FAST = RendezvousSettings(
    min_nodes=1,
    max_nodes=1,
    join_timeout=10,
    last_call_timeout=0.3,
    keep_alive_interval=0.05,
    keep_alive_timeout=0.5,
    close_timeout=1.5,
)


@pytest.fixture
def server():
    store = host_tcp_store(0, 10, loopback_only=True)
    yield store
    del store


def connect(server, run: str = "job", token: str = "") -> Store:
    def reconnect():
        return connect_tcp_store("127.0.0.1", server.port, 5, 5)

    return Store(reconnect(), f"rally/{run}/", "the test store", reconnect, Signer(token))


def node(
    server, name: str, settings: RendezvousSettings, nproc: int = 2, token: str = "", run: str = "job"
) -> Rendezvous:
    me = NodeInfo(node_id=f"{name}:id", host=name, addr=f"{name}.addr", nproc=nproc)
    return Rendezvous(connect(server, run, token), settings, me)


def form(nodes: list[Rendezvous], timeout: float = 20) -> list:
    """Every node calls next_round at once; the assignments (or exceptions) in node order."""
    with ThreadPoolExecutor(len(nodes)) as pool:
        futures = [pool.submit(n.next_round) for n in nodes]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout))
            except Exception as exc:  # returned for the test to check
                out.append(exc)
        return out


def test_ranks_are_contiguous_node_major_and_kept_across_rounds(server):
    s = replace(FAST, min_nodes=3, max_nodes=3)
    nodes = [node(server, f"h{i}", s, nproc=i + 1) for i in range(3)]
    first = form(nodes)
    assert sorted(a.group_rank for a in first) == [0, 1, 2]
    assert {a.world_size for a in first} == {6} and {a.group_world_size for a in first} == {3}
    by_rank = sorted(zip(first, nodes, strict=True), key=lambda p: p[0].group_rank)
    offset = 0
    for a, n in by_rank:
        assert a.rank_offset == offset
        offset += n.me.nproc
        assert a.watch_rank == (a.group_rank + 1) % 3
    master = by_rank[0][1].me.addr
    assert {a.master_host for a in first} == {master}
    Round(nodes[0], first[0]).channel.end(RoundEnd("worker_failed", "x", "h0"))
    second = form(nodes)
    assert [a.group_rank for a in second] == [a.group_rank for a in first]
    assert {a.restart_count for a in second} == {1} and {a.round for a in second} == {1}


def test_last_call_closes_with_min_after_the_timeout(server):
    s = replace(FAST, min_nodes=2, max_nodes=3, last_call_timeout=0.5)
    began = time.monotonic()
    result = form([node(server, "a", s), node(server, "b", s)])
    took = time.monotonic() - began
    assert {a.group_world_size for a in result} == {2}
    assert 0.4 < took < 3, took


def test_node_loss_is_seen_within_keep_alive_timeout_and_the_next_round_closes_at_once(server):
    s = replace(FAST, min_nodes=1, max_nodes=2, last_call_timeout=10)
    a, b = node(server, "a", s), node(server, "b", s)
    fa, fb = form([a, b])
    b_rank = fb.group_rank
    channel = Round(a, fa).channel
    channel.keep_alive()
    began = time.monotonic()
    verdict = silent_peer(channel)  # b sends nothing: it died
    assert verdict is not None and verdict[0] == b_rank
    assert s.keep_alive_timeout <= time.monotonic() - began < s.keep_alive_timeout + 1
    end = channel.declare_lost(b_rank, "b", verdict[1])
    assert end.kind == "node_lost" and "node" in end.detail
    began = time.monotonic()
    (again,) = form([a])
    assert again.group_world_size == 1 and again.restart_count == 0 and again.membership_changes == 1
    assert time.monotonic() - began < 2, "the lost node was counted: no last call"


def test_a_live_peer_answers_the_peer_check_within_an_interval(server):
    s = replace(FAST, min_nodes=2, max_nodes=2)
    a, b = node(server, "a", s), node(server, "b", s)
    fa, fb = form([a, b])
    stop = threading.Event()
    b_channel = Round(b, fb).channel

    def beat():
        while not stop.wait(s.keep_alive_interval):
            b_channel.keep_alive()

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        began = time.monotonic()
        assert silent_peer(Round(a, fa).channel) is None
        assert time.monotonic() - began < s.keep_alive_timeout
    finally:
        stop.set()
        beater.join()


def test_first_failure_is_the_root_cause_and_crash_loop_counts(server):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    n = node(server, "a", s)
    steps = iter([None, 10, 10, 10, 20])
    n.progress = lambda: next(steps)
    seen = []
    for r in range(5):
        rnd = n.join_round()
        a = rnd.assignment
        assert a.round == r
        seen.append((a.restart_count, a.stalled_restarts, a.checkpoint_step))
        first = rnd.channel.first_failure(RoundEnd("worker_failed", f"first {r}", "a"))
        second = rnd.channel.first_failure(RoundEnd("worker_failed", "second", "a"))
        assert first.detail == second.detail == f"first {r}"
        rnd.channel.end(first)
    assert seen == [(0, 0, None), (1, 0, 10), (2, 1, 10), (3, 2, 10), (4, 0, 20)]


def test_membership_changes_do_not_spend_restarts(server):
    s = replace(FAST, min_nodes=1, max_nodes=2)
    a = node(server, "a", s)
    (fa,) = form([a])
    Round(a, fa).channel.end(RoundEnd("node_joined", "b joined", "b"))
    (again,) = form([a])
    assert again.restart_count == 0 and again.membership_changes == 1


def test_a_round_whose_closer_died_still_forms(server):
    s = replace(FAST, min_nodes=2, max_nodes=2, close_timeout=1.0)
    dead = connect(server)
    dead.set_once("0/closer/0", "dead-node")  # it won the close, then died
    began = time.monotonic()
    result = form([node(server, "a", s), node(server, "b", s)])
    assert {a.group_world_size for a in result} == {2}, result
    assert time.monotonic() - began < s.close_timeout + 3


def test_the_others_take_over_when_the_completing_arrival_dies_before_it_closes(server):
    """Only the node holding the last slot closes at once (the others write no losing closer key);
    should it die first, the others close after close_timeout."""
    s = replace(FAST, min_nodes=3, max_nodes=3, close_timeout=1.0)
    dead = node(server, "dead", s)
    dead.store.add("0/joined", 1)
    assert dead.store.set_once("0/node/2", dead.me.to_json())[0]  # it holds the last slot, then dies
    began = time.monotonic()
    result = form([node(server, "a", s), node(server, "b", s)])
    assert {a.group_world_size for a in result} == {3}, result
    assert s.close_timeout * 0.9 <= time.monotonic() - began < s.close_timeout + 3
    assert dead.store.check("0/closer/1") and not dead.store.check("0/closer/0"), "attempt 0 was the dead node's"


def test_get_present_reads_the_keys_that_exist_each_checked(server):
    store, hostile = connect(server, token="secret"), connect(server, token="guess")
    store.set("a", "1")
    hostile.set("b", "forged")
    present = store.get_present(["a", "b", "c"])
    assert present["a"] == b"1" and isinstance(present["b"], UntrustedValue) and "c" not in present, present
    assert store.get_present(["a"]) == {"a": b"1"}


def test_a_round_never_forms_below_min_and_fails_within_join_timeout(server):
    s = replace(FAST, min_nodes=2, max_nodes=3, join_timeout=3, close_timeout=0.6)
    stranger = connect(server)
    stranger.raw.add(stranger.key("0/joined"), 1)  # counted in, never a valid descriptor
    stranger.raw.set(stranger.key("0/node/0"), b"garbage")
    messages = []
    a = node(server, "a", s)
    a.on_status = messages.append
    began = time.monotonic()
    (result,) = form([a])
    assert isinstance(result, RendezvousError) and "did not form" in str(result), result
    assert time.monotonic() - began < s.join_timeout + s.close_timeout + 2
    assert any("below the minimum" in m for m in messages), messages
    assert any("rally/job/0/node/0" in m for m in messages), messages


def test_a_spare_never_reruns_a_finished_job(server):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    a, spare = node(server, "a", s), node(server, "spare", s)
    (fa,) = form([a])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(spare.next_round)
        assert Round(a, fa).channel.report_success().kind == "succeeded"  # the job ends before anyone closed it
        with pytest.raises(JobClosed):
            waiting.result(10)


def test_a_relaunch_after_every_member_died_forms_a_new_job(server):
    s = replace(FAST, min_nodes=2, max_nodes=2, last_call_timeout=30)
    old = [node(server, f"old{i}", s) for i in range(2)]
    formed = form(old)
    for n, a in zip(old, formed, strict=True):
        Round(n, a).channel.keep_alive()  # then every node dies
    began = time.monotonic()
    fresh = form([node(server, f"new{i}", s) for i in range(2)])
    assert {a.round for a in fresh} == {1} and {a.group_world_size for a in fresh} == {2}, fresh
    assert time.monotonic() - began < s.keep_alive_timeout + 3, (
        "no last call: the dead round's members were counted lost"
    )


# ------------------------------------------------------------------ hostile store contents
@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("0/assign/0/{idx}", b"not json", "no rally agent wrote"),
        ("0/assign/0/{idx}", "not json", "is not JSON"),
        ("0/assign/0/{idx}", json.dumps({"round": 0}), "fields"),
        (
            "0/closed",
            json.dumps(
                {
                    "members": 99,
                    "restart_count": 0,
                    "membership_changes": 0,
                    "stalled_restarts": 0,
                    "checkpoint_step": None,
                }
            ),
            "members 99",
        ),
        (
            "0/closed",
            json.dumps(
                {
                    "members": 1,
                    "restart_count": -3,
                    "membership_changes": 0,
                    "stalled_restarts": 0,
                    "checkpoint_step": None,
                }
            ),
            "restart_count is -3",
        ),
    ],
)
def test_garbage_in_round_keys_gives_one_line_naming_the_key(server, key, value, expected):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    hostile = connect(server)
    name = key.format(idx=0)
    if isinstance(value, str):
        hostile.set(name, value)  # signed with the (empty) job token: only the checks stand
    else:
        hostile.raw.set(hostile.key(name), value)
    if name != "0/closed":  # a valid round record, so the node goes on to read its assignment
        hostile.set(
            "0/closed",
            json.dumps(
                {
                    "members": 1,
                    "restart_count": 0,
                    "membership_changes": 0,
                    "stalled_restarts": 0,
                    "checkpoint_step": None,
                }
            ),
        )
    (result,) = form([node(server, "a", s)])
    assert isinstance(result, UntrustedValue), result
    text = str(result)
    assert "\n" not in text and "rally/job/0/" in text and expected in text, text


def test_a_forged_assignment_never_reaches_workers(server):
    s = replace(FAST, min_nodes=1, max_nodes=2)
    hostile = connect(server)
    record = {"members": 1, "restart_count": 0, "membership_changes": 0, "stalled_restarts": 0, "checkpoint_step": None}
    hostile.set("0/closed", json.dumps(record))
    forged = {
        "round": 0, "group_rank": 0, "group_world_size": 1, "rank_offset": 0, "world_size": 1000, "restart_count": 0,
        "membership_changes": 0, "watch_rank": None, "watch_host": "", "master_host": "evil", "stalled_restarts": 0,
        "checkpoint_step": None, "node_id": "a:id",
    }  # fmt: skip
    hostile.set("0/assign/0/0", json.dumps({**forged, "world_size": 1}))
    a = node(server, "a", s, nproc=2)
    (result,) = form([a])
    assert isinstance(result, UntrustedValue) and "do not fit world_size 1" in str(result), result


def test_an_unsigned_or_foreign_value_is_rejected_with_the_key(server):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    a = node(server, "a", s, token="secret")
    (fa,) = form([a])
    stranger = connect(server, token="guess")
    stranger.set_once("0/end", RoundEnd("succeeded", "forged").to_json())
    with pytest.raises(UntrustedValue, match=r"'rally/job/0/end' holds a value signed with a different job token"):
        a.round_end(0)
    stranger.raw.set(stranger.key("0/master"), "evil:1234")
    with pytest.raises(UntrustedValue, match="rally/job/0/master"):
        Round(a, fa).wait_master(2)


def test_a_master_on_another_host_is_rejected(server):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    a = node(server, "a", s)
    (fa,) = form([a])
    a.store.set("0/master", "elsewhere:4000")
    with pytest.raises(UntrustedValue, match="not node rank 0's address"):
        Round(a, fa).wait_master(2)


def test_a_node_without_the_token_cannot_join(server):
    s = replace(FAST, min_nodes=2, max_nodes=2, join_timeout=3, close_timeout=0.6)
    result = form([node(server, "a", s, token="secret"), node(server, "b", s, token="other")])
    assert all(isinstance(r, (RendezvousError, UntrustedValue)) for r in result), result


@pytest.mark.parametrize("counter", ["current", "0/joined"])
def test_a_counter_holding_text_is_named_not_a_lost_store(server, counter):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    hostile = connect(server)
    hostile.raw.set(hostile.key(counter), b"lots")
    (result,) = form([node(server, "a", s)])
    assert isinstance(result, UntrustedValue) and f"'rally/job/{counter}'" in str(result), result


def test_a_negative_counter_is_out_of_range(server):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    hostile = connect(server)
    hostile.raw.add(hostile.key("current"), -5)
    (result,) = form([node(server, "a", s)])
    assert isinstance(result, UntrustedValue) and "out of range" in str(result), result


# ------------------------------------------------------------------ who hosts the store
def test_a_standalone_store_listens_on_loopback_only():
    import psutil

    store, server = open_tcp_store(StoreEndpoint("localhost", 0, host_here=True), "rally/x/", 5, 5, Signer("t"))
    listening = [c for c in psutil.net_connections("tcp") if c.laddr.port == server.port and c.status == "LISTEN"]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening


def test_a_taken_port_is_joined_only_when_this_job_hosts_it(server):
    mine, host = open_tcp_store(StoreEndpoint("127.0.0.1", 0, host_here=True), "rally/job1/", 5, 5, Signer("t1"))
    port = host.port
    same, second_host = open_tcp_store(
        StoreEndpoint("127.0.0.1", port, host_here=True), "rally/job1/", 5, 5, Signer("t1")
    )
    assert second_host is None and same.get("host")
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"the store of another job \(run id job1\)"):
        open_tcp_store(StoreEndpoint("127.0.0.1", port, host_here=True), "rally/job2/", 1, 1, Signer("t2"))
    with pytest.raises(StoreUnavailable, match="did not sign with this job's token"):
        open_tcp_store(StoreEndpoint("127.0.0.1", port, host_here=True), "rally/job1/", 1, 1, Signer("wrong"))
    assert time.monotonic() - began < 5


def test_a_forged_job_end_or_round_end_is_one_line_naming_the_key(server):
    s = replace(FAST, min_nodes=1, max_nodes=1)
    hostile = connect(server)
    hostile.set(
        "job/closed", json.dumps({"kind": "succeeded", "detail": "x", "node": "", "info": {"exit_status": 999}})
    )
    (result,) = form([node(server, "a", s)])
    assert (
        isinstance(result, UntrustedValue)
        and "'rally/job/job/closed'" in str(result)
        and "exit_status 999" in str(result)
    ), result


def test_status_skips_records_that_are_not_this_jobs(server):
    from rally.rendezvous.status.reader import read_job_status

    s = replace(FAST, min_nodes=1, max_nodes=1)
    a = node(server, "a", s)
    a.status.register()
    a.status.publish({"host": "a", "workers": []})
    hostile = connect(server)
    hostile.raw.append(hostile.key("status/nodes"), "ghost\n")
    hostile.raw.set(hostile.key("status/node/ghost"), b"{garbage")
    status = read_job_status(connect(server))
    assert status is not None and [n["host"] for n in status["nodes"]] == ["a"], status


# ------------------------------------------------------------------ where the token comes from
def test_token_precedence_and_the_slurm_derivation(tmp_path, monkeypatch):
    import stat

    from rally.rendezvous.base.token import TokenError, resolve_token

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RALLY_JOB_TOKEN", raising=False)
    secret_file = tmp_path / "t.txt"
    secret_file.write_text("from-file\n")
    assert resolve_token("conf", str(secret_file), True, "7") == "conf"
    assert resolve_token(None, str(secret_file), True, "7") == "from-file"
    monkeypatch.setenv("RALLY_JOB_TOKEN", "from-env")
    assert resolve_token(None, None, True, "7") == "from-env"
    monkeypatch.delenv("RALLY_JOB_TOKEN")
    assert resolve_token(None, None, True, None) != resolve_token(None, None, True, None)  # standalone: random
    assert resolve_token(None, None, False, None) == ""
    job7 = resolve_token(None, None, False, "7")
    assert job7 == resolve_token(None, None, False, "7") != resolve_token(None, None, False, "8")
    mode = (tmp_path / ".rally" / "secret").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE((tmp_path / ".rally").stat().st_mode) == 0o700
    with pytest.raises(TokenError, match="cannot read the job token file"):
        resolve_token(None, str(tmp_path / "missing"), False, None)


def test_a_node_hears_the_others_done_only_from_their_own_signed_records(server):
    """The exit watch (agent/observe/exit_watch.py) stops a rank stuck after its function returned
    only once every other node is done (its `done` mark), and reports a plain script's last rank only
    once every other node succeeded (its success record), each verified on read. A stranger's value,
    or one member's record copied to another's key, counts as none."""
    s = replace(FAST, min_nodes=2, max_nodes=2)
    a, b = node(server, "a", s, token="secret"), node(server, "b", s, token="secret")
    fa, fb = form([a, b])
    ours, theirs = (Round(a, fa), Round(b, fb)) if fa.group_rank == 0 else (Round(b, fb), Round(a, fa))

    def heard() -> tuple[bool, bool]:
        return ours.channel.wait_others("done", 0.3), ours.channel.wait_others("succeeded", 0.3)

    assert heard() == (False, False)
    stranger = connect(server, token="guess")
    stranger.set("0/done/1", BarrierMark("b:id", 1).to_json())
    stranger.set("0/succeeded/1", SuccessRecord("b:id", 1).to_json())
    assert heard() == (False, False)
    ours.channel.report_done()  # node 0's genuine mark, copied to node 1's key: a replay
    ours.rendezvous.store.set("0/done/1", ours.rendezvous.store.get("0/done/0"))
    assert heard() == (False, False)
    theirs.channel.report_done()
    assert heard() == (True, False)
    assert theirs.channel.report_success() is None  # node 0 has not succeeded: the round goes on
    assert heard() == (True, True)
    assert theirs.channel.wait_others("done", 0.3) and not theirs.channel.wait_others("succeeded", 0.3)
