"""The rendezvous: how agents form a job, one numbered round at a time, through a c10d store.

Every round has its own key prefix `<round>/`, so nothing from an earlier round can leak
into a later one. A round goes through three states:

    forming  --close-->  running  --end-->  ended      (the next round is `round + 1`)

Forming (O(1) store calls per node, however the arrivals are spread out):
    hint = add(<r>/joined, 1) - 1           where to look first (a counter anyone can move)
    compare_set(<r>/node/<idx>)             claim a slot with this node's descriptor, from the
                                            hint on (rendezvous/arrival.py); no free slot: late
    wait on <r>/closed                      nobody wakes for other nodes' arrivals
  The arrival that completes the round closes it: the MAX-th, or one that brings in every node expected back from
  the previous round (at least MIN); the others wait for its record as for a closer's, taking over after
  `close_timeout`. The MIN-th arrival keeps the last call: it waits `last_call_timeout` for more, then closes (so
  does any waiter whose wait runs out with MIN present, should that node have died). The first node to win
  `compare_set(<r>/closer/<attempt>)` reads the descriptors once and closes only if the valid
  ones meet the same rule (counters only wake it), assigns group ranks (a node keeps its rank
  across rounds when it can), writes one small assignment key per node under `assign/<attempt>/`
  (naming the node it is for), then `compare_set(<r>/closed)` (first wins). Should the closer die, the
  others take over with the next attempt after `close_timeout`; a round whose valid
  descriptors are fewer than MIN never closes, and none waits past `join_timeout`.

Running and ending (rendezvous/round_channel.py, one `RoundChannel` per round): every member
  bumps its keep-alive counter `<r>/alive/<group_rank>` and watches the next member's counter
  (a ring), so a dead node is noticed by exactly one watcher within the keep-alive timeout. The
  first `compare_set(<r>/end)` wins, so the first failure is the one every node reports. The
  restart count of round r+1 is derived from round r's record and end reason, so it is the
  same on every node and can never drift apart (torchrun counts per agent); either one missing
  is tampering (`StoreTampered`), never a fresh start. Success: a signed record per member.

What else the nodes agree on has a module of its own, each naming its own keys: the hang-stack
exchange (rendezvous/stack_exchange.py), the preemption barrier (rendezvous/preemption_barrier.py)
and the status board (rendezvous/status/board.py). A node that took part in a round holds it as
one `Round`: its assignment and those parts, bound to the round, on one store connection.

Values are signed (rendezvous/base/token.py); counters are only hints and wake-ups. Every wait is
bounded by `join_timeout` and says every few seconds what it waits for (rendezvous/status/waiting.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Protocol, runtime_checkable

from rally.rendezvous import arrival
from rally.rendezvous.arrival import Arrival, closed_key, joined_counter
from rally.rendezvous.base.keys import CURRENT_ROUND, JOB_CLOSED, RALLY_PREFIX
from rally.rendezvous.base.kv import Checked, Seen, StoreTimeout, UntrustedValue
from rally.rendezvous.base.kv import KeyValueStore as Store
from rally.rendezvous.base.membership import (
    JobClosed,
    RendezvousError,
    RendezvousSettings,
    assign_group_ranks,
    assignments_for,
    counts_entering,
    newest_step,
    resume_step,
)
from rally.rendezvous.base.records import (
    FAILURE_KINDS,
    FINAL_KINDS,
    MAX_COUNT,
    MEMBERSHIP_KINDS,
    Assignment,
    EndKind,
    NodeInfo,
    RoundEnd,
    RoundRecord,
    tampered,
)
from rally.rendezvous.liveness import wait_round_end_or_dead
from rally.rendezvous.preemption_barrier import PreemptionBarrier
from rally.rendezvous.round_channel import RoundChannel, end_key, lost_counter
from rally.rendezvous.stack_exchange import STACKS_ROUND_OVER, StackExchange
from rally.rendezvous.status.board import JOB_STARTED, STATUS_NODES, StatusBoard, status_key
from rally.rendezvous.status.waiting import WaitProgress, announce_wait, ended_line, progress_interval, spare_notice


def preflight_key(round_no: int, part: str) -> str:
    """Round `round_no`'s pre-flight check (agent/checks/preflight.py): `result/<group rank>` (each node's
    numbers), `verdict` (node 0's)."""
    return f"{round_no}/preflight/{part}"


@runtime_checkable
class SharedWithWorkers(Protocol):
    """A store the workers use too (the static backend's c10d store at the master address)."""

    def delete_keys_outside(self, keep_prefix: str) -> int: ...


class Rendezvous:
    """Forming rounds, as one node takes part: join, arrival, close, its assignment; and the job's
    end. What a formed round shares is its `Round`'s (below). Not thread-safe: one per thread."""

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        me: NodeInfo,
        on_status: Callable[[str], None] = lambda _message: None,
        progress: Callable[[], int | None] = lambda: None,
        holdings: Callable[[], tuple[list[int], int | None]] = lambda: ([], None),
    ):
        """`progress` returns the newest checkpoint step this node saved, for crash-loop detection;
        `holdings` the steps in its memory tier and the newest on disk, for the resume step."""
        self.store = store
        self.progress = progress
        self.holdings = holdings
        self.on_status = on_status
        self.settings = settings
        self.me = me
        self.last_round: int | None = None
        self.last_rank: int | None = None
        self.status = StatusBoard(store, me)  # for `rally status` (rendezvous/status/board.py)
        self._ahead: dict[str, Checked | None] = {}  # `_read_ahead`: until the node joins
        # wait: not_a_wait: prints a wait's progress line; not a wait
        self.waiting = WaitProgress(lambda line: announce_wait(self, line), progress_interval(settings.max_nodes))

    # ----------------------------------------------------------------- checked reads
    def _read_ahead(self, ends: list[str]) -> None:
        """Read the end records a node checks before it joins (the job's, the rounds' around the
        `current` hint) together: one request on etcd instead of one each (`read_present`)."""
        names = [JOB_CLOSED, *ends]
        present = self.store.read_present(names)
        self._ahead = {name: present.get(name) for name in names}

    def _first_look(self, me: NodeInfo) -> tuple[int, tuple[Arrival | None] | None]:
        """The round a first join takes part in, from the `current` hint and the end records (the
        job's, round 0's, and when the hint is past 0 the rounds' around it), read ahead: one request
        on etcd when the job is in its first round (`counter_and_present`), one more when it is not.
        On etcd a fresh job's first look is this node's arrival in round 0 too (`arrival.first_look`):
        then the second item holds it."""
        names = [JOB_CLOSED, end_key(0)]
        arrived, hint, present = arrival.first_look(self, me, names)
        self._ahead = {name: present.get(name) for name in names}
        if arrived is not None:
            return 0, arrived
        if hint > 0:
            self._read_ahead([end_key(hint - 1), end_key(hint)])
        return arrival.current_round(self, hint), None

    def _end_record(self, name: str) -> RoundEnd | None:
        # read a moment ago with the others (`_read_ahead`), else now
        value = self._ahead[name] if name in self._ahead else self.store.get_if_present(name)
        if isinstance(value, UntrustedValue):
            raise value
        return None if value is None else RoundEnd.load(value, self.store.key(name))

    def round_record(self, round_no: int) -> RoundRecord | None:
        """Round `round_no`'s record, None while it forms (a key nodes wait for: `get_if_present` as such)."""
        value = self.store.get_if_present(closed_key(round_no))
        return self._record_in(round_no, Seen({} if value is None else {closed_key(round_no): value}))

    def _record_in(self, round_no: int, seen: Seen) -> RoundRecord | None:
        """Round `round_no`'s record as a read or a wait just saw it (`seen`), None when it saw none."""
        name = closed_key(round_no)
        value = seen.values.get(name)
        if value is None:
            return None
        if isinstance(value, UntrustedValue):
            raise value
        key = self.store.key(name)
        return RoundRecord.load(value, key).check_members(key, self.settings.max_nodes)

    def _look_again(self, round_no: int, found: dict[str, Checked] | None) -> Seen:
        """What a wait for round `round_no`'s record found, or (it ran out) a fresh read of the record, whose
        point in the store's history the next wait starts from (`read_now`)."""
        return Seen(found) if found is not None else self.store.read_now([closed_key(round_no)])

    def _count(self, name: str, limit: int = MAX_COUNT) -> int:
        return self.store.counter(name, limit)

    def round_end(self, round_no: int) -> RoundEnd | None:
        """Round `round_no`'s end record (any round: forming reads the previous ones)."""
        return self._end_record(end_key(round_no))

    # ----------------------------------------------------------------- job state
    def job_closed(self) -> RoundEnd | None:
        return self._end_record(JOB_CLOSED)

    def close_job(self, end: RoundEnd) -> RoundEnd:
        """Mark the whole job finished so late joiners and spares stop waiting; first reason wins."""
        _, standing = self.store.set_once(JOB_CLOSED, end.to_json())
        return RoundEnd.load(standing, self.store.key(JOB_CLOSED))

    def raise_if_closed(self) -> None:
        closed = self.job_closed()
        if closed is not None:
            raise JobClosed(ended_line(self, closed))

    def _raise_if_final(self, round_no: int) -> None:
        """A round that ended the job (success, abort, preemption) is never followed by another."""
        end = self.round_end(round_no) if round_no >= 0 else None
        if end is not None and end.kind in FINAL_KINDS:
            raise JobClosed(ended_line(self, end))

    def ping(self) -> None:
        """One cheap call that only a store that answers completes (agent/rounds/threads.py)."""
        self.store.check("probe")

    def clear_worker_keys(self) -> int:
        """Static backend (workers share this store): drop an earlier attempt's worker keys."""
        assert isinstance(self.store, SharedWithWorkers), f"{self.store.describe} is not shared with workers"
        return self.store.delete_keys_outside(RALLY_PREFIX)

    # ----------------------------------------------------------------- forming
    def join_round(self) -> Round:
        """Join the next round and block until it forms; this node's part in it."""
        return Round(self, self.next_round())

    def next_round(self) -> Assignment:
        """Join the next round and block until it forms; return this node's assignment."""
        deadline = time.monotonic() + self.settings.join_timeout
        arrived: tuple[Arrival | None] | None = None  # this node's arrival, when its first look made it
        me = self._node_info()
        try:  # the end records read ahead serve these first checks only, never a later read
            if self.last_round is None:
                r, arrived = self._first_look(me)
            else:
                r = self.last_round + 1
                self._read_ahead([end_key(r - 1)])
            self.raise_if_closed()
            self._raise_if_final(r - 1)
        finally:
            self._ahead = {}
        while True:
            assignment = self._join(r, deadline, me, arrived)
            arrived = None
            if assignment is not None:
                self.last_round = r
                self.last_rank = assignment.group_rank
                return assignment
            # wait: slice, said by Rendezvous._wait_as_spare: a spare
            self._wait_as_spare(r, time.monotonic() + self.settings.join_timeout)
            r += 1
            me = self._node_info()
            deadline = time.monotonic() + self.settings.join_timeout
            self.raise_if_closed()
            self._raise_if_final(r - 1)

    def _node_info(self) -> NodeInfo:
        """This node's descriptor for the round it joins now: its rank and what it holds."""
        memory, durable = self.holdings()
        return NodeInfo(**{
            **asdict(self.me), "prev_rank": self.last_rank, "checkpoint_step": self.progress(),
            "memory_steps": ",".join(map(str, memory)), "durable_step": durable,
        })  # fmt: skip

    def _join(
        self, round_no: int, deadline: float, me: NodeInfo, arrived: tuple[Arrival | None] | None = None
    ) -> Assignment | None:
        """Take part in forming round `round_no` as `me` (`arrived`: this node's arrival, already made by its
        first look); its assignment, or None when it came too late (a spare)."""
        s = self.settings
        (mine,) = arrived if arrived is not None else (arrival.claim_arrival_slot(self, round_no, me),)
        if mine is None:
            return None
        quorum_seen_at: float | None = None
        attempt = 0
        # What the last read of the round's record saw (the arrival's own read where the store makes
        # one, else a read now); every wait after returns what it saw: no read after a wait.
        seen = mine.seen if mine.seen is not None else self.store.read_now([closed_key(round_no)])
        # The first pass takes the counter as this node's own arrival left it (the last arrival, the
        # one that closes, reads nothing before it does); later passes read it again.
        count, first = min(max(mine.arrived, mine.place + 1), s.max_nodes), True  # a hint: the closer counts
        self.waiting.begin()
        while (record := self._record_in(round_no, seen)) is None:
            if not first:
                count = min(max(self._count(joined_counter(round_no)), mine.place + 1), s.max_nodes)
            first = False
            now = time.monotonic()
            if now > deadline:
                raise RendezvousError(
                    f"rendezvous timed out after {s.join_timeout:g} s at {self.store.describe}: "
                    f"{count} of at least {s.min_nodes} nodes joined round {round_no}, and it did not form; start "
                    "the missing nodes or raise join_timeout (--rdzv-conf join_timeout=SECONDS)"
                )
            if count >= s.min_nodes:
                quorum_seen_at = quorum_seen_at or now
            # The last call runs out for a full count too: arrivals that are not valid nodes (a
            # stranger's) can make the count MAX with fewer valid descriptors than that.
            over = quorum_seen_at is not None and now >= quorum_seen_at + s.last_call_timeout
            if count >= s.max_nodes or (count >= s.min_nodes and count >= self._expected(round_no)):
                defer = attempt == 0 and mine.place + 1 < count
                attempt, seen = self._try_close(round_no, attempt, deadline, seen, last_call_over=over, defer=defer)
                continue
            remaining = deadline - now
            if quorum_seen_at is not None:
                remaining = min(remaining, quorum_seen_at + s.last_call_timeout - now)
                if remaining <= 0:
                    attempt, seen = self._try_close(round_no, attempt, deadline, seen, last_call_over=True)
                    continue
            self.waiting.tick(partial(arrival.forming_line, self, round_no, count, deadline, quorum_seen_at))
            # The first closer's assignment for this node is written just before the record: a store
            # that watches both on one stream (etcd) returns it with the record.
            # wait: slice, said by Rendezvous._join: slices of WAIT_SLICE_SECONDS up to join_timeout
            found = self.store.wait_and_read(
                [closed_key(round_no)],
                min(max(remaining, 0.001), self.waiting.interval),
                also=[f"{round_no}/assign/0/{mine.slot}"],
                since=seen,
            )
            seen = self._look_again(round_no, found)
        name = f"{round_no}/assign/{record.attempt}/{mine.slot}"
        # Read on the side of the wait (etcd), else one request for it or its absence: nobody waits for it.
        value = seen.values.get(name)
        if value is None:
            value = self.store.get_if_present(name, nobody_waits=True)
        if value is None:  # the closer did not count this node in (it claimed its slot too late)
            return None
        if isinstance(value, UntrustedValue):
            raise value
        return Assignment.load(value, self.store.key(name)).check_for(
            self.store.key(name), round_no, self.me, s.max_nodes, record.members
        )

    def _expected(self, round_no: int) -> int:
        """How many nodes round `round_no` can expect: the last round's members, less the lost, plus joiners."""
        previous = self.round_record(round_no - 1) if round_no > 0 else None
        if previous is None:
            return self.settings.max_nodes
        lost = self._count(lost_counter(round_no - 1), MAX_COUNT)
        waiting = self._count(f"{round_no - 1}/waiting", MAX_COUNT)
        return max(1, min(self.settings.max_nodes, previous.members - lost + waiting))

    def _try_close(
        self,
        round_no: int,
        attempt: int,
        deadline: float,
        seen: Seen,
        last_call_over: bool = False,
        defer: bool = False,
    ) -> tuple[int, Seen]:
        """Close round `round_no` as `attempt`'s closer if nobody has and the valid descriptors (not the counter
        that woke us) meet the rule (`defer`: the completing arrival closes, this node only waits); return the next
        attempt and what was seen of the round's record (this node's close, another's that the wait saw, or a read);
        `seen`: the last read of it, which such a wait starts from."""
        s = self.settings
        won = not defer and self.store.set_once(f"{round_no}/closer/{attempt}", self.me.node_id)[0]
        if not won:
            wait = min(s.close_timeout, max(deadline - time.monotonic(), 0.001))
            # wait: slice, said by Rendezvous._try_close: last call
            found = self.store.wait_and_read([closed_key(round_no)], wait, since=seen)
            return (attempt, Seen(found)) if found is not None else (attempt + 1, self._look_again(round_no, None))
        arrived = arrival.valid_arrivals(self, round_no)
        count, nodes = arrived.count, arrived.nodes
        required = s.min_nodes if last_call_over else max(s.min_nodes, min(self._expected(round_no), s.max_nodes))
        if len(nodes) < required:
            if len(nodes) < s.min_nodes:
                self.on_status(
                    f"round {round_no}: {len(nodes)} valid node descriptors of {count} arrivals, below the minimum "
                    f"of {s.min_nodes} nodes; waiting for more"
                )
            wait = min(s.close_timeout, max(deadline - time.monotonic(), 0.001))
            # wait: slice, said by Rendezvous._try_close: close_timeout, then the next attempt
            arrival.wait_for_more(self, round_no, arrived, wait)
            return attempt + 1, self._look_again(round_no, None)
        return attempt, self._write_round(
            round_no, attempt, arrived.slots, nodes
        )  # this close, or one that won before it

    def _write_round(self, round_no: int, attempt: int, slots: list[int], nodes: list[NodeInfo]) -> Seen:
        """Write round `round_no`'s assignments, then its record (first wins); return the record that stands."""
        step = newest_step(nodes)
        previous, end = (
            (self.round_record(round_no - 1), self.round_end(round_no - 1)) if round_no > 0 else (None, None)
        )
        for name, found in ((f"{round_no - 1}/closed", previous), (f"{round_no - 1}/end", end)):
            if round_no > 0 and found is None:  # deleted: that must not reset the restart budget
                raise tampered(
                    self.store.key(name), f"round {round_no} cannot form before round {round_no - 1} closed and ended"
                )
        counts = counts_entering(previous, end, step)
        record = RoundRecord(len(nodes), *counts, step, attempt, resume_step(nodes))
        mine = assignments_for(round_no, nodes, record)
        self.store.multi_set(
            {f"{round_no}/assign/{attempt}/{slot}": a.to_json() for slot, a in zip(slots, mine, strict=True)}
        )
        _, standing = self.store.set_once(closed_key(round_no), record.to_json())
        if not standing:
            return self._look_again(round_no, None)
        # This node's own assignment, as it wrote it: the closer reads nothing back (another
        # attempt's record that stands names other keys, which are read then).
        own = {
            f"{round_no}/assign/{attempt}/{slot}": a.to_json().encode()
            for slot, node, a in zip(slots, nodes, mine, strict=True)
            if node.node_id == self.me.node_id
        }
        return Seen({closed_key(round_no): standing.encode(), **own})

    def _wait_as_spare(self, round_no: int, deadline: float) -> None:
        """Late for round `round_no`: register as waiting, ask a running job below MAX to re-form, wait (until
        `deadline`)."""
        s = self.settings
        self.store.add(f"{round_no}/waiting", 1)
        self.waiting.begin()
        seen = self._look_again(round_no, None)
        while (record := self._record_in(round_no, seen)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"round {round_no} was full and did not form within join_timeout ({s.join_timeout:g} s)"
                )
            line = f"waiting for round {round_no} to form (it is full without this node); join_timeout in {left:.0f} s"
            self.waiting.tick(partial(str, line))
            # wait: slice, said by Rendezvous._wait_as_spare: WAIT_SLICE_SECONDS
            found = self.store.wait_and_read([closed_key(round_no)], min(left, self.waiting.interval), since=seen)
            self.raise_if_closed()
            seen = self._look_again(round_no, found)
        members = record.members
        running = RoundChannel(self.store, s, self.me, round_no, members)
        if running.ended() is None and members < s.max_nodes:
            self.on_status(f"round {round_no} is running with {members} nodes; asking it to re-form with this node")
            running.end(RoundEnd(EndKind.NODE_JOINED, f"{self.me.host} joined the job", self.me.host))
        elif running.ended() is None:
            self.on_status(spare_notice(self, members))
        # wait: slice, said by Rendezvous._wait_as_spare: a spare waits out a running round
        end = wait_round_end_or_dead(self, running, deadline)
        if end.kind in FINAL_KINDS:
            raise JobClosed(ended_line(self, end))


