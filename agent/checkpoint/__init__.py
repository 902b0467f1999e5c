"""The checkpoint room: a holder process of the agent keeps each rank's newest copies in memory
and makes them durable in the background. Layered inside: `core` (formats, MAC, the memory
tier's layout and the worker's client), `sharded` (DCP) on top of it, and here what joins the
two: the holder, its slots and persister, the checkpoint directory, and the agent's side (with
what the node tells each round about its checkpoints, holdings.py)."""
