"""c10d stores and the round-based rendezvous protocol that agents use to form a job."""
