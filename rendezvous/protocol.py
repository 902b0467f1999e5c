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

Running: every member bumps its keep-alive counter `<r>/alive/<group_rank>` and watches the
  next member's counter (a ring), so a dead node is noticed by exactly one watcher within the
  keep-alive timeout, without any node reading all the others.

Ending: the first `compare_set(<r>/end)` wins, so the first failure is the one every node
  reports. Whoever wins also advances the `current` round counter for late joiners. The
  restart count of round r+1 is derived from round r's record and end reason, so it is the
  same on every node and can never drift apart (torchrun counts per agent); either one missing
  is tampering (`StoreTampered`), never a fresh start. Success: a signed record per member.

Values are signed (rendezvous/token.py); counters are only hints and wake-ups. Every wait is
bounded by `join_timeout` and says every few seconds what it waits for (rendezvous/waiting.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Callable

from rally.rendezvous.liveness import wait_round_end_or_dead
from rally.rendezvous.membership import (
    JobClosed,
    RendezvousError,
    RendezvousSettings,
    WAIT_SLICE_SECONDS,
    assign_group_ranks,
    assignments_for,
    counts_entering,
    newest_step,
    resume_step,
)
from rally.rendezvous.records import (
    FAILURE_KINDS,
    FINAL_KINDS,
    EndKind,
    MAX_COUNT,
    MEMBERSHIP_KINDS,
    Assignment,
    NodeInfo,
    RoundEnd,
    RoundRecord,
    SuccessRecord,
    parse_master,
    tampered,
)
from rally.rendezvous import arrival
from rally.rendezvous.arrival import CURRENT_ROUND, joined_counter, node_slot
from rally.rendezvous.kv import KeyValueStore as Store, StoreTimeout, UntrustedValue
from rally.rendezvous.waiting import WaitProgress, announce_wait, ended_line, spare_notice

RALLY_PREFIX = "rally/"  # every key rally writes; the static backend's workers write outside it


def job_prefix(run_id: str) -> str:
    """Every key of the job `run_id` lives under this prefix (the store is shared by jobs)."""
    return f"{RALLY_PREFIX}{run_id}/"


# Keys outside the rounds; rendezvous/status.py reads them for `rally status`.
JOB_CLOSED = "job/closed"  # the job's end (first wins): late joiners and spares stop
STATUS_NODES = "status/nodes"  # every node id that ever registered, one per line
JOB_STARTED = "job/started"  # who started the job, and when (first wins): names a run-id clash
# Kept for the job's whole life, read and written through rendezvous/node_memory.py:
LEARNED_TIMEOUTS = "job/timeouts"  # --heartbeat-timeout auto: JSON, merged by maximum
NODE_FAILURES = "job/node_failures"  # root-cause failures by host (JSON; every node writes the same entries)
QUARANTINED = "job/quarantined"  # host -> why (JSON; written by the quarantined node's own agent)
PREFLIGHT_VERDICT = "job/preflight"  # the last pre-flight verdict, for `rally status` (JSON; node 0)


def preflight_key(r: int, part: str) -> str:
    """Round r's pre-flight check (agent/checks/preflight.py): `result/<group rank>` (each node's numbers), `verdict` (node 0's)."""
    return f"{r}/preflight/{part}"


def status_key(node_id: str) -> str:
    """Where a node publishes its record for `rally status` (agent/observe/status_record.py)."""
    return f"status/node/{node_id}"


# The value of a round's `dump` key once the round is over (agent/hang_report.py).
STACKS_ROUND_OVER = "over"


class Rendezvous:
    """One node's view of the job's rendezvous. Not thread-safe: give each thread its own."""

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
        self.waiting = WaitProgress(lambda line: announce_wait(self, line))

    # ----------------------------------------------------------------- checked reads
    def _end_record(self, name: str) -> RoundEnd | None:
        if not self.store.check(name):
            return None
        return RoundEnd.load(self.store.get(name), self.store.key(name))

    def round_record(self, r: int) -> RoundRecord | None:
        name = f"{r}/closed"
        if not self.store.check(name):
            return None
        return RoundRecord.load(self.store.get(name), self.store.key(name)).check_members(self.store.key(name), self.settings.max_nodes)

    def _count(self, name: str, limit: int = MAX_COUNT) -> int:
        return self.store.counter(name, limit)

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

    def _raise_if_final(self, r: int) -> None:
        """A round that ended the job (success, abort, preemption) is never followed by another."""
        end = self.round_end(r) if r >= 0 else None
        if end is not None and end.kind in FINAL_KINDS:
            raise JobClosed(ended_line(self, end))

    def job_started(self) -> dict | None:
        """Who started the job and when (the first node's signed record), for a clash line."""
        try:
            started = json.loads(self.store.get(JOB_STARTED)) if self.store.check(JOB_STARTED) else None
        except (UntrustedValue, ValueError):
            return None
        return started if isinstance(started, dict) else None

    # ----------------------------------------------------------------- forming
    def next_round(self) -> Assignment:
        """Join the next round and block until it forms; return this node's assignment."""
        deadline = time.monotonic() + self.settings.join_timeout
        r = arrival.current_round(self) if self.last_round is None else self.last_round + 1
        while True:
            self.raise_if_closed()
            self._raise_if_final(r - 1)
            assignment = self._join(r, deadline)
            if assignment is not None:
                self.last_round = r
                self.last_rank = assignment.group_rank
                return assignment
            self._wait_as_spare(r, time.monotonic() + self.settings.join_timeout)
            r += 1
            deadline = time.monotonic() + self.settings.join_timeout

    def _join(self, r: int, deadline: float) -> Assignment | None:
        s = self.settings
        memory, durable = self.holdings()
        me = NodeInfo(**{
            **asdict(self.me), "prev_rank": self.last_rank, "checkpoint_step": self.progress(),
            "memory_steps": ",".join(map(str, memory)), "durable_step": durable,
        })  # fmt: skip
        idx = arrival.claim_arrival_slot(self, r, me)
        if idx is None:
            return None
        quorum_seen_at: float | None = None
        attempt = 0
        self.waiting.begin()
        while (record := self.round_record(r)) is None:
            count = min(max(self._count(joined_counter(r)), idx + 1), s.max_nodes)  # a hint: the closer counts
            now = time.monotonic()
            if now > deadline:
                raise RendezvousError(
                    f"rendezvous timed out after {s.join_timeout:g} s at {self.store.describe}: "
                    f"{count} of at least {s.min_nodes} nodes joined round {r}, and it did not form; start "
                    "the missing nodes or raise join_timeout (--rdzv-conf join_timeout=SECONDS)"
                )
            if count >= s.max_nodes or (count >= s.min_nodes and count >= self._expected(r)):
                attempt = self._try_close(r, attempt, deadline, defer=attempt == 0 and idx + 1 < count)
                continue
            remaining = deadline - now
            if count >= s.min_nodes:
                quorum_seen_at = quorum_seen_at or now
                remaining = min(remaining, quorum_seen_at + s.last_call_timeout - now)
                if remaining <= 0:
                    attempt = self._try_close(r, attempt, deadline, last_call_over=True)
                    continue
            self.waiting.tick(lambda: arrival.forming_line(self, r, count, deadline, quorum_seen_at))
            self.store.try_wait([f"{r}/closed"], min(max(remaining, 0.001), self.waiting.interval))
        mine = f"{r}/assign/{record.attempt}/{idx}"
        if not self.store.check(mine):
            return None
        return Assignment.load(self.store.get(mine), self.store.key(mine)).check_for(
            self.store.key(mine), r, self.me, s.max_nodes, record.members
        )

    def _expected(self, r: int) -> int:
        """How many nodes round r can expect: the last round's members, less the lost, plus joiners."""
        previous = self.round_record(r - 1) if r > 0 else None
        if previous is None:
            return self.settings.max_nodes
        lost = self._count(f"{r - 1}/lost", MAX_COUNT)
        waiting = self._count(f"{r - 1}/waiting", MAX_COUNT)
        return max(1, min(self.settings.max_nodes, previous.members - lost + waiting))

    def _try_close(
        self, r: int, attempt: int, deadline: float, last_call_over: bool = False, defer: bool = False
    ) -> int:
        """Close round r as `attempt`'s closer if nobody has and the valid descriptors (not the counter that woke
        us) meet the rule (`defer`: the completing arrival closes, this node only waits); return the next attempt."""
        s = self.settings
        won = not defer and self.store.set_once(f"{r}/closer/{attempt}", self.me.node_id)[0]
        if not won:
            wait = min(s.close_timeout, max(deadline - time.monotonic(), 0.001))
            return attempt if self.store.try_wait([f"{r}/closed"], wait) else attempt + 1
        count = min(self._count(joined_counter(r)), s.max_nodes)
        indices, nodes = arrival.valid_arrivals(self, r, count)
        required = s.min_nodes if last_call_over else max(s.min_nodes, min(self._expected(r), s.max_nodes))
        if len(nodes) < required:
            if len(nodes) < s.min_nodes:
                self.on_status(f"round {r}: {len(nodes)} valid node descriptors of {count} arrivals, below the minimum "
                               f"of {s.min_nodes} nodes; waiting for more")  # fmt: skip
            wait = min(s.close_timeout, max(deadline - time.monotonic(), 0.001))
            self.store.try_wait([node_slot(r, max(indices, default=-1) + 1)], wait)
            return attempt + 1
        self._write_round(r, attempt, indices, nodes)
        return attempt

    def _write_round(self, r: int, attempt: int, indices: list[int], nodes: list[NodeInfo]) -> None:
        step = newest_step(nodes)
        previous, end = (self.round_record(r - 1), self.round_end(r - 1)) if r > 0 else (None, None)
        for name, found in ((f"{r - 1}/closed", previous), (f"{r - 1}/end", end)):
            if r > 0 and found is None:  # deleted: that must not reset the restart budget
                raise tampered(self.store.key(name), f"round {r} cannot form before round {r - 1} closed and ended")
        counts = counts_entering(previous, end, step)
        record = RoundRecord(len(nodes), *counts, step, attempt, resume_step(nodes))
        mine = assignments_for(r, nodes, record)
        self.store.multi_set({f"{r}/assign/{attempt}/{idx}": a.to_json() for idx, a in zip(indices, mine)})
        self.store.set_once(f"{r}/closed", record.to_json())

    def _wait_as_spare(self, r: int, deadline: float) -> None:
        """Late for round r: register as waiting, ask a running job below MAX to re-form, wait (until `deadline`)."""
        s = self.settings
        self.store.add(f"{r}/waiting", 1)
        self.waiting.begin()
        while (record := self.round_record(r)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(f"round {r} was full and did not form within join_timeout ({s.join_timeout:g} s)")
            self.waiting.tick(lambda: f"waiting for round {r} to form (it is full without this node); join_timeout in {left:.0f} s")
            self.store.try_wait([f"{r}/closed"], min(left, self.waiting.interval))
            self.raise_if_closed()
        members = record.members
        if self.round_end(r) is None and members < s.max_nodes:
            self.on_status(f"round {r} is running with {members} nodes; asking it to re-form with this node")
            self.end_round(r, RoundEnd(EndKind.NODE_JOINED, f"{self.me.host} joined the job", self.me.host))
        elif self.round_end(r) is None:
            self.on_status(spare_notice(self, members))
        end = wait_round_end_or_dead(self, r, members, deadline)
        if end.kind in FINAL_KINDS:
            raise JobClosed(ended_line(self, end))

    # ----------------------------------------------------------------- status (for `rally status`)
    def register_status(self) -> None:
        """List this node under `status/nodes` for `rally status`; the first node signs who started the job, when."""
        self.store.append(STATUS_NODES, self.me.node_id + "\n")
        self.store.set_once(JOB_STARTED, json.dumps({"host": self.me.host, "node_id": self.me.node_id, "time": time.time()}))

    def publish_status(self, record: dict) -> None:
        self.store.set(status_key(self.me.node_id), json.dumps(record))

    # ----------------------------------------------------------------- running
    def publish_master(self, r: int, host: str, port: int) -> None:
        self.store.set(f"{r}/master", f"{host}:{port}")

    def wait_master(self, r: int, timeout: float, master_host: str) -> tuple[str, int] | RoundEnd:
        """The workers' store address for round r (on `master_host`), or the round's end if it ended first."""
        deadline = time.monotonic() + timeout
        self.waiting.begin()
        while True:
            self.waiting.tick(lambda: f"round {r}: waiting for node 0 ({master_host}) to start the workers' store; giving up in {deadline - time.monotonic():.0f} s")
            if self.store.try_wait([f"{r}/master"], min(1.0, max(deadline - time.monotonic(), 0.01))):
                name = f"{r}/master"
                return parse_master(self.store.get_str(name), self.store.key(name), master_host)
            end = self.round_end(r)
            if end is not None:
                return end
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"node rank 0 did not publish the workers' store within {timeout:g} s"
                )

    def keep_alive(self, r: int, group_rank: int) -> None:
        self.store.add(f"{r}/alive/{group_rank}", 1)

    def alive_count(self, r: int, group_rank: int) -> int:
        return self._count(f"{r}/alive/{group_rank}")

    # Lease-backed liveness, for stores whose keys expire by themselves (`store.leased_liveness`,
    # etcd): the alive key lives as long as its lease is refreshed; its watcher waits for the
    # deletion instead of comparing counters.
    def hold_alive(self, r: int, group_rank: int) -> int:
        """Create this node's alive key on a lease of TTL keep_alive_timeout; return the lease."""
        lease = self.store.grant_lease(self.settings.keep_alive_timeout)
        self.store.set_leased(f"{r}/alive/{group_rank}", "0", lease)
        return lease

    def member_appeared(self, r: int, group_rank: int, timeout: float) -> bool:
        return self.store.try_wait([f"{r}/alive/{group_rank}"], timeout)

    def member_gone(self, r: int, group_rank: int, timeout: float) -> bool:
        """True once the member's alive key is gone (its lease expired); False after `timeout`."""
        return self.store.wait_deleted(f"{r}/alive/{group_rank}", timeout)

    def declare_lost(self, r: int, group_rank: int, host: str, silent_for: float, note: str = "") -> RoundEnd:
        """Report a member whose keep-alives stopped; only the first declaration counts."""
        won, _ = self.store.set_once(f"{r}/lost/{group_rank}", self.me.node_id)
        if won:
            self.store.add(f"{r}/lost", 1)
        where = f" ({host})" if host else ""
        return self.end_round(
            r,
            RoundEnd(
                EndKind.NODE_LOST,
                f"node {group_rank}{where} was lost: it sent no keep-alive for {silent_for:.1f} s{note}",
                host,
                {"group_rank": group_rank},
            ),
        )

    def leave(self, r: int, end: RoundEnd) -> RoundEnd:
        """This node is going away for good (a signal): let the others re-form without it."""
        self.count_lost(r, 1)
        return self.end_round(r, end)

    def count_lost(self, r: int, nodes: int) -> None:
        """Nodes of round r that will not come back: the next round need not wait for them."""
        self.store.add(f"{r}/lost", nodes)

    def report_success(self, r: int, members: int, group_rank: int) -> RoundEnd | None:
        """This node's workers all succeeded: a signed record per member, not a counter anyone could
        bump. Each node writes before it reads, so the last to write sees all and ends the round."""
        self.store.set(f"{r}/succeeded/{group_rank}", SuccessRecord(self.me.node_id, group_rank).to_json())
        names = [f"{r}/succeeded/{g}" for g in range(members)]
        if not self.store.try_wait(names, 0.01):
            return None
        for g, name in enumerate(names):
            SuccessRecord.load(self.store.get(name), self.store.key(name)).check_for(self.store.key(name), g)
        return self.end_round(r, RoundEnd(EndKind.SUCCEEDED, "all workers finished successfully"))

    def first_failure(self, r: int, end: RoundEnd) -> RoundEnd:
        """Record a worker failure the moment it is seen; the first one job-wide stands. (A node
        that dies takes its peers' workers down with "connection closed" a moment later.)"""
        won, standing = self.store.set_once(f"{r}/first_failure", end.to_json())
        return end if won else RoundEnd.load(standing, self.store.key(f"{r}/first_failure"))

    def end_round(self, r: int, end: RoundEnd) -> RoundEnd:
        """End round r with `end` unless it already ended; return the reason that stands."""
        won, standing = self.store.set_once(f"{r}/end", end.to_json())
        if won:
            self.store.add(CURRENT_ROUND, 1)
        return RoundEnd.load(standing, self.store.key(f"{r}/end"))

    def round_end(self, r: int) -> RoundEnd | None:
        return self._end_record(f"{r}/end")

    def round_ended_within(self, r: int, timeout: float) -> bool:
        return self.store.try_wait([f"{r}/end"], timeout)

    def wait_round_end(self, r: int, slice_seconds: float = WAIT_SLICE_SECONDS) -> RoundEnd:
        """Block until round r ends (event-driven: a store wait on its end key)."""
        while not self.store.try_wait([f"{r}/end"], slice_seconds):
            pass
        end = self.round_end(r)
        assert end is not None  # the wait above saw the key
        return end

    def acknowledge_end(self, r: int, members: int) -> None:
        if self.store.add(f"{r}/acked", 1) >= members:
            self.store.set(f"{r}/all_acked", "1")

    def wait_all_acknowledged(self, r: int, timeout: float) -> bool:
        """The store's host waits here before exiting, so no agent loses the store mid-read."""
        return self.store.try_wait([f"{r}/all_acked"], timeout)

    def refresh_alive(self, r: int, group_rank: int, beats: int, lease: int) -> bool:
        """Renew this node's lease-backed alive key; False once the lease has run out."""
        if not self.store.refresh_lease(lease):
            return False
        self.store.set_leased(f"{r}/alive/{group_rank}", str(beats), lease)
        return True

    def ping(self) -> None:
        """One cheap call that only a store that answers completes (agent/round_threads.py)."""
        self.store.check("probe")

    def clear_worker_keys(self) -> int:
        """Static backend (workers share this store): drop an earlier attempt's worker keys."""
        return self.store.delete_keys_outside(RALLY_PREFIX)

    # ----------------------------------------------------------------- straggler medians (agent/observe/observer.py)
    def publish_step_times(self, r: int, summary: str) -> None:
        self.store.set(f"{r}/step_times", summary)

    def step_times(self, r: int) -> str | None:
        name = f"{r}/step_times"
        return self.store.get_str(name) if self.store.check(name) else None

    # ----------------------------------------------------------------- preemption (agent/preemption.py)
    def note_checkpointed(self, r: int, members: int) -> None:
        """This node's workers are done checkpointing after a preemption signal."""
        if self.store.add(f"{r}/preempt_done", 1) >= members:
            self.store.set(f"{r}/preempt_all_done", "1")

    def wait_all_checkpointed(self, r: int, timeout: float) -> bool:
        return self.store.try_wait([f"{r}/preempt_all_done"], timeout)

    def claim_requeue(self) -> bool:
        """True for the one node that may ask the scheduler to requeue the job (once per job)."""
        won, _ = self.store.set_once("job/requeued", self.me.node_id)
        return won

    # ----------------------------------------------------------------- hang reports (agent/hang_report.py)
    # `<r>/dump` is set once per round: a request for every node's stacks (JSON, by the node that
    # found a hang) or STACKS_ROUND_OVER (by any node whose round ended), which releases the
    # watchers. Each node answers with its workers' snapshots under `<r>/stacks/<group_rank>`.
    def request_stacks(self, r: int, reason: str) -> bool:
        """Ask every node of round r for its workers' stacks; False when the round is over."""
        _, standing = self.store.set_once(f"{r}/dump", json.dumps({"by": self.me.host, "reason": reason}))
        return standing != STACKS_ROUND_OVER

    def end_stacks_requests(self, r: int) -> None:
        """Round r is over for this node: wake its stack-request watcher (and nobody asks any more)."""
        self.store.set_once(f"{r}/dump", STACKS_ROUND_OVER)

    def wait_stacks_request(self, r: int, slice_seconds: float = WAIT_SLICE_SECONDS) -> bool:
        """Block until round r's dump key is set; True if it is a request (not the round's end)."""
        while not self.store.try_wait([f"{r}/dump"], slice_seconds):
            pass
        return self.store.get_str(f"{r}/dump") != STACKS_ROUND_OVER

    def publish_stacks(self, r: int, group_rank: int, snapshots: list[dict]) -> None:
        self.store.set(f"{r}/stacks/{group_rank}", json.dumps(snapshots))

    def gather_stacks(self, r: int, members: int, timeout: float) -> dict[int, list[dict]]:
        """Every node's published snapshots, waiting up to `timeout` for all; missing nodes left out."""
        names = [f"{r}/stacks/{g}" for g in range(members)]
        self.store.try_wait(names, timeout)
        found: dict[int, list[dict]] = {}
        for g, name in enumerate(names):
            if self.store.check(name):
                try:
                    found[g] = [s for s in json.loads(self.store.get(name)) if isinstance(s, dict)]
                except (ValueError, TypeError):
                    continue
        return found
    # ----------------------------------------------------------------- end of hang reports


__all__ = [
    "Assignment", "FAILURE_KINDS", "FINAL_KINDS", "EndKind", "JobClosed", "MEMBERSHIP_KINDS", "NodeInfo",
    "Rendezvous", "RendezvousError", "RendezvousSettings", "RoundEnd", "RoundRecord", "StoreTimeout", "assign_group_ranks",
]
