"""What the agent learns about its workers (exits, heartbeats, hangs and who really hung,
resources, GPUs, stragglers) and where it shows it: the status record, the live view, /metrics."""
