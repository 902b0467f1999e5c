"""Sharded states (FSDP2, DTensors) through torch.distributed.checkpoint: DCP's own format and
planner, with rally's memory tier, fast path, replica on the next node, background persist and
allow-listed metadata. Built on agent/checkpoint/core only."""
