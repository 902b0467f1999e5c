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

from typing import Any

from rally.agent.checks.quarantine import EXIT_QUARANTINED, Quarantine
from rally.agent.display import console
from rally.rendezvous.protocol import Assignment, RoundEnd

__all__ = ["EXIT_QUARANTINED", "NodeChecks"]


class NodeChecks:
    """Quarantine and pre-flight for one agent (`store_call` is the agent's, so store trouble is one line)."""

    def __init__(self, agent: Any):
        """Takes from `agent` (agent/agent.py) its spec, host, events, report, store_call, base
        environment, run directory, and, for the probe, its worker template and GPUs."""
        spec, self.store_call = agent.spec, agent.store_call
        # A single-node job has no node to keep out: quarantine makes no store call there.
        self.quarantine = Quarantine(spec, agent.host, agent.events, agent.report, console.say, console.warn, agent.plan.settings.max_nodes > 1)
        self.preflight: Any = None
        if spec.preflight:  # the default path without it imports nothing more
            from rally.agent.checks.preflight import Preflight

            self.preflight = Preflight(
                spec, agent.host, agent.events, agent.report, agent.store_call, lambda: agent.template, agent.base_env, agent.logs.run_dir,
                lambda: "nccl" if agent.observer.gpu is not None else "gloo",  # the backend the job's workers would use
                agent.waits.announce,  # its waits' lines: the console and this node's status record
            )

    def at_join(self, store: Any) -> str | None:
        line = self.store_call(lambda: self.quarantine.at_join(store))
        if line is None and self.preflight is not None:
            self.preflight.start_template()  # loads torch for the probe while the rendezvous runs
        return line

    def round_formed(self, rdzv: Any, a: Assignment, master: tuple[str, int]) -> RoundEnd | None:
        self.store_call(lambda: self.quarantine.announce(rdzv.store, a.round))
        if self.preflight is None:
            return None
        return self.preflight.run(rdzv, a, master)

    def after_round(self, rdzv: Any, a: Assignment, end: RoundEnd, hosts_store: bool) -> str | None:
        if self.preflight is not None and (line := self.preflight.left_out_line(a, end)):
            return line
        return self.store_call(lambda: self.quarantine.after_round(rdzv, a, end, hosts_store))

    def status_fields(self) -> dict:
        """For this node's status record (`rally status`, /metrics): the last pre-flight's numbers."""
        return {"preflight": self.preflight.last if self.preflight is not None else None}
