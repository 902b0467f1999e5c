"""What both checkpoint paths (whole states and sharded ones) are made of: the whole-state file
format, the digest and MAC that sign every checkpoint, the memory tier's shared-memory layout
and the worker's client of it, the save fast path's layout record and the resume prefetch.
Imports nothing else of the checkpoint room."""
