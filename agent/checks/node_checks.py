"""Bad nodes never join: quarantine and the pre-flight check as one collaborator of the agent.

Its hooks (agent/base/collaborator.py) run at three moments of the agent's:

* `joined`, once the store is open: a node quarantined earlier in this job leaves at once;
* `workers_starting`, when a round has formed and its workers' store is known, before any worker
  starts: says which nodes were quarantined since, and runs the pre-flight probe
  (agent/checks/preflight.py), which may end the round to leave a failing or slow node out;
* `round_ended`, when a round has ended: counts its root cause against the culprit's host
  (agent/checks/quarantine.py); the culprit's own agent, quarantined, or a node the pre-flight left
  out, leaves with one line (exit code `EXIT_QUARANTINED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rally.agent.base.collaborator import Collaborator
from rally.agent.base.exit_codes import AgentExit
from rally.agent.checks.quarantine import EXIT_QUARANTINED, Quarantine
from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.protocol import Round, RoundEnd

if TYPE_CHECKING:  # the default path, without a pre-flight, imports nothing more
    from rally.agent.checks.preflight import Preflight, PreflightContext

__all__ = ["EXIT_QUARANTINED", "NodeChecks"]


class NodeChecks(Collaborator):
    """Quarantine and pre-flight for one agent (`store_call` is the agent's, so store trouble is one line)."""

    def __init__(self, ctx: PreflightContext, backend: Callable[[], str]):
        """`backend`: the process-group backend the job's workers would use (the observer knows the GPUs)."""
        self.ctx = ctx
        self.quarantine = Quarantine(ctx)
        self.preflight: Preflight | None = None
        if ctx.spec.preflight:
            from rally.agent.checks.preflight import Preflight

            self.preflight = Preflight(ctx, backend)

    def joined(self, store: KeyValueStore) -> None:
        if line := self.ctx.store_call(lambda: self.quarantine.at_join(store)):
            raise AgentExit(EXIT_QUARANTINED, line)  # quarantined earlier in this job
        if self.preflight is not None:
            self.preflight.start_template()  # loads torch for the probe while the rendezvous runs

    def workers_starting(self, rnd: Round, master: tuple[str, int]) -> RoundEnd | None:
        self.ctx.store_call(lambda: self.quarantine.announce(rnd.store, rnd.assignment.round))
        if self.preflight is None:
            return None
        return self.preflight.run(rnd, master)

    def round_ended(self, rnd: Round, end: RoundEnd) -> None:
        """This node leaves, quarantined now or left out by the pre-flight."""
        if self.preflight is not None and (line := self.preflight.left_out_line(rnd.assignment, end)):
            raise AgentExit(EXIT_QUARANTINED, line)
        if line := self.ctx.store_call(lambda: self.quarantine.after_round(rnd, end, self.ctx.hosts_store)):
            raise AgentExit(EXIT_QUARANTINED, line)

    def status_fields(self) -> dict[str, object]:
        """For this node's status record (`rally status`, /metrics): the last pre-flight's numbers."""
        return {"preflight": self.preflight.last if self.preflight is not None else None}
