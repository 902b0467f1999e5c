"""One round as its nodes share it once it formed: its end, its first failure, who is alive, and
where its workers meet. Bound to the round at creation, so no call names a round number.

Keys, all under `<r>/` (rendezvous/protocol.py names the forming ones):

    end                 the round's end (first wins: the root cause every node reports); the
                        winner also bumps `current` for late joiners
    first_failure       the first worker failure job-wide (first wins), before the peer check
    alive/<g>           member g's keep-alive counter (c10d) or leased key (etcd)
    lost/<g>, lost      who declared member g lost (first wins); how many will not come back
    master              the workers' store address (node 0 writes it; it must be node 0's host)
    succeeded/<g>       member g's signed success record; all of them end the round
    done/<g>            member g's workers are all done: each exited 0 or its rally.job.run function
                        returned for good (agent/observe/exit_watch.py stops one that then lingers)
    acked/<g>           member g's signed record that it read the job's end; all of them open the
                        exit barrier (a counter and an `all_acked` flag once did: anyone could set it)
    step_times          node 0's median step times for the straggler check
    reentry/<g>         after an in-process restart's parking (agent/rounds/parking.py): member g
                        re-enters its workers (an empty reason), or why every node must restart
                        its processes instead
"""

from __future__ import annotations

import json
import time

from rally.rendezvous.base.keys import CURRENT_ROUND
from rally.rendezvous.base.kv import Checked, KeyValueStore, LeasedStore, UntrustedValue, opened, opened_text
from rally.rendezvous.base.membership import WAIT_SLICE_SECONDS, RendezvousError, RendezvousSettings
from rally.rendezvous.base.records import (
    MAX_COUNT,
    Assignment,
    BarrierMark,
    EndKind,
    NodeInfo,
    RoundEnd,
    SuccessRecord,
    parse_master,
)
from rally.rendezvous.status.waiting import WaitProgress

# How often a barrier whose keys all exist, one of them forged, reads them again: the forged key's
# member overwrites it with its genuine record when it gets there.
MARK_RECHECK_SECONDS = 0.1
# How often a node waiting for the others' in-process answers looks for a member declared lost.
REENTRY_SLICE_SECONDS = 0.2


def wait_all_marked(
    store: KeyValueStore,
    names: list[str],
    timeout: float,
    members: list[int] | None = None,
    record: type[BarrierMark] | type[SuccessRecord] = BarrierMark,
) -> bool:
    """True once every key of `names` (member g's is `names[g]`, or `names[i]` is member
    `members[i]`'s) holds that member's genuine `record`; False after `timeout`. A forged, garbage
    or replayed value counts as no mark (with one line through `store.on_untrusted` where the agent
    set it): it is read again until its member overwrites it or the time is up, so nobody without
    the token can open the barrier."""
    deadline = time.monotonic() + timeout
    while True:
        # wait: slice: the caller's timeout
        found = store.wait_and_read(names, max(deadline - time.monotonic(), 0.01))
        if found is None:
            return False
        try:
            for member, name in zip(members if members is not None else range(len(names)), names, strict=True):
                record.load(opened(found[name]), store.key(name)).check_for(store.key(name), member)
            return True
        except UntrustedValue as exc:
            if store.on_untrusted is not None:
                store.on_untrusted(f"{exc}; not counted: the barrier waits for that node's own record")
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        # wait: short: MARK_RECHECK_SECONDS, within the caller's timeout
        time.sleep(min(MARK_RECHECK_SECONDS, left))


def _reentry_record(value: Checked | None, group_rank: int) -> dict | None:
    """Member `group_rank`'s answer after parking, None while it has none of its own there (absent,
    not this job's, or another member's record copied to its key)."""
    if value is None or isinstance(value, UntrustedValue):
        return None
    try:
        record = json.loads(opened(value))
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("group_rank") == group_rank else None


def end_key(round_no: int) -> str:
    """Round `round_no`'s end record (first wins): forming reads the previous rounds' ends too."""
    return f"{round_no}/end"


def lost_counter(round_no: int) -> str:
    """Round `round_no`'s count of nodes that will not come back (the next round's closer reads it)."""
    return f"{round_no}/lost"


