"""Keep-alives on a store with leases (etcd): a dead node's membership expires by itself.

With a c10d store each node bumps a counter and watches the next node's counter (a ring, see
`RoundThreads._keep_alive` in agent/round_threads.py). With etcd the same job is done by the
cluster: each node's alive key `<round>/alive/<group_rank>` is attached to a lease with TTL =
keep_alive_timeout, the node refreshes the lease every keep-alive interval, and the next node in
the ring waits (a watch, no polling) for the key's deletion. When a node dies, nobody refreshes
its lease, etcd deletes the key TTL seconds later, and its watcher declares it lost, which ends
the round as "node_lost" for every node. The lease survives an etcd leader change: a new leader extends every lease.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from rally.agent.event_loop import Event
from rally.rendezvous.protocol import Assignment, Rendezvous
from rally.rendezvous.store import StoreError

# The ring watcher re-checks whether its round is over at least this often (one watch per slice).
WATCH_SLICE_SECONDS = 5.0


def keep_alive_with_lease(
    keeper: Rendezvous,
    a: Assignment,
    round_over: threading.Event,
    publish_status: Callable[[], None],
    status_interval: float,
    post: Callable[[Event, Any], None],
    answered: Callable[[float], None] = lambda _sent_at: None,
) -> None:
    """Hold this node's alive key (refresh its lease) and watch the next node's, until the round is over.

    Store failures are posted as (Event.STORE_LOST, exc), as the counter-based keep-alive does.
    The alive key's value counts the refreshes, so `Rendezvous.alive_count` moves as with a
    counter (liveness.silent_peer judges peers the same way on both stores); `answered` is
    called with the time each answered refresh was sent (the round's store watchdog).
    """
    s = keeper.settings
    interval = min(s.keep_alive_interval, s.keep_alive_timeout / 3)
    try:
        lease = keeper.hold_alive(a.round, a.group_rank)
        if a.watch_rank is not None:
            ring = Rendezvous(keeper.store.connect_again(), s, keeper.me)
            threading.Thread(target=_watch_next, args=(ring, a, round_over, post), daemon=True).start()
        next_status, beats = 0.0, 0
        while not round_over.is_set():
            sent_at = time.monotonic()
            beats += 1
            if not keeper.refresh_alive(a.round, a.group_rank, beats, lease):
                return  # our lease ran out (we stalled): our watcher ends the round, we re-form
            answered(sent_at)
            if time.monotonic() >= next_status:
                publish_status()
                next_status = time.monotonic() + status_interval
            round_over.wait(interval)
    except StoreError as exc:
        if not round_over.is_set():
            post(Event.STORE_LOST, exc)


def _watch_next(ring: Rendezvous, a: Assignment, round_over: threading.Event, post: Callable[[Event, Any], None]) -> None:
    """Wait for the next node's alive key to appear, then for it to vanish; then declare it lost."""
    s = ring.settings
    r, watched = a.round, a.watch_rank
    assert watched is not None
    ttl = float(max(1, math.ceil(s.keep_alive_timeout)))
    try:
        if not ring.member_appeared(r, watched, s.keep_alive_timeout):
            silent_for = s.keep_alive_timeout  # it never started its keep-alives
        else:
            while not ring.member_gone(r, watched, WATCH_SLICE_SECONDS):
                if round_over.is_set():
                    return
            silent_for = ttl
        if round_over.is_set() or ring.round_end(r) is not None:
            return  # the round is over anyway; an old round's lease expiring is no loss
        ring.declare_lost(r, watched, a.watch_host, silent_for)
    except StoreError as exc:
        if not round_over.is_set():
            post(Event.STORE_LOST, exc)
