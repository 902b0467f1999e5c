"""What every room of the agent stands on, and nothing above it: the job's spec, the agent's
states and exit codes, its event loop and events.jsonl, the collaborator protocol every feature of
the agent implements, the Linux calls rally wraps, and reading files someone else may have written.
Imports no other part of rally.agent."""