class RoundChannel:
    """Round `r` on one store connection, as `me` sees it: a member (`group_rank` given) or a node
    waiting for it to end (a spare, a relaunch). `members` is the round's size. Not thread-safe:
    a thread that watches the round gets a channel on a connection of its own (`on`)."""

    def __init__(
        self,
        store: KeyValueStore,
        settings: RendezvousSettings,
        me: NodeInfo,
        round_no: int,
        members: int,
        group_rank: int | None = None,
    ):
        self.store = store
        self.settings = settings
        self.me = me
        self.r = round_no
        self.members = members
        self.group_rank = group_rank

    @classmethod
    def of(
        cls, store: KeyValueStore, settings: RendezvousSettings, me: NodeInfo, assignment: Assignment
    ) -> RoundChannel:
        """The channel of the round `assignment` assigned this node to."""
        return cls(store, settings, me, assignment.round, assignment.group_world_size, assignment.group_rank)

    def on(self, store: KeyValueStore) -> RoundChannel:
        """The same round on another connection (for a thread of its own)."""
        return RoundChannel(store, self.settings, self.me, self.r, self.members, self.group_rank)

    def _key(self, name: str) -> str:
        return f"{self.r}/{name}"

    @property
    def _leases(self) -> LeasedStore:
        """The store's leases; only asked for when `store.leased_liveness` (agent/rounds/leased_liveness.py)."""
        assert isinstance(self.store, LeasedStore), f"{self.store.describe} has no leases"
        return self.store

    def _mine(self) -> int:
        if self.group_rank is None:
            raise ValueError(f"this node is not a member of round {self.r}")
        return self.group_rank

    # ----------------------------------------------------------------- the end
    def end(self, end: RoundEnd) -> RoundEnd:
        """End the round with `end` unless it already ended; return the reason that stands."""
        name = end_key(self.r)
        won, standing = self.store.set_once(name, end.to_json())
        if won:
            self.store.add(CURRENT_ROUND, 1)
        return RoundEnd.load(standing, self.store.key(name))

    def ended(self) -> RoundEnd | None:
        """The round's end record, None while it runs."""
        name = end_key(self.r)
        value = self.store.get_if_present(name)
        return None if value is None else RoundEnd.load(value, self.store.key(name))

    def ended_within(self, timeout: float) -> bool:
        # wait: slice: the caller's slice
        return self.store.try_wait([end_key(self.r)], timeout)

    def wait_end(self, slice_seconds: float = WAIT_SLICE_SECONDS) -> RoundEnd:
        """Block until the round ends (event-driven: a store wait on its end key)."""
        name = end_key(self.r)
        # wait: slice, said by the job: slices while the round runs
        while (found := self.store.wait_and_read([name], slice_seconds)) is None:
            pass
        return RoundEnd.load(opened(found[name]), self.store.key(name))

    def first_failure(self, end: RoundEnd) -> RoundEnd:
        """Record a worker failure the moment it is seen; the first one job-wide stands. (A node
        that dies takes its peers' workers down with "connection closed" a moment later.)"""
        name = self._key("first_failure")
        won, standing = self.store.set_once(name, end.to_json())
        return end if won else RoundEnd.load(standing, self.store.key(name))

    def report_success(self) -> RoundEnd | None:
        """This node's workers all succeeded: a signed record per member, not a counter anyone could
        bump. Each node writes before it reads, so the last to write sees all and ends the round."""
        mine = self._mine()
        self.store.set(self._key(f"succeeded/{mine}"), SuccessRecord(self.me.node_id, mine).to_json())
        return self.all_succeeded()

    def all_succeeded(self) -> RoundEnd | None:
        """The round's end once every member has written its success record, else None.

        Read with `get_present`, never decided by a short `wait` alone: a c10d wait that times out
        says nothing about the keys (the store's answer may simply come later than 10 ms on a
        loaded machine), and a node that wrongly saw a member missing would leave the round
        without anyone to end it: the job whose workers all finished and that never ended."""
        names = [self._key(f"succeeded/{g}") for g in range(self.members)]
        found = self.store.get_present(names)
        if len(found) < len(names):
            return None
        for g, name in enumerate(names):
            SuccessRecord.load(opened(found[name]), self.store.key(name)).check_for(self.store.key(name), g)
        return self.end(RoundEnd(EndKind.SUCCEEDED, "all workers finished successfully"))

    def report_done(self) -> None:
        """This node's workers are all done (each exited 0 or its rally.job.run function returned for
        good): a signed mark, which the other nodes' `wait_others` waits for."""
        mine = self._mine()
        self.store.set(self._key(f"done/{mine}"), BarrierMark(self.me.node_id, mine).to_json())

    def wait_others(self, kind: str, timeout: float) -> bool:
        """True once every other member's genuine `done` mark (`kind` "done": its workers all exited
        0 or returned for good) or success record ("succeeded") is there; False after `timeout`."""
        others = [g for g in range(self.members) if g != self._mine()]
        names = [self._key(f"{kind}/{g}") for g in others]
        # wait: slice: the caller's timeout
        return wait_all_marked(
            self.store, names, timeout, others, SuccessRecord if kind == "succeeded" else BarrierMark
        )

    def acknowledge_end(self) -> None:
        """This node read the job's end: its signed record (the exit barrier counts those)."""
        mine = self._mine()
        self.store.set(self._key(f"acked/{mine}"), BarrierMark(self.me.node_id, mine).to_json())

    def wait_all_acknowledged(self, timeout: float) -> bool:
        """The store's host waits here before exiting, so no agent loses the store mid-read. True
        once every member's signed `acked/<g>` record is there (a forged one opens nothing)."""
        # wait: slice: the caller's timeout
        return wait_all_marked(self.store, [self._key(f"acked/{g}") for g in range(self.members)], timeout)

    # ----------------------------------------------------------------- in-process or whole
    def publish_reentry(self, refusal: str | None) -> None:
        """This node parked its workers to re-enter them (`refusal` None), or restarts them whole
        and says why: then every node must (agent/rounds/parking.py)."""
        record = {"group_rank": self._mine(), "host": self.me.host, "refusal": refusal or ""}
        self.store.set(self._key(f"reentry/{self._mine()}"), json.dumps(record))

    def reentry_refusal(self, timeout: float) -> tuple[int, str, str] | None:
        """(group rank, host, why) of another member that restarts its processes instead of
        re-entering them; None once every other member not declared lost said it re-enters, or
        after `timeout` (a member that said nothing by then is left to the next round's forming)."""
        mine, deadline = self._mine(), time.monotonic() + timeout
        pending = [g for g in range(self.members) if g != mine]
        while pending:
            answers = {g: self._key(f"reentry/{g}") for g in pending}
            lost = {g: self._key(f"lost/{g}") for g in pending}
            found = self.store.read_present([*answers.values(), *lost.values()])
            for g in list(pending):
                record = _reentry_record(found.get(answers[g]), g)
                if record is not None:
                    if record.get("refusal"):
                        return g, str(record.get("host") or ""), str(record["refusal"])
                    pending.remove(g)
                elif lost[g] in found:  # declared lost: it re-enters nothing
                    pending.remove(g)
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return None
            missing = [answers[g] for g in pending if answers[g] not in found]
            if missing:
                # wait: slice: REENTRY_SLICE_SECONDS, up to the caller's timeout
                self.store.try_wait(missing, min(REENTRY_SLICE_SECONDS, left))
            else:  # only values this job did not write: read again until the members' own replace them
                # wait: short: REENTRY_SLICE_SECONDS
                time.sleep(min(REENTRY_SLICE_SECONDS, left))
        return None

    # ----------------------------------------------------------------- who is alive
    def keep_alive(self) -> None:
        self.store.add(self._key(f"alive/{self._mine()}"), 1)

    def alive_count(self, group_rank: int) -> int | None:
        """Member g's keep-alives so far: it is alive while this moves. On a leased store (etcd)
        the beats its alive key holds, None while it holds none: not yet created, or its lease
        expired (the node is gone: etcd deleted the key). A c10d counter is never None."""
        name = self._key(f"alive/{group_rank}")
        if not self.store.leased_liveness:
            return self.store.counter(name, MAX_COUNT)
        value = self.store.get_if_present(name)  # signed, as every value rally writes there
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            key = self.store.key(name)
            raise UntrustedValue(f"store key '{key}' holds {value[:40]!r}, not a keep-alive count") from None

    # Lease-backed liveness, for stores whose keys expire by themselves (`store.leased_liveness`,
    # etcd): the alive key lives as long as its lease is refreshed; its watcher waits for the
    # deletion instead of comparing counters.
    def hold_alive(self) -> int:
        """Create this node's alive key on a lease of TTL keep_alive_timeout; return the lease."""
        lease = self._leases.grant_lease(self.settings.keep_alive_timeout)
        self._leases.set_leased(self._key(f"alive/{self._mine()}"), "0", lease)
        return lease

    def refresh_alive(self, beats: int, lease: int) -> bool:
        """Renew this node's lease-backed alive key; False once the lease has run out."""
        if not self._leases.refresh_lease(lease):
            return False
        self._leases.set_leased(self._key(f"alive/{self._mine()}"), str(beats), lease)
        return True

    def member_appeared(self, group_rank: int, timeout: float) -> bool:
        # wait: background: the peer watcher
        return self.store.try_wait([self._key(f"alive/{group_rank}")], timeout)

    def member_gone(self, group_rank: int, timeout: float) -> bool:
        """True once the member's alive key is gone (its lease expired); False after `timeout`."""
        # wait: background: the peer watcher
        return self._leases.wait_deleted(self._key(f"alive/{group_rank}"), timeout)

    def declare_lost(self, group_rank: int, host: str, silent_for: float, note: str = "") -> RoundEnd:
        """Report a member whose keep-alives stopped; only the first declaration counts."""
        won, _ = self.store.set_once(self._key(f"lost/{group_rank}"), self.me.node_id)
        if won:
            self.store.add(lost_counter(self.r), 1)
        where = f" ({host})" if host else ""
        detail = f"node {group_rank}{where} was lost: it sent no keep-alive for {silent_for:.1f} s{note}"
        return self.end(RoundEnd(EndKind.NODE_LOST, detail, host, {"group_rank": group_rank}))

    def count_lost(self, nodes: int) -> None:
        """Nodes of the round that will not come back: the next round need not wait for them."""
        self.store.add(lost_counter(self.r), nodes)

    def leave(self, end: RoundEnd) -> RoundEnd:
        """This node is going away for good (a signal): let the others re-form without it."""
        self.count_lost(1)
        return self.end(end)

    # ----------------------------------------------------------------- where the workers meet
    def publish_master(self, host: str, port: int) -> None:
        self.store.set(self._key("master"), f"{host}:{port}")

    def wait_master(self, timeout: float, master_host: str, waiting: WaitProgress) -> tuple[str, int] | RoundEnd:
        """The workers' store address (on `master_host`), or the round's end if it ended first."""
        deadline = time.monotonic() + timeout
        name = self._key("master")
        waiting.begin()
        while True:
            waiting.tick(
                lambda: (
                    f"round {self.r}: waiting for node 0 ({master_host}) to start the workers' store; "
                    f"giving up in {deadline - time.monotonic():.0f} s"
                )
            )
            # wait: slice: 1 s slices up to the caller's deadline
            found = self.store.wait_and_read([name], min(1.0, max(deadline - time.monotonic(), 0.01)))
            if found is not None:
                return parse_master(opened_text(found[name], self.store.key(name)), self.store.key(name), master_host)
            end = self.ended()
            if end is not None:
                return end
            if time.monotonic() > deadline:
                raise RendezvousError(f"node rank 0 did not publish the workers' store within {timeout:g} s")

    # ----------------------------------------------------------------- straggler medians (agent/observe/observer.py)
    def publish_step_times(self, summary: str) -> None:
        self.store.set(self._key("step_times"), summary)

    def step_times(self) -> str | None:
        name = self._key("step_times")
        value = self.store.get_if_present(name)
        return None if value is None else opened_text(value, self.store.key(name))
