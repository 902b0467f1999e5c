"""What a node says while it waits in the rendezvous: one progress line every few seconds, and
the line that names a run-id clash. Text and timing only: the protocol decides when it waits.

A wait that prints nothing looks like a hang; a wait that prints what it waits for and until when
(`waiting for 1 more node: 1 of 2 joined (node0); join_timeout in 583 s`) tells the user which
node to start, or that the job they joined is not theirs. The same line goes to `rally status`
(the node's status record), so a waiting node is visible from anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.base.membership import RendezvousError, RendezvousSettings
from rally.rendezvous.base.records import NodeInfo, RoundEnd
from rally.rendezvous.status.board import StatusBoard

# How often a waiting node prints (and publishes) what it waits for; the first line comes after
# one interval, so a rendezvous that forms at once prints nothing.
WAIT_PROGRESS_SECONDS = 5.0
# How many of the joined nodes a progress line names.
HOSTS_SHOWN = 4
# A job of more nodes than this waits (and prints) that many intervals longer: see `progress_interval`.
PROGRESS_NODES = 1024


def progress_interval(max_nodes: int) -> float:
    """How often a node waiting in the rendezvous wakes to print and publish its line: every
    WAIT_PROGRESS_SECONDS up to PROGRESS_NODES nodes, one interval more per PROGRESS_NODES above.
    Each line costs the store a few requests per node (the count, the first hosts, the status
    record, a new wait or watch): at 4,096 nodes, lines every 5 s were more requests than a
    one-member etcd serves, so the lines themselves kept the round from forming."""
    return WAIT_PROGRESS_SECONDS * max(1, -(-max_nodes // PROGRESS_NODES))


class RendezvousView(Protocol):
    """What these lines and the arrival slots (rendezvous/arrival.py) need of `protocol.Rendezvous`
    (declared here, so that the protocol, which calls into both, is not imported back)."""

    settings: RendezvousSettings
    store: KeyValueStore
    me: NodeInfo
    last_round: int | None
    waiting: WaitProgress
    status: StatusBoard

    def on_status(self, line: str) -> None: ...

    def round_end(self, round_no: int) -> RoundEnd | None: ...


class WaitProgress:
    """Throttles progress lines: `begin()` when a wait starts, `tick(line)` as often as it likes."""

    def __init__(self, emit: Callable[[str], None], interval: float = WAIT_PROGRESS_SECONDS):
        self.emit = emit
        self.interval = interval
        self.due = time.monotonic() + interval
        self.last: tuple[float, str] | None = None  # (when, line): the node's status record shows it while fresh

    def begin(self) -> None:
        self.due = time.monotonic() + self.interval

    def tick(self, line: Callable[[], str]) -> None:
        """Emit `line()` when an interval has passed since the wait began or the last line."""
        now = time.monotonic()
        if now >= self.due:
            self.due = now + self.interval
            text = line()
            self.last = (now, text)
            self.emit(text)


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def hosts_text(hosts: list[str], count: int) -> str:
    shown = ", ".join(hosts[:HOSTS_SHOWN])
    more = count - min(len(hosts), HOSTS_SHOWN)
    return f" ({shown}{f', +{more} more' if more > 0 and shown else ''})" if shown else ""


def forming_text(
    count: int, min_nodes: int, max_nodes: int, hosts: list[str], join_left: float, last_call_left: float | None
) -> str:
    """`waiting for 1 more node: 1 of 2 joined (node0); join_timeout in 583 s`."""
    joined = hosts_text(hosts, count)
    if count < min_nodes:
        return (
            f"waiting for {plural(min_nodes - count, 'more node')}: {count} of {min_nodes} joined{joined}; "
            f"join_timeout in {join_left:.0f} s"
        )
    closes = (
        f"closes in {last_call_left:.0f} s (last call)"
        if last_call_left is not None
        else "closes when the expected nodes are in"
    )
    return (
        f"waiting for more nodes: {count} of at most {max_nodes} joined{joined}; the round {closes}; join_timeout "
        f"in {join_left:.0f} s"
    )


def spare_line(round_no: int, members: int, max_nodes: int, join_left: float) -> str:
    return (
        f"waiting as a spare: round {round_no} runs with {members} of at most {max_nodes} nodes; this node joins when "
        f"one leaves or the round ends; join_timeout in {join_left:.0f} s"
    )


def started_text(started: dict | None) -> str:
    """`started by node0 (pid 123) at 12:01:02 UTC` from the job's signed start record."""
    if not started:
        return "started by an unknown node"
    host = str(started.get("host", "?"))[:100]
    pid = str(started.get("node_id", "")).split(":")[1:2]
    when = started.get("time")
    at = time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(when)) if isinstance(when, (int, float)) else ""
    return f"started by {host}{f' (pid {pid[0]})' if pid else ''}{at}"


