"""One round's plumbing on this node: the worker group it starts (environment, logs, output),
the threads that watch the store while it runs (keep-alives, status, leases), the long waits
it shows, and its in-process restart (the workers parked and re-entered, the warm spares)."""
