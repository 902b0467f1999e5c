"""RALLY_CKPT_MEMORY_LIMIT, the bytes the memory tier's copies may take on a node, read in one place.

A module of its own, standard library only, because the launcher checks the variable before
anything starts (launcher/config.py: a bad value is one line and exit 2) and must not import the
agent's checkpoint machinery for it: that import cost every `rally` command that stops at bad
input ~0.1 s of CPU. agent/checkpoint/node_checkpoints.py passes the value on to the holder.
"""

from __future__ import annotations

import re

MEMORY_LIMIT_ENV = "RALLY_CKPT_MEMORY_LIMIT"
"""Bytes the tier's copies may take on this node in all (default: half of what is available)."""
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def memory_limit_bytes(text: str) -> int | None:
    """RALLY_CKPT_MEMORY_LIMIT as bytes: a number of bytes, or with a binary suffix (512M, 1G, 1.5TiB);
    None when unset. Anything else is a ValueError with the line to show (the launcher: exit 2)."""
    if not text.strip():
        return None
    match = _SIZE.fullmatch(text)
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()]) if match else 0
    if not match or not 0 < size < 1 << 62:
        raise ValueError(
            f"{MEMORY_LIMIT_ENV}={text[:40]!r}: expected the bytes the in-memory checkpoints may take on this "
            "node, e.g. 8G, 512M or 1073741824"
        )
    return size
