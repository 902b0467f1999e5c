"""Who arrived in a round, and in which order: arrival slots claimed with compare-and-set.

A node's arrival index decides its place in the round, so it must not rest on a value a
stranger can move. The round's `joined` counter is only a hint (where to look first) and a
wake-up: a node claims slot `idx` by writing its signed descriptor to `<r>/node/<idx>` with
compare_set, so exactly one node ever holds a slot, whatever happens to the counter (a stranger
who decrements it cannot give two nodes one index; one who pushes it past MAX, or nodes that died
between their `add` and their claim, cannot make a node a spare while slots are free).

A store that orders arrivals itself (`OrderedArrivals`: etcd, by create revision) takes the
other way here: a node's descriptor is its increment of the counter, written in the same request
that counts it in and reads the round's record, so a node's place cannot be moved either and an
arrival is one request instead of two (and what it read of the round's record, `Arrival.seen`,
is the protocol's first look at it: no read of its own, and the wait after it starts from there).
Its assignment key is named by that increment's create revision, its `slot`.

`claim_arrival_slot`, `valid_arrivals`, `wait_for_more` and `joined_hosts` are the whole arrival
mechanism: the protocol (rendezvous/protocol.py) asks them, whichever way the store orders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import chain

from rally.rendezvous.base.keys import CURRENT_ROUND
from rally.rendezvous.base.kv import Checked, OrderedArrivals, Seen, UntrustedValue
from rally.rendezvous.base.records import MAX_COUNT, NodeInfo
from rally.rendezvous.status.waiting import HOSTS_SHOWN, forming_text
from rally.rendezvous.status.waiting import RendezvousView as Rendezvous


def node_slot(round_no: int, idx: int) -> str:
    """Round `round_no`'s arrival slot idx: the signed descriptor of the one node that claimed it."""
    return f"{round_no}/node/{idx}"


def joined_counter(round_no: int) -> str:
    """Round `round_no`'s arrival counter: where a node looks for a free slot first; never an index."""
    return f"{round_no}/joined"


def closed_key(round_no: int) -> str:
    """Round `round_no`'s record (first wins): written by its closer, waited for by every node."""
    return f"{round_no}/closed"


@dataclass(frozen=True)
class Arrival:
    """A node's arrival in a round: `slot` names its assignment key (`<r>/assign/<attempt>/<slot>`),
    `place` is its 0-based place in the arrival order, `arrived` the count its arrival left, `seen`
    what the arrival read of the round's record where the store reads it in the same request
    (`OrderedArrivals`), else None."""

    slot: int
    place: int
    arrived: int
    seen: Seen | None = None


@dataclass(frozen=True)
class Arrived:
    """What the closer found: the arrival count (at most MAX), the valid descriptors in arrival
    order with their slots, and `newest`, what `wait_for_more` waits past."""

    count: int
    slots: list[int]
    nodes: list[NodeInfo]
    newest: int


def claim_arrival_slot(rdzv: Rendezvous, round_no: int, me: NodeInfo) -> Arrival | None:
    """Claim this node's arrival slot in round `round_no` (its descriptor, written once), or None when all MAX
    slots hold other nodes (this node is late: a spare). `arrived` is the arrival counter as this
    node's arrival left it (how many had arrived: the protocol's first look at the round, with no
    read of its own).

    O(1) store calls when nobody interferes: the counter's hint is free. A taken hint (the counter
    was moved back) tries the next slots; a hint at or past MAX is checked with one wait on every
    slot, and free slots are claimed from 0. An `OrderedArrivals` store: one request.
    """
    s = rdzv.settings
    if isinstance(rdzv.store, OrderedArrivals):
        return _placed(
            rdzv, round_no, *rdzv.store.arrive_holding(joined_counter(round_no), me.to_json(), closed_key(round_no))
        )
    hint = rdzv.store.arrive(joined_counter(round_no))
    # Past MAX: full, or the counter was moved. Asked once, never waited for (it used to be a
    # 10 ms wait that, when a slot was free, always ran out): one request on c10d and etcd.
    if hint >= s.max_nodes and rdzv.store.all_present([node_slot(round_no, i) for i in range(s.max_nodes)]):
        return None  # really full
    start = hint if 0 <= hint < s.max_nodes else 0
    for idx in chain(range(start, s.max_nodes), range(start)):  # not a list: O(1) when the hint is free
        try:
            won, _ = rdzv.store.set_once(node_slot(round_no, idx), me.to_json())
        except UntrustedValue as exc:  # a stranger's garbage holds it: not an arrival, not ours
            rdzv.on_status(f"skipping arrival slot {idx}: {exc}")
            continue
        if won:
            return Arrival(idx, idx, hint + 1)
    return None


def _placed(rdzv: Rendezvous, round_no: int, place: int, slot: int, seen: Seen) -> Arrival | None:
    """An `OrderedArrivals` arrival at `place`: this node's, or None when it is late (a spare)."""
    if place < rdzv.settings.max_nodes:
        return Arrival(slot, place, place + 1, seen)
    # Past MAX: late, unless arrivals before it were not valid nodes (a stranger's keys, skipped
    # as on c10d): its place among the valid ones decides (one range, only for these nodes).
    before = valid_arrivals(rdzv, round_no)
    return Arrival(slot, before.slots.index(slot), before.count, seen) if slot in before.slots else None