def clash_line(rdzv: RendezvousView, state: str, this_node: str) -> str:
    """One line for a node that found its run id taken by a job it never took part in: whose job,
    since when, and how to keep two jobs apart."""
    run_id = rdzv.store.prefix.removeprefix("rally/").rstrip("/")
    return (
        f"run id '{run_id}' at {rdzv.store.describe} {state}, {started_text(rdzv.status.job_started())}; {this_node}. "
        f"If this is a different job, give it a distinct --rdzv-id (e.g. --rdzv-id {run_id}-{int(time.time())}) "
        "or a job token (RALLY_JOB_TOKEN), or use another --rdzv-endpoint port"
    )


def ended_line(rdzv: RendezvousView, end: RoundEnd) -> str:
    """The job has ended; to a node that never took part, most likely another job's run id."""
    if rdzv.last_round is not None:
        return f"job already ended ({end.kind}): {end.detail}"
    return clash_line(
        rdzv, f"belongs to a job that already ended ({end.kind}: {end.detail[:200]})", "this node ran nothing"
    )


def spare_notice(rdzv: RendezvousView, members: int) -> str:
    """A node that found the job full: a spare; one that never took part names the clash."""
    s = rdzv.settings
    if rdzv.last_round is None:
        return clash_line(
            rdzv,
            f"is in use by a running job ({members} of at most {s.max_nodes} nodes)",
            "this node waits as its spare",
        )
    return f"the job is full ({members} of at most {s.max_nodes} nodes); waiting as a spare until a node leaves"


def spare_progress(rdzv: RendezvousView, round_no: int, members: int, deadline: float) -> None:
    """A spare's progress line while round `round_no` runs; past `deadline`, RendezvousError (one line)."""
    s, left = rdzv.settings, deadline - time.monotonic()
    if left <= 0:
        if rdzv.last_round is None:
            raise RendezvousError(clash_line(
                rdzv, f"is in use by a running job ({members} of at most {s.max_nodes} nodes) and no node left it",
                f"this node waited join_timeout ({s.join_timeout:g} s) as its spare",
            ))  # fmt: skip
        raise RendezvousError(
            f"waited join_timeout ({s.join_timeout:g} s) as a spare of round {round_no} ({members} nodes) and no node "
            "left it; raise join_timeout to wait longer"
        )
    rdzv.waiting.tick(lambda: spare_line(round_no, members, s.max_nodes, left))


def announce_wait(rdzv: RendezvousView, line: str) -> None:
    """A progress line of a long wait: to the console, and to `rally status` (the node's record)."""
    rdzv.on_status(line)
    # wait: not_a_wait: builds a status record
    rdzv.status.publish(waiting_record(rdzv.me.host, rdzv.me.node_id, line))


def waiting_record(host: str, node_id: str, line: str) -> dict[str, Any]:
    """The status record of a node that waits in the rendezvous (`rally status` shows the line)."""
    return {"host": host, "node_id": node_id, "waiting": line, "updated": time.time(), "workers": []}
