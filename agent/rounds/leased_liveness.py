"""Keep-alives on a store with leases (etcd): a dead node's membership expires by itself.

With a c10d store each node bumps a counter and watches the next node's counter (a ring, see
`RoundThreads._keep_alive` in agent/rounds/threads.py). With etcd the same job is done by the
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

from rally.agent.base.event_loop import Post, StoreLost
from rally.rendezvous.c10d.store import StoreError
from rally.rendezvous.protocol import Round

# The ring watcher re-checks whether its round is over at least this often (one watch per slice).
WATCH_SLICE_SECONDS = 5.0


def keep_alive_with_lease(
    keeper: Round,
    round_over: threading.Event,
    post: Post,
    answered: Callable[[float], None] = lambda _sent_at: None,
) -> None:
    """Hold this node's alive key (refresh its lease) and watch the next node's, until the round is over.
    Nothing else runs on this thread (the status record has a thread of its own, agent/rounds/threads.py).

    Store failures are posted as StoreLost(exc), as the counter-based keep-alive does.
    The alive key's value (signed, as every value) counts the refreshes, so
    `RoundChannel.alive_count` moves as with a counter, and is None once the lease expired
    (liveness.silent_peer judges peers by both); `answered` is called with the time each
    answered refresh was sent (the round's store watchdog).
    """
    s, a, channel = keeper.settings, keeper.assignment, keeper.channel
    interval = min(s.keep_alive_interval, s.keep_alive_timeout / 3)
    try:
        lease = channel.hold_alive()
        if a.watch_rank is not None:
            ring = keeper.connect_again()
            threading.Thread(target=_watch_next, args=(ring, round_over, post), daemon=True).start()
        beats = 0
        while not round_over.is_set():
            sent_at = time.monotonic()
            beats += 1
            if not channel.refresh_alive(beats, lease):
                return  # our lease ran out (we stalled): our watcher ends the round, we re-form
            answered(sent_at)
            # wait: background: keep-alive interval
            round_over.wait(interval)
    except StoreError as exc:
        if not round_over.is_set():
            post(StoreLost(exc))


def _watch_next(ring: Round, round_over: threading.Event, post: Post) -> None:
    """Wait for the next node's alive key to appear, then for it to vanish; then declare it lost."""
    s, a, channel = ring.settings, ring.assignment, ring.channel
    watched = a.watch_rank
    assert watched is not None
    ttl = float(max(1, math.ceil(s.keep_alive_timeout)))
    try:
        if not channel.member_appeared(watched, s.keep_alive_timeout):
            silent_for = s.keep_alive_timeout  # it never started its keep-alives
        else:
            while not channel.member_gone(watched, WATCH_SLICE_SECONDS):
                if round_over.is_set():
                    return
            silent_for = ttl
        if round_over.is_set() or channel.ended() is not None:
            return  # the round is over anyway; an old round's lease expiring is no loss
        channel.declare_lost(watched, a.watch_host, silent_for)
    except StoreError as exc:
        if not round_over.is_set():
            post(StoreLost(exc))
