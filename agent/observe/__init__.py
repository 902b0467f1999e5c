"""What the agent learns about its workers (exits, heartbeats, resources, GPUs,
stragglers) and where it shows it: events.jsonl, the status record, the live view, /metrics."""