def first_look(
    rdzv: Rendezvous, me: NodeInfo, ends: list[str]
) -> tuple[tuple[Arrival | None] | None, int, dict[str, Checked]]:
    """A node's first look at the job: the `current` hint and the checked end records `ends` that
    exist. On an `OrderedArrivals` store, when the job is fresh (the hint and every end record
    absent: its first round), the same request is this node's arrival in round 0 (`arrive_if_fresh`):
    then the first item is (its `Arrival`, or None: late, a spare), else None."""
    if isinstance(rdzv.store, OrderedArrivals):
        arrived, hint, present = rdzv.store.arrive_if_fresh(
            joined_counter(0), me.to_json(), closed_key(0), CURRENT_ROUND, MAX_COUNT, ends
        )
        return ((_placed(rdzv, 0, *arrived),) if arrived is not None else None), hint, present
    hint, present = rdzv.store.counter_and_present(CURRENT_ROUND, MAX_COUNT, ends)
    return None, hint, present


def valid_arrivals(rdzv: Rendezvous, round_no: int) -> Arrived:
    """The claimed slots of round `round_no` whose descriptors pass every check, in arrival order.

    The counter (at most MAX) says how many to expect: the closer waits a third of
    `close_timeout` for them (a node counts itself in just before it claims), then takes the
    slots that exist, and any claimed beyond the count (the counter was moved back). The
    descriptors are read together, by the wait that saw them: one request (c10d: multi_get),
    not one per node. An
    `OrderedArrivals` store: the first MAX valid increments, from one range of them all (count
    and descriptor are one write there, so there is nothing to wait for).
    """
    s = rdzv.settings
    if isinstance(rdzv.store, OrderedArrivals):
        return _valid_in_order(rdzv, rdzv.store, round_no)
    count = min(rdzv.store.counter(joined_counter(round_no), MAX_COUNT), s.max_nodes)
    names = [node_slot(round_no, i) for i in range(count)]
    # wait: slice: close_timeout / 3
    everything = rdzv.store.wait_and_read(names, s.close_timeout / 3)
    present = dict(rdzv.store.get_present(names) if everything is None else everything)
    # Slots claimed beyond the count (it was moved back), until the first free one; nodes wait for
    # slots (`claim_arrival_slot`), so each is read as a key with waiters (`get_if_present`).
    while len(names) < s.max_nodes:
        name = node_slot(round_no, len(names))
        try:
            value: Checked | None = rdzv.store.get_if_present(name)
        except UntrustedValue as exc:
            value = exc
        if value is None:
            break
        names.append(name)
        present[name] = value
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
    return Arrived(count, indices, nodes, max(indices, default=-1))


def _valid_in_order(rdzv: Rendezvous, store: OrderedArrivals, round_no: int) -> Arrived:
    """`valid_arrivals` on a store that orders arrivals: the first MAX valid of them all, one range."""
    total, found = store.arrivals(joined_counter(round_no), 0)  # all: a stranger's keys take no place
    slots: list[int] = []
    nodes: list[NodeInfo] = []
    for slot, value in found:
        if len(nodes) == rdzv.settings.max_nodes:
            break
        try:
            if isinstance(value, UntrustedValue):
                raise value
            nodes.append(NodeInfo.load(value, rdzv.store.key(f"{joined_counter(round_no)} (arrival {slot})")))
            slots.append(slot)
        except UntrustedValue as exc:
            rdzv.on_status(f"ignoring a node descriptor: {exc}")
    newest = max((slot for slot, _ in found), default=0)
    return Arrived(min(total, rdzv.settings.max_nodes), slots, nodes, newest)


def wait_for_more(rdzv: Rendezvous, round_no: int, arrived: Arrived, timeout: float) -> bool:
    """Wait up to `timeout` for a node to arrive after those `arrived` holds (too few were valid)."""
    if isinstance(rdzv.store, OrderedArrivals):
        # wait: slice: the closer's close_timeout
        return rdzv.store.wait_arrival(joined_counter(round_no), arrived.newest, timeout)
    # wait: slice: the closer's close_timeout
    return rdzv.store.try_wait([node_slot(round_no, arrived.newest + 1)], timeout)


def joined_hosts(rdzv: Rendezvous, round_no: int, count: int, limit: int) -> list[str]:
    """The hosts of the first `limit` claimed slots (for a progress line; unchecked slots skipped),
    read together: every waiting node prints one every few seconds, and at thousands of nodes one
    request each is what the store can take."""
    if isinstance(rdzv.store, OrderedArrivals):
        where = rdzv.store.key(joined_counter(round_no))
        found = [(where, value) for _, value in rdzv.store.arrivals(joined_counter(round_no), min(count, limit))[1]]
    else:
        names = [node_slot(round_no, i) for i in range(min(count, limit))]
        found = [(rdzv.store.key(name), value) for name, value in rdzv.store.get_present(names).items()]
    hosts = []
    for key, value in found:
        try:
            if isinstance(value, UntrustedValue):
                raise value
            hosts.append(NodeInfo.load(value, key).host)
        except UntrustedValue:
            continue
    return hosts


def forming_line(rdzv: Rendezvous, round_no: int, count: int, deadline: float, quorum_seen_at: float | None) -> str:
    """`round 0: waiting for 1 more node: 1 of 2 joined (node0); join_timeout in 583 s`."""
    s, now = rdzv.settings, time.monotonic()
    last_call = None if quorum_seen_at is None else quorum_seen_at + s.last_call_timeout - now
    hosts = joined_hosts(rdzv, round_no, count, HOSTS_SHOWN)
    return f"round {round_no}: " + forming_text(count, s.min_nodes, s.max_nodes, hosts, deadline - now, last_call)


def current_round(rdzv: Rendezvous, hint: int | None = None) -> int:
    """The round a node that joins now takes part in: the first without an end record. Rounds end
    in order; the `current` counter (`hint`: as the caller just read it) says where to look first
    (anyone can move it), and a search on the signed end records corrects it in O(log) reads."""

    def ended(round_no: int) -> bool:
        return round_no < 0 or rdzv.round_end(round_no) is not None

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
