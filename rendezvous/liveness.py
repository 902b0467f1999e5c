"""Is anyone still there? Keep-alive judgements beyond the ring, used when a quick answer matters.

The ring (each member watches the next one's keep-alive counter) notices a dead node within
`keep_alive_timeout`. Two moments need more than the ring:

* a local worker failed in a multi-node round: was it the first failure, or a consequence of a
  peer that just died (gloo: "connection closed")? `silent_peer` answers within
  `keep_alive_timeout`, usually within one keep-alive interval;
* a spare, or a node relaunched with the same run id, waits for a round whose members may all
  be dead: `wait_round_end_or_dead` ends such a round, so a relaunch forms a new job.
"""

from __future__ import annotations

import time
from typing import Protocol

from rally.rendezvous.base.membership import WAIT_SLICE_SECONDS
from rally.rendezvous.base.records import EndKind, RoundEnd
from rally.rendezvous.round_channel import RoundChannel
from rally.rendezvous.status.waiting import RendezvousView, spare_progress


class Rendezvous(RendezvousView, Protocol):
    """What a spare's wait needs of `protocol.Rendezvous` (declared here, so that the
    protocol, which calls into this module, is not imported back)."""

    def raise_if_closed(self) -> None: ...


def silent_peer(channel: RoundChannel) -> tuple[int, float] | None:
    """After a local failure: wait until every other member's keep-alives move (they are alive:
    the failure is this node's own) or one stays still for `keep_alive_timeout`, or its lease
    expires (leased stores: that node is gone, and the failure here is a consequence).

    Returns (the silent node's group rank, seconds it was silent), or None when every
    peer is alive or the round ended meanwhile. Bounded by keep_alive_timeout.
    """
    s = channel.settings
    peers = [g for g in range(channel.members) if g != channel.group_rank]
    start = {g: channel.alive_count(g) for g in peers}
    began = time.monotonic()
    interval = min(s.keep_alive_interval, s.keep_alive_timeout / 3) / 2
    while peers:
        if channel.ended_within(interval):
            return None
        now = {g: channel.alive_count(g) for g in peers}
        silent_for = time.monotonic() - began
        expired = [g for g in peers if start[g] is not None and now[g] is None]
        if expired:  # its alive key held beats, and etcd deleted it: the lease ran out unrefreshed
            return expired[0], max(silent_for, s.keep_alive_timeout)
        peers = [g for g in peers if now[g] is None or now[g] == start[g]]
        if peers and silent_for > s.keep_alive_timeout:
            return peers[0], silent_for
    return None


def wait_round_end_or_dead(rdzv: Rendezvous, running: RoundChannel, deadline: float) -> RoundEnd:
    """Wait for the `running` round to end; end it ourselves when none of its members sends
    keep-alives any more (every node of the job died: a relaunch must form a new job, not wait
    forever). A progress line every few seconds; RendezvousError (one line) once `deadline` has passed."""
    r, members = running.r, running.members
    timeout = rdzv.settings.keep_alive_timeout
    last = [running.alive_count(g) for g in range(members)]
    last_change = time.monotonic()
    rdzv.waiting.begin()
    while not running.ended_within(min(timeout / 2, WAIT_SLICE_SECONDS, rdzv.waiting.interval)):
        rdzv.raise_if_closed()
        spare_progress(rdzv, r, members, deadline)
        now_counts = [running.alive_count(g) for g in range(members)]
        if now_counts != last:
            last, last_change = now_counts, time.monotonic()
        elif time.monotonic() - last_change > timeout:
            running.count_lost(members)
            silent = time.monotonic() - last_change
            detail = f"all {members} nodes of round {r} sent no keep-alive for {silent:.1f} s (they died); "
            detail += "forming a new round"
            return running.end(RoundEnd(EndKind.NODE_LOST, detail, "", {"group_rank": 0}))
    # wait: slice, said by rendezvous/protocol.py Rendezvous._wait_as_spare: a spare's wait
    return running.wait_end(WAIT_SLICE_SECONDS)
