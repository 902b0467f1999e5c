"""The agent's own exit codes (a worker's failure exits with the worker's status instead)."""

# A store that was lost, went silent or held values this job did not write; a hung worker.
EXIT_INFRASTRUCTURE = 1
# Bad input found only once the agent runs (a store that cannot be reached at start, a port in use).
EXIT_BAD_INPUT = 2
# The job was preempted (or hit its time limit) and stopped on purpose: retry later. EX_TEMPFAIL.
EXIT_PREEMPTED = 75


class AgentExit(Exception):
    """Leave the agent with this exit code, after its workers are stopped: raised anywhere in the
    main loop (a collaborator's hook too), with the one line that says why (or none)."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message)
        self.code = code
