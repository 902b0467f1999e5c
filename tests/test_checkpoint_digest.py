"""The digest a checkpoint's MAC signs (agent/checkpoint/core/digest.py) and the whole-state footer over it.

No torch: the persister writes a slot (a memfd) of arbitrary bytes as the holder does, and
checkpoint_file verifies the result. The bytes span several leaves, so the threads' part is used.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rally.agent.checkpoint import persist
from rally.agent.checkpoint.core import checkpoint_file, digest

PAYLOAD = os.urandom(3 * digest.LEAF) + b"tail of a partial leaf"  # every leaf different


def persisted(directory: Path, data: bytes, step: int = 4) -> Path:
    slot = os.memfd_create("slot")
    try:
        os.write(slot, data)
        return persist.persist(slot, len(data), directory, step, 3)
    finally:
        os.close(slot)


# Pure computation: a busy CPU changes nothing here.
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_the_digest_is_the_same_however_the_bytes_are_fed() -> None:
    whole = digest.of(PAYLOAD)
    for piece in (1, 4096, 3_000_001, digest.LEAF, digest.LEAF + 1):
        tree = digest.TreeDigest()
        for start in range(0, len(PAYLOAD), piece * 97 if piece == 1 else piece):  # bytes, then bigger pieces
            tree.update(PAYLOAD[start : start + (piece * 97 if piece == 1 else piece)])
        assert tree.root() == whole
    assert digest.of(PAYLOAD[:-1]) != whole  # the length is bound


# Pure computation on a private file: a busy CPU changes nothing here.
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_a_flipped_byte_or_swapped_leaves_in_a_signed_file_are_refused(tmp_path: Path) -> None:
    path = persisted(tmp_path, PAYLOAD)
    fd, verified = checkpoint_file.open_mapped_verified(path)
    os.close(fd)
    assert verified.signed and verified.step == 4
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[digest.LEAF + 12345] ^= 1  # inside the second leaf, hashed on a thread
    leaf = digest.LEAF
    swapped = good[leaf : 2 * leaf] + good[:leaf] + good[2 * leaf :]  # same leaves, other order
    for bad in (bytes(flipped), swapped):
        path.write_bytes(bad)
        with pytest.raises(checkpoint_file.DamagedCheckpoint, match="not signed with this job's checkpoint key"):
            checkpoint_file.open_mapped_verified(path)
