"""Bad nodes never join: the agent's three points of contact with quarantine and the pre-flight check.

The agent calls `NodeChecks` at three moments, each one line in agent/agent.py:

* `at_join`, once the store is open: a node quarantined earlier in this job leaves at once;
* `round_formed`, when a round has formed and its workers' store is known, before any worker
  starts: says which nodes were quarantined since, and runs the pre-flight probe (agent/checks/preflight.py),
  which may end the round to leave a failing or slow node out;
* `after_round`, when a round has ended: counts its root cause against the culprit's host
  (agent/checks/quarantine.py); the culprit's own agent, quarantined, or a node the pre-flight left out,
  gets the one line to leave with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rally.agent.base.event_log import EventLog
from rally.agent.base.spec import JobSpec
from rally.agent.checks.quarantine import EXIT_QUARANTINED, Quarantine
from rally.agent.display import console
from rally.rendezvous.protocol import Round, RoundEnd

__all__ = ["EXIT_QUARANTINED", "NodeChecks"]


class NodeChecks:
    """Quarantine and pre-flight for one agent (`store_call` is the agent's, so store trouble is one line)."""

    def __init__(
        self,
        spec: JobSpec,
        host: str,
        events: EventLog,
        report: Any,
        store_call: Callable[..., Any],
        multi_node: bool,
        template: Callable[[], Any],
        base_env: dict[str, str],
        run_dir: Path,
        backend: Callable[[], str],
        announce: Callable[[str], None],
    ):
        """`report` is the agent's JobReport (outcome, quarantined hosts); `multi_node`: the job may
        have more than one node (a single-node job has no node to keep out: quarantine makes no
        store call there). For the probe: `template` gives the agent's worker template (or None),
        `backend` the process-group backend the job's workers would use, `announce` says its
        waits' lines (the console and this node's status record: agent/rounds/node_waits.py)."""
        self.store_call = store_call
        self.quarantine = Quarantine(spec, host, events, report, console.say, console.warn, multi_node)
        self.preflight: Any = None
        if spec.preflight:  # the default path without it imports nothing more
            from rally.agent.checks.preflight import Preflight

            self.preflight = Preflight(
                spec, host, events, report, store_call, template, base_env, run_dir, backend, announce
            )

    def at_join(self, store: Any) -> str | None:
        line = self.store_call(lambda: self.quarantine.at_join(store))
        if line is None and self.preflight is not None:
            self.preflight.start_template()  # loads torch for the probe while the rendezvous runs
        return line

    def round_formed(self, rnd: Round, master: tuple[str, int]) -> RoundEnd | None:
        self.store_call(lambda: self.quarantine.announce(rnd.store, rnd.a.round))
        if self.preflight is None:
            return None
        return self.preflight.run(rnd, master)

    def after_round(self, rnd: Round, end: RoundEnd, hosts_store: bool) -> str | None:
        if self.preflight is not None and (line := self.preflight.left_out_line(rnd.a, end)):
            return line
        return self.store_call(lambda: self.quarantine.after_round(rnd, end, hosts_store))

    def status_fields(self) -> dict:
        """For this node's status record (`rally status`, /metrics): the last pre-flight's numbers."""
        return {"preflight": self.preflight.last if self.preflight is not None else None}
