"""The per-node agent: spawns workers, watches them, and restarts the job through the rendezvous."""
