"""Who arrived in a round, and in which order: arrival slots claimed with compare-and-set.

A node's arrival index decides its place in the round, so it must not rest on a value a
stranger can move. The round's `joined` counter is only a hint (where to look first) and a
wake-up: a node claims slot `idx` by writing its signed descriptor to `<r>/node/<idx>` with
compare_set, so exactly one node ever holds a slot, whatever happens to the counter (a stranger
who decrements it cannot give two nodes one index; one who pushes it past MAX, or nodes that died
between their `add` and their claim, cannot make a node a spare while slots are free).

These two functions are the whole arrival mechanism of the c10d protocol: a backend that orders
arrivals another way (etcd create revisions) replaces them, and nothing else.
"""

from __future__ import annotations

import time
from itertools import chain

from rally.rendezvous.kv import UntrustedValue
from rally.rendezvous.records import MAX_COUNT, NodeInfo
from rally.rendezvous.waiting import HOSTS_SHOWN, forming_text
from rally.rendezvous.waiting import RendezvousView as Rendezvous

# The arrival keys (rendezvous/protocol.py re-exports them with the rest of the protocol's keys).
CURRENT_ROUND = "current"  # counter: the round a late joiner starts from


def node_slot(r: int, idx: int) -> str:
    """Round r's arrival slot idx: the signed descriptor of the one node that claimed it."""
    return f"{r}/node/{idx}"


def joined_counter(r: int) -> str:
    """Round r's arrival counter: where a node looks for a free slot first; never an index."""
    return f"{r}/joined"


def claim_arrival_slot(rdzv: Rendezvous, r: int, me: NodeInfo) -> tuple[int, int] | None:
    """Claim this node's arrival slot in round r (its descriptor, written once); its index and the
    arrival counter as this node's arrival left it (how many had arrived: the protocol's first look
    at the round, with no read of its own), or None when all MAX slots hold other nodes (this
    node is late: a spare).

    O(1) store calls when nobody interferes: the counter's hint is free. A taken hint (the counter
    was moved back) tries the next slots; a hint at or past MAX is checked with one wait on every
    slot, and free slots are claimed from 0.
    """
    s = rdzv.settings
    hint = rdzv.store.arrive(joined_counter(r))
    if hint >= s.max_nodes and rdzv.store.try_wait([node_slot(r, i) for i in range(s.max_nodes)], 0.01):
        return None  # really full
    start = hint if 0 <= hint < s.max_nodes else 0
    for idx in chain(range(start, s.max_nodes), range(start)):  # not a list: O(1) when the hint is free
        try:
            won, _ = rdzv.store.set_once(node_slot(r, idx), me.to_json())
        except UntrustedValue as exc:  # a stranger's garbage holds it: not an arrival, not ours
            rdzv.on_status(f"skipping arrival slot {idx}: {exc}")
            continue
        if won:
            return idx, hint + 1
    return None


def valid_arrivals(rdzv: Rendezvous, r: int, count: int) -> tuple[list[int], list[NodeInfo]]:
    """The claimed slots of round r whose descriptors pass every check, in slot order.

    `count` (the counter, at most MAX) says how many to expect: the closer waits a third of
    `close_timeout` for them (a node counts itself in just before it claims), then takes the
    slots that exist, and any claimed beyond `count` (the counter was moved back). The
    descriptors are read together: one request (c10d: multi_get, etcd: a range), not one per node.
    """
    s = rdzv.settings
    names = [node_slot(r, i) for i in range(count)]
    everything = rdzv.store.try_wait(names, s.close_timeout / 3)
    beyond = count
    while beyond < s.max_nodes and rdzv.store.check(node_slot(r, beyond)):
        names.append(node_slot(r, beyond))
        beyond += 1
    # Every slot the wait and the checks saw exists: one read of them all (c10d: one multi_get).
    present = rdzv.store.read_each(names) if everything else rdzv.store.get_present(names)
    indices, nodes = [], []
    for name in names:
        value = present.get(name)
        try:
            if isinstance(value, UntrustedValue):
                raise value
            if value is not None:  # unclaimed slots are absent
                nodes.append(NodeInfo.load(value, rdzv.store.key(name)))
                indices.append(int(name.rsplit("/", 1)[1]))
        except UntrustedValue as exc:
            rdzv.on_status(f"ignoring a node descriptor: {exc}")
    return indices, nodes


def joined_hosts(rdzv: Rendezvous, r: int, count: int, limit: int) -> list[str]:
    """The hosts of the first `limit` claimed slots (for a progress line; unchecked slots skipped),
    read together: every waiting node prints one every few seconds, and at thousands of nodes one
    request each is what the store can take."""
    names = [node_slot(r, i) for i in range(min(count, limit))]
    hosts = []
    for name, value in rdzv.store.get_present(names).items():
        try:
            if isinstance(value, UntrustedValue):
                raise value
            hosts.append(NodeInfo.load(value, rdzv.store.key(name)).host)
        except UntrustedValue:
            continue
    return hosts


def forming_line(rdzv: Rendezvous, r: int, count: int, deadline: float, quorum_seen_at: float | None) -> str:
    """`round 0: waiting for 1 more node: 1 of 2 joined (node0); join_timeout in 583 s`."""
    s, now = rdzv.settings, time.monotonic()
    last_call = None if quorum_seen_at is None else quorum_seen_at + s.last_call_timeout - now
    hosts = joined_hosts(rdzv, r, count, HOSTS_SHOWN)
    return f"round {r}: " + forming_text(count, s.min_nodes, s.max_nodes, hosts, deadline - now, last_call)


def current_round(rdzv: Rendezvous, hint: int | None = None) -> int:
    """The round a node that joins now takes part in: the first without an end record. Rounds end
    in order; the `current` counter (`hint`: as the caller just read it) says where to look first
    (anyone can move it), and a search on the signed end records corrects it in O(log) reads."""

    def ended(r: int) -> bool:
        return r < 0 or rdzv.round_end(r) is not None

    hint = rdzv.store.counter(CURRENT_ROUND, MAX_COUNT) if hint is None else hint
    if ended(hint - 1) and not ended(hint):
        return hint
    lo, hi = 0, hint
    if ended(hint):  # the counter was moved back: find an unended round above it
        step = 1
        while ended(hint + step):
            step *= 2
        lo, hi = hint + step // 2 + 1, hint + step
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ended(mid) else (lo, mid)
    return lo
