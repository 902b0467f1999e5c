"""How the agent leaves after a failed store call (`AgentExit` is agent/base/exit_codes.py's):
`store_failure_exit` maps one to an exit: a problem before the first round formed is bad input
(exit 2), a store lost, silent or tampered with once the job ran is an infrastructure failure
(exit 1). One mapping, so every store call of the main thread ends the same way."""

from __future__ import annotations

from rally.agent.base.exit_codes import EXIT_BAD_INPUT, EXIT_INFRASTRUCTURE, AgentExit
from rally.agent.report import store_lost_line
from rally.rendezvous.kv import StoreError, StoreTampered, UntrustedValue
from rally.rendezvous.membership import RendezvousError
from rally.rendezvous.store import StoreEndpoint


def store_failure_exit(
    exc: StoreError | RendezvousError, reached: bool, formed: bool, endpoint: StoreEndpoint | None
) -> AgentExit:
    """The exit for a failed store call: `reached` (the store answered once), `formed` (a round
    formed), `endpoint` the store as bound (its lost-store line names it)."""
    if isinstance(exc, (RendezvousError, UntrustedValue)):
        tampered = isinstance(exc, StoreTampered)  # a record deleted: never a setup problem
        return AgentExit(EXIT_BAD_INPUT if not formed and not tampered else EXIT_INFRASTRUCTURE, str(exc))
    if not reached or endpoint is None:  # never reached: a wrong or dead endpoint is a setup problem
        return AgentExit(EXIT_BAD_INPUT, str(exc))
    return AgentExit(EXIT_INFRASTRUCTURE, store_lost_line(exc, endpoint))
