"""Quarantine (`--quarantine-after K`, `--quarantine-window`): a node that keeps failing the job is kept out.

A node with a bad link, bad memory or a flaky GPU is the root cause of one failure after another;
without quarantine it joins every round and fails the job again each time. Every agent sees the
same round end (the first failure job-wide stands, rendezvous/protocol.py), so each one adds it to
the job's record of root causes by host (`rendezvous/status/job_notes.py`, keyed by round, so writing
it twice counts once). A host named as the root cause of K failures within the window is
quarantined, while the job can run without it (the round's other members are at least MIN):

* its own agent leaves the job at once (counted as lost, so the next round does not wait for it)
  with one line, exit code `EXIT_QUARANTINED`; under SLURM the line names the node as SLURM does,
  so the user can exclude it when the job is requeued. Started again, it leaves at join;
* the other agents say so in a line and in their report.json (`quarantined`); `rally status`
  lists it (rendezvous/status/reader.py).

Worker failures and hangs count, and node losses where the lost node's host is known.
"""

from __future__ import annotations

import time
from typing import Any

from rally.agent.base.collaborator import AgentContext
from rally.agent.display import console
from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.protocol import EndKind, Round, RoundEnd
from rally.rendezvous.status.job_notes import add_quarantined, load_node_failures, load_quarantined, save_failures

# Exit code of an agent whose node is quarantined: neither success nor a job failure.
EXIT_QUARANTINED = 3
ROOT_CAUSE_KINDS = (EndKind.WORKER_FAILED, EndKind.WORKER_HUNG, EndKind.NODE_LOST)


def record_failure(record: dict[str, Any], host: str, round_no: int, now: float) -> None:
    """Add round `round_no`'s failure to `host`'s entries (each round counts once)."""
    entries = record["failures"].setdefault(host, [])
    if not any(int(e[0]) == round_no for e in entries if isinstance(e, list) and e):
        entries.append([round_no, now])


def recent_failures(record: dict[str, Any], host: str, window: float, now: float) -> int:
    return sum(
        1 for e in record["failures"].get(host, []) if isinstance(e, list) and len(e) == 2 and e[1] >= now - window
    )


def excluded_line(host: str, reason: str, keep_node_out: str = "") -> str:
    """The one line a quarantined node's agent leaves with, and how the scheduler keeps the node out
    (`keep_node_out`: SchedulerView's, launcher/schedulers/)."""
    line = f"node {host} is quarantined ({reason}); this agent leaves the job, which goes on without it"
    return f"{line}; {keep_node_out}" if keep_node_out else line


class Quarantine:
    """One agent's part: record each round's root cause, leave when its own node is quarantined."""

    def __init__(self, ctx: AgentContext):
        """Off for a single-node job (it has no node to keep out: no store call there)."""
        self.spec = ctx.spec
        self.enabled = bool(ctx.spec.quarantine_after) and ctx.plan.settings.max_nodes > 1
        self.host = ctx.host
        self.events = ctx.events
        self.report = ctx.report
        # report.json's `quarantined`: host -> why, every node this one saw quarantined in the job
        self.quarantined: dict[str, str] = {}
        self.report.notes["quarantined"] = self.quarantined
        self.say = console.say
        self.warn = console.warn
        self.announced: set[str] = set()

    def at_join(self, store: KeyValueStore) -> str | None:
        """Started again on a quarantined node: the line to leave with, else None."""
        if not self.enabled:
            return None
        reason = load_quarantined(store).get(self.host)
        if reason is None:
            return None
        self.report.outcome = "quarantined"
        return excluded_line(self.host, reason, self.spec.scheduler.keep_node_out)

    def after_round(self, rnd: Round, end: RoundEnd, hosts_store: bool) -> str | None:
        """Count the round's root cause; the line to leave with if this node is now quarantined.

        Only the culprit's own agent decides (it alone knows whether it hosts the store, which
        must stay); the others learn of it from the record when the next round forms (`announce`)."""
        a, store, min_nodes = rnd.assignment, rnd.store, rnd.settings.min_nodes
        host = end.node or (end.info or {}).get("host") or ""
        if not self.enabled or end.kind not in ROOT_CAUSE_KINDS or not host:
            return None
        now = time.time()
        record = load_node_failures(store)
        record_failure(record, host, a.round, now)
        count = recent_failures(record, host, self.spec.quarantine_window, now)
        goes_on = not end.is_failure or a.restart_count + 1 <= self.spec.max_restarts
        save_failures(store, record["failures"])
        if host != self.host or count < self.spec.quarantine_after or not goes_on:
            return None
        window, after = self.spec.quarantine_window, self.spec.quarantine_after
        reason = f"the root cause of {count} failures within {window:g} s, --quarantine-after {after}"
        stays = (
            f"the job needs it (fewer than MIN={min_nodes} nodes without it)"
            if a.group_world_size - 1 < min_nodes
            else ""
        )
        stays = stays or ("it hosts the rendezvous store" if hosts_store else "")
        if stays:
            self.warn(f"node {host} was {reason}, but {stays}: it stays in")
            return None
        add_quarantined(store, host, reason)
        rnd.channel.count_lost(1)  # the next round need not wait for this node
        self.quarantined[host] = reason
        self.report.outcome = "quarantined"
        self.events.emit("node_quarantined", round=a.round, node=host, failures=count, reason=reason)
        return excluded_line(host, reason, self.spec.scheduler.keep_node_out)

    def announce(self, store: KeyValueStore, round_no: int) -> None:
        """When a round forms: say which nodes were quarantined since the last one."""
        if not self.enabled:
            return
        for host, reason in load_quarantined(store).items():
            if host not in self.announced and host != self.host:
                self.announced.add(host)
                self.quarantined[host] = reason
                self.say(f"node {host} is quarantined ({reason}); the job goes on without it")
                self.events.emit("node_quarantined", round=round_no, node=host, reason=reason)
