"""The threads that watch the store while a round runs, and what they tell the agent's main loop.

Each thread has its own store connection (a c10d client blocked in `wait` blocks every other
call on its connection) and reports through `post(news)`, the agent's inbox (the kinds of news
are agent/base/event_loop.py's `News`):

* **end watcher**: waits on the round's end key -> RoundEnded(round, end);
* **keep-alive**: bumps this node's counter every interval and watches the next member's
  counter (a ring): silent for `keep_alive_timeout` -> declares that node lost, which ends the
  round for everyone. It does nothing else: no store scan, nothing a stranger's writes can
  make slow, so nothing but a lost store can delay a keep-alive (issue 27);
* **status**: refreshes this node's `rally status` record and runs the straggler exchange
  (node 0 reads every node's record) every STATUS_INTERVAL_SECONDS, on a connection of its own;
  a store error here is skipped (the keep-alive thread is the judge of a lost store);
* **store watchdog**: a c10d client call on a frozen store, or across a cut network, never
  returns (torch applies no timeout to `add`). When the keep-alive has not completed a store
  call for 3/4 of `min(keep_alive_timeout, read_timeout)`, this node is about to be declared
  lost by the others, who re-form without it: -> StoreLost(StoreSilent(...)), and the agent
  stops its workers and exits before they re-form, so the job never runs twice (no split brain);
* **peer check** (`check_peers`, started by agent/worker_exits.py on a local worker failure in a
  multi-node round): is a peer gone? -> PeerVerdict(round, (group rank, silent s) | None).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rally.agent.base.event_loop import PeerVerdict, Post, RoundEnded, StoreLost
from rally.agent.rounds.leased_liveness import keep_alive_with_lease
from rally.rendezvous.c10d.store import StoreError, UntrustedValue
from rally.rendezvous.liveness import silent_peer
from rally.rendezvous.protocol import Assignment, Rendezvous, RendezvousSettings, Round, RoundChannel, RoundEnd

# How often a node refreshes its record for `rally status` (the status thread, never the keep-alive's).
STATUS_INTERVAL_SECONDS = 2.0


# How often the end watcher looks again while the round's end key holds a stranger's value.
UNTRUSTED_END_POLL_SECONDS = 0.2


class StoreSilent(StoreError):
    """The store has not answered a keep-alive for too long: cut off, or the store is frozen."""


# A node fences itself after this share of the keep-alive timeout without an answer, so its
# workers are stopped before the others declare it lost and re-form (a lease, renewed by keep-alives).
SELF_FENCE_SHARE = 0.75


def store_silence_limit(settings: RendezvousSettings, read_timeout: float, leased: bool = False) -> float:
    """How long a node tolerates an unanswered store call while its workers run.

    With leases (etcd) the others go by this node's lease, which cannot expire sooner than TTL
    after the last refresh etcd answered was *sent* (a leader election extends every lease), so
    the node may wait until one keep-alive interval before that: an election, which stalls every
    node's calls for about a second, is then not mistaken for being cut off."""
    if leased:
        interval = min(settings.keep_alive_interval, settings.keep_alive_timeout / 3)
        return min(settings.keep_alive_timeout - interval, read_timeout)
    return SELF_FENCE_SHARE * min(settings.keep_alive_timeout, read_timeout)


