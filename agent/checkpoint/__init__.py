"""The checkpoint tier: a holder process of the agent keeps each rank's newest copies in
memory and makes them durable in the background; the agent's end (start, fence by round, resume
step), the worker's end (`rally.job.save`/`load_latest`), and sharded states through
torch.distributed.checkpoint with a replica on the next node."""