class Round:
    """This node's part in one formed round, on one store connection: its assignment and what the
    round's nodes share (end, liveness, master: `channel`; hang stacks: `stacks`; the preemption
    barrier: `preemption`). The agent holds one per round instead of the rendezvous and the
    assignment apart; a thread that watches the round takes one of its own (`connect_again`)."""

    def __init__(self, rendezvous: Rendezvous, assignment: Assignment):
        self.rendezvous = rendezvous
        self.assignment = assignment
        self.store = rendezvous.store
        self.settings = rendezvous.settings
        self.status = rendezvous.status
        self.channel = RoundChannel.of(rendezvous.store, rendezvous.settings, rendezvous.me, assignment)
        self.stacks = StackExchange(rendezvous.store, rendezvous.me, assignment)
        self.preemption = PreemptionBarrier(rendezvous.store, rendezvous.me, assignment)

    def on(self, store: Store) -> Round:
        """The same round on another connection (quiet: its waits print nothing)."""
        return Round(Rendezvous(store, self.settings, self.rendezvous.me), self.assignment)

    def connect_again(self) -> Round:
        return self.on(self.store.connect_again())

    def wait_master(self, timeout: float) -> tuple[str, int] | RoundEnd:
        """The workers' store address (node 0's), or the round's end if it ended first; the wait
        says what it waits for every few seconds, as the rendezvous' own waits do."""
        # wait: slice: 1 s slices up to the caller's deadline
        return self.channel.wait_master(timeout, self.assignment.master_host, self.rendezvous.waiting)


__all__ = [
    "Assignment",
    "FAILURE_KINDS",
    "FINAL_KINDS",
    "EndKind",
    "JobClosed",
    "MEMBERSHIP_KINDS",
    "NodeInfo",
    "Rendezvous",
    "RendezvousError",
    "RendezvousSettings",
    "Round",
    "RoundChannel",
    "RoundEnd",
    "RoundRecord",
    "StoreTimeout",
    "assign_group_ranks",
    "CURRENT_ROUND",
    "JOB_STARTED",
    "STACKS_ROUND_OVER",
    "STATUS_NODES",
    "status_key",
]
