"""One round's plumbing on this node: the worker group it starts (environment, logs, output),
the threads that watch the store while it runs (keep-alives, status, leases), and the long waits
it shows."""
