"""The agent's decisions without processes: what a signal means in each state, the round-end
kinds, the rendezvous arithmetic (rendezvous/base/membership.py), and the protocol calls the agent's
modules make instead of naming store keys (preemption, requeue, straggler medians, hang stacks), over a real
in-process TCPStore. All in well under a second each."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from rally.agent.base.states import AgentState, SignalAction, signal_action
from rally.rendezvous.base.membership import assignments_for, counts_entering, newest_step
from rally.rendezvous.base.records import RoundRecord
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import Store, connect_tcp_store, host_tcp_store
from rally.rendezvous.preemption_barrier import PreemptionBarrier
from rally.rendezvous.protocol import Assignment, EndKind, NodeInfo, Rendezvous, RendezvousSettings, Round, RoundEnd
from rally.rendezvous.stack_exchange import StackExchange
from support.helpers import eventually

pytestmark = pytest.mark.timeout(30)

PREEMPT = frozenset({signal.SIGUSR1})
S = AgentState
A = SignalAction


@pytest.mark.parametrize(
    "state, preemption, other",
    [
        (S.STARTING, A.EXIT_PREEMPTED, A.EXIT),
        (S.RENDEZVOUS, A.EXIT_PREEMPTED, A.EXIT),
        (S.ROUND_SETUP, A.EXIT_PREEMPTED, A.EXIT),
        (S.RUNNING, A.PREEMPT, A.LEAVE),
        (S.PREEMPTING, A.IGNORE, A.END_GRACE),
        (S.STOPPING, A.CUT_GRACE, A.CUT_GRACE),
        (S.EXIT_BARRIER, A.IGNORE, A.EXIT),
    ],
)
def test_what_a_signal_means_in_each_state(state: AgentState, preemption: SignalAction, other: SignalAction) -> None:
    assert signal_action(state, signal.SIGUSR1, PREEMPT) is preemption
    assert signal_action(state, signal.SIGTERM, PREEMPT) is other
    # Without --preemption-signals, SIGUSR1 is just another signal.
    assert signal_action(state, signal.SIGUSR1, frozenset()) is other


def test_every_state_has_an_answer_for_every_signal() -> None:
    for state in AgentState:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            assert isinstance(signal_action(state, signum, PREEMPT), SignalAction)
    assert S.EXIT_BARRIER.waiting_for == "the exit barrier" and S.RENDEZVOUS.waiting_for == "the rendezvous"


def test_round_end_kinds_round_trip_through_the_store_as_their_names() -> None:
    end = RoundEnd(EndKind.WORKER_FAILED, "rank 1 exited with 1", "h", {"exit_status": 1})
    assert json.loads(end.to_json())["kind"] == "worker_failed"
    back = RoundEnd.load(end.to_json(), "k")
    assert back.kind is EndKind.WORKER_FAILED and back.is_failure and not back.is_membership_change
    assert f"job ended ({back.kind})" == "job ended (worker_failed)"
    assert RoundEnd.load(json.dumps({"kind": "node_lost", "detail": "d"}), "k").is_membership_change


def nodes(*specs: tuple[str, int, int | None, int | None]) -> list[NodeInfo]:
    """(host, nproc, previous rank, checkpoint step) per node, in arrival order."""
    return [
        NodeInfo(node_id=f"{h}:1", host=h, addr=f"{h}.addr", nproc=n, prev_rank=prev, checkpoint_step=step)
        for h, n, prev, step in specs
    ]


def test_assignments_are_node_major_keep_ranks_and_watch_a_ring() -> None:
    members = nodes(("c", 2, None, None), ("a", 4, 1, 10), ("b", 2, 0, 12))
    record = RoundRecord(3, 2, 1, 0, newest_step(members), 0)
    out = assignments_for(5, members, record)
    assert [a.group_rank for a in out] == [2, 1, 0]  # a and b keep their ranks; c takes the free one
    assert [a.rank_offset for a in out] == [6, 2, 0] and {a.world_size for a in out} == {8}
    assert [a.watch_rank for a in out] == [0, 2, 1]  # each watches the next rank
    assert {a.master_host for a in out} == {"b.addr"} and {a.checkpoint_step for a in out} == {12}
    assert {(a.round, a.restart_count, a.membership_changes) for a in out} == {(5, 2, 1)}


def test_crash_loop_arithmetic() -> None:
    failed = RoundEnd(EndKind.WORKER_FAILED, "x")
    lost = RoundEnd(EndKind.NODE_LOST, "x")
    before = RoundRecord(2, restart_count=3, membership_changes=1, stalled_restarts=2, checkpoint_step=100)
    assert counts_entering(None, None, 5) == (0, 0, 0)
    assert counts_entering(before, failed, 100) == (4, 1, 3)  # no newer checkpoint: the stall grows
    assert counts_entering(before, failed, 140) == (4, 1, 0)  # progress resets it
    assert counts_entering(before, failed, None) == (4, 1, 2)  # nothing to judge without checkpoints
    assert counts_entering(before, lost, 100) == (3, 2, 2)  # a lost node spends no restart


def member(r: int, group_rank: int, members: int) -> Assignment:
    """An assignment to round r (what the closer would write; these tests need no forming)."""
    return Assignment(
        round=r, group_rank=group_rank, group_world_size=members, rank_offset=group_rank, world_size=members,
        restart_count=0, membership_changes=0, watch_rank=None, watch_host="", master_host="a",
    )  # fmt: skip


@pytest.fixture
def rendezvous():
    server = host_tcp_store(0, 10, loopback_only=True)

    def member(name: str) -> Rendezvous:
        def reconnect():
            return connect_tcp_store("127.0.0.1", server.port, 5, 5)

        me = NodeInfo(node_id=f"{name}:id", host=name, addr=name, nproc=1)
        settings = RendezvousSettings(min_nodes=1, max_nodes=3)
        return Rendezvous(Store(reconnect(), "rally/job/", "the test store", reconnect, Signer("")), settings, me)

    yield member


def test_preemption_waits_for_every_node_and_only_one_node_requeues(rendezvous) -> None:
    a, b, c = rendezvous("a"), rendezvous("b"), rendezvous("c")
    waiter = rendezvous("a")  # a connection of its own: a blocked wait blocks its connection
    done = threading.Event()
    barriers = [PreemptionBarrier(n.store, n.me, member(4, g, 3)) for g, n in enumerate((a, b, c, waiter))]
    threading.Thread(target=lambda: done.set() if barriers[3].wait_all_checkpointed(10) else None, daemon=True).start()
    barriers[0].note_checkpointed()
    barriers[1].note_checkpointed()
    assert not done.wait(0.3), "two of three nodes done: node 0 keeps waiting"
    barriers[2].note_checkpointed()
    assert done.wait(5)
    assert [barriers[g].claim_requeue() for g in (1, 0, 2)] == [True, False, False]


def test_straggler_medians_and_round_ends_go_through_the_protocol(rendezvous) -> None:
    a, b = rendezvous("a"), rendezvous("b")
    ra, rb = Round(a, member(2, 0, 2)), Round(b, member(2, 1, 2))
    assert rb.channel.step_times() is None
    ra.channel.publish_step_times('{"count": 3}')
    # TCPStore's set has no reply: a read on a's own connection is the round trip after which b sees it
    assert ra.channel.step_times() == '{"count": 3}'
    assert rb.channel.step_times() == '{"count": 3}'
    assert not rb.channel.ended_within(0.05)
    ra.channel.end(RoundEnd(EndKind.SUCCEEDED, "done"))
    assert rb.channel.ended_within(1) and b.round_end(2).kind is EndKind.SUCCEEDED


def test_hang_stacks_are_asked_for_answered_in_order_and_released_when_the_round_ends(rendezvous) -> None:
    """A round can see several requests (a hang timeout's, the default hang watch's): each is
    numbered, answered under its own keys, and a watcher sees them in order, then the round's end."""
    a, b, watcher = rendezvous("a"), rendezvous("b"), rendezvous("b")
    sa, sb = StackExchange(a.store, a.me, member(3, 0, 2)), StackExchange(b.store, b.me, member(3, 1, 2))
    seen: list[object] = []
    watching = StackExchange(watcher.store, watcher.me, member(3, 1, 2))  # its own connection, as the agent's thread

    def watch() -> None:
        n = 0
        while watching.wait_request(n, 5):
            seen.append(n)
            n += 1
        seen.append("over")

    threading.Thread(target=watch, daemon=True).start()
    assert sa.request("rank 0 on a hung") == 0
    assert eventually(lambda: seen == [0], 5), "b's watcher saw the request"
    sa.publish(0, [{"rank": 0}])
    sb.publish(0, [{"rank": 1}, "not a snapshot"])
    assert sa.gather(0, 1) == {0: [{"rank": 0}], 1: [{"rank": 1}]}
    assert sb.request("rank 1 on b looks stuck") == 1  # a second request of the same round
    assert eventually(lambda: seen == [0, 1], 5), seen
    sa.publish(1, [{"rank": 0, "beats": 7}])
    assert sb.gather(1, 0.2) == {0: [{"rank": 0, "beats": 7}]}  # b's answer not in yet: left out
    sa.end_requests()  # the round is over: the watcher stops, nobody asks any more
    assert eventually(lambda: seen == [0, 1, "over"], 5), seen
    assert sb.request("too late") is None
    over = StackExchange(a.store, a.me, member(4, 0, 2))
    over.end_requests()  # round 4 ended before anyone asked
    assert StackExchange(b.store, b.me, member(4, 1, 2)).request("too late") is None
    assert StackExchange(b.store, b.me, member(4, 1, 2)).wait_request(0, 1) is False