class RoundThreads:
    """Start with `start()`; `stop()` ends them (a thread stuck in a store call is a daemon)."""

    def __init__(
        self,
        post: Post,
        watcher: Round,
        keeper: Round,
        read_timeout: float,
        status_record: Callable[[Assignment], dict],
        exchange: Callable[[Round], None] = lambda _round: None,
    ):
        """`watcher` and `keeper`: the round on a connection each; `exchange(keeper)` runs after
        each status record is published (agent/observe/observer.py)."""
        self.post = post
        self.watcher = watcher
        self.keeper = keeper
        self.assignment = keeper.assignment
        self.read_timeout = read_timeout
        self.status_record = status_record
        self.exchange = exchange
        self.over = threading.Event()
        self.last_answer = time.monotonic()

    def start(self) -> None:
        for target in (self._watch_round_end, self._keep_alive, self._watchdog, self._publish_status):
            threading.Thread(target=target, daemon=True).start()

    def stop(self) -> None:
        self.over.set()

    def _watch_round_end(self) -> None:
        channel, tolerate = self.watcher.channel, self.watcher.store.on_untrusted
        try:
            end: RoundEnd | None
            try:
                # wait: background: the watcher thread, in slices, while the job runs
                end = channel.wait_end()
            except UntrustedValue as exc:
                if tolerate is None:
                    raise
                # A stranger's value where the round's end goes: not an end. The job's own end
                # replaces it (Store.set_once); until then, look again every slice.
                tolerate(f"{exc}; ignored, the job goes on")
                while (end := self._valid_end(channel)) is None:
                    # wait: background: UNTRUSTED_END_POLL_SECONDS while the end key holds a stranger's value
                    if self.over.wait(UNTRUSTED_END_POLL_SECONDS):
                        return
            self.post(RoundEnded(self.assignment.round, end))
        except StoreError as exc:
            if not self.over.is_set():
                self.post(StoreLost(exc))

    @staticmethod
    def _valid_end(channel: RoundChannel) -> RoundEnd | None:
        try:
            return channel.ended()
        except UntrustedValue:
            return None

    def _keep_alive(self) -> None:
        """Send this node's keep-alives and watch the next node's (a ring)."""
        a, s = self.assignment, self.keeper.settings
        if self.keeper.store.leased_liveness:  # etcd: leases expire by themselves
            return keep_alive_with_lease(self.keeper, self.over, self.post, self._answered)
        interval = min(s.keep_alive_interval, s.keep_alive_timeout / 3)
        last_seen: int | None = -1  # a counter here (c10d): never None
        last_change = time.monotonic()
        channel = self.keeper.channel
        try:
            while not self.over.is_set():
                channel.keep_alive()
                self.last_answer = time.monotonic()
                if a.watch_rank is not None:
                    seen = channel.alive_count(a.watch_rank)
                    now = self.last_answer = time.monotonic()
                    if seen != last_seen:
                        last_seen, last_change = seen, now
                    elif now - last_change > s.keep_alive_timeout:
                        channel.declare_lost(a.watch_rank, a.watch_host, now - last_change)
                        return
                # wait: background: keep-alive interval
                self.over.wait(interval)
        except StoreError as exc:
            if not self.over.is_set():
                self.post(StoreLost(exc))

    def _publish_status(self) -> None:
        """The status thread: this node's record and the straggler exchange, on a connection of
        its own, so a slow scan (a stranger's long list, a big job) never delays a keep-alive."""
        try:
            rnd = self.keeper.connect_again()
        except StoreError:
            return  # the store is gone: the keep-alive thread reports it
        while not self.over.is_set():
            try:
                rnd.status.publish(self.status_record(self.assignment))
                self.exchange(rnd)
            except StoreError:
                pass  # skipped this time; a lost store is the keep-alive thread's to report
            # wait: background: STATUS_INTERVAL_SECONDS
            self.over.wait(STATUS_INTERVAL_SECONDS)

    def _answered(self, sent_at: float) -> None:
        self.last_answer = sent_at

    def _watchdog(self) -> None:
        """Also tells a frozen agent (SIGSTOP, a paused VM) from a frozen store: its own wake-ups
        stop, so after SIGCONT it sees how long it was gone and says that, not the store, froze."""
        limit = store_silence_limit(self.keeper.settings, self.read_timeout, self.keeper.store.leased_liveness)
        tick = limit / 8
        woke = time.monotonic()
        # wait: background: limit / 8
        while not self.over.wait(tick):
            now = time.monotonic()
            frozen, woke = now - woke - tick, now
            if frozen > limit:
                self.post(StoreLost(StoreSilent(frozen_line(frozen, self.assignment, self.keeper.settings))))
                return
            silent = now - self.last_answer
            if silent > limit:
                line = (
                    f"{self.keeper.store.describe} has not answered for {silent:.1f} s: this node is cut off "
                    "from it (network) or the store is frozen. The other nodes re-form without this one, "
                    "so its workers were stopped (the job never runs twice)"
                )
                self.post(StoreLost(StoreSilent(line)))
                return


def frozen_line(frozen: float, assignment: Assignment, settings: RendezvousSettings) -> str:
    return (
        f"this node (node {assignment.group_rank} of round {assignment.round}) "
        f"was frozen for {frozen:.1f} s (SIGSTOP, a paused VM or "
        f"a stalled machine), longer than the keep-alive timeout allows ({settings.keep_alive_timeout:g} s): it was "
        "left behind, and the other nodes re-form without it; its workers were stopped (the job never runs twice). "
        "Start it again to rejoin the job"
    )


def left_behind_line(assignment: Assignment, end: RoundEnd) -> str:
    """The round ended because the others lost this very node: it was frozen or cut off."""
    return (
        f"this node (node {assignment.group_rank} of round {assignment.round}) "
        f"was left behind: the other nodes declared it lost "
        f"({end.detail}), so it was frozen (SIGSTOP, a paused VM, a stalled machine) or cut off, and they re-formed "
        "without it; its workers were stopped (the job never runs twice). Start it again to rejoin the job"
    )


def check_peers(post: Post, rnd: Round) -> None:
    """In a thread, on a connection of its own: after a local failure, find out whether a peer
    node is gone (liveness.silent_peer)."""

    def run() -> None:
        try:
            verdict = silent_peer(rnd.connect_again().channel)
        except StoreError:
            verdict = None  # the store itself is in trouble; the local failure stands
        post(PeerVerdict(rnd.assignment.round, verdict))

    threading.Thread(target=run, daemon=True).start()


class StoreProbe:
    """Outside a running round (forming, waiting for the master) the agent's store calls may
    legitimately block for long, so a frozen store is told apart by a cheap `check` on a
    connection of its own: unanswered for 3/4 of `read_timeout` -> `stalled()`, which the agent
    checks every `limit / 4` seconds, so a frozen store is noticed within `read_timeout`."""

    def __init__(self, rdzv: Rendezvous, read_timeout: float):
        self.rdzv = rdzv
        self.limit = SELF_FENCE_SHARE * read_timeout
        self.interval = self.limit / 4
        self.last_answer = time.monotonic()
        self.pinging = False
        self.over = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            # wait: background: probe interval
            while not self.over.wait(self.interval):
                self.pinging = True
                self.rdzv.ping()
                self.pinging, self.last_answer = False, time.monotonic()
        except StoreError:
            pass  # the store is gone: the calls being probed fail on their own

    def stalled(self) -> str | None:
        now = time.monotonic()
        silent = now - self.last_answer
        if silent <= self.limit:
            return None
        if not self.pinging:  # the probe is not waiting for the store: this process was frozen
            self.last_answer = now  # (SIGSTOP, a paused VM); the store may be fine: probe again
            return None
        return (
            f"{self.rdzv.store.describe} has not answered for {silent:.1f} s: "
            "this node is cut off from it (network) or the store is frozen; check the store's host"
        )
