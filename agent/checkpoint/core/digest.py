"""The digest a checkpoint's MAC signs: SHA-256 of fixed-size leaves, on several threads, then a root.

Why a tree: one SHA-256 (or HMAC) over a whole checkpoint runs on one core, 1-3 s per GiB, in
the disk path's reload and in the time until a step is durable. Cut into `LEAF`-byte leaves,
the leaves are hashed on a few threads at once (hashlib releases the GIL for large buffers), and
the root is one SHA-256 over the length, the leaf size and the leaves' digests, in order. The
root binds every byte (SHA-256 resists collisions, so no other bytes give the same leaves), and
the MAC is then computed over the root alone (agent/checkpoint/core/auth.py, `auth.seal`): the
expensive pass is made once however many keys a verifier tries. SHA-256 rather than BLAKE2b:
CPUs with SHA instructions (x86 SHA-NI, ARMv8) hash SHA-256 faster than BLAKE2b's software, and
OpenSSL picks them up; measured here (bench/checkpoint_mac.py) BLAKE2b was the slower of the two.

No CRC beside it: a MAC over every byte already rejects any damage a CRC would, so a signed
checkpoint is read once, for the digest.

Standard library only: the agent, the holder and the flush helper use it without torch.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

# What a digest reads and a writer writes: any bytes-like object (memoryview of a slot, a mapping):
# the buffer protocol to the type checker, its common classes at run time.
if TYPE_CHECKING:
    from typing_extensions import Buffer as BytesLike
else:
    BytesLike = bytes | bytearray | memoryview


LEAF = 8 << 20
"""Bytes per leaf (8 MiB: few tasks per GiB, and any checkpoint above a few MiB spreads over threads)."""
THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads hashing leaves: a few, since the persister shares the node with training."""
_TAG = b"rally-tree-sha256-v1\0"

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """This process's pool (made again in a forked child: a parent's threads do not survive a fork)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = ThreadPoolExecutor(THREADS, thread_name_prefix="rally-digest"), os.getpid()
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool and lock are not this process's (its threads are gone)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _leaf(chunk: memoryview) -> bytes:
    """One leaf's digest; the view is released here, before the future says done, so the caller
    may close the mapping under it as soon as `TreeDigest.root` returns."""
    try:
        return hashlib.sha256(chunk).digest()
    finally:
        chunk.release()


class TreeDigest:
    """Feed the bytes in any pieces (`update`); `root` gives the digest of all of them.

    Leaves start at multiples of `LEAF`. A leaf that lies whole inside one piece is hashed
    on the pool; a leaf split between pieces is hashed here, piece by piece.
    """

    def __init__(self) -> None:
        self.length = 0
        self._leaves: list[bytes | Future[bytes]] = []
        self._open: Any = None  # hashlib object of the leaf being filled, or None at a boundary
        self._filled = 0

    def update(self, data: BytesLike, *, borrowed: bool = False) -> None:
        """Add `data`. `borrowed`: the caller keeps `data` alive and unchanged until `root`
        (a mapping), so its leaves may still be hashing when this returns; otherwise they are done."""
        with memoryview(data) as whole, whole.cast("B") as view:
            pending: list[Future[bytes]] = []
            at, total = 0, view.nbytes
            while at < total:
                if self._filled == 0 and total - at >= LEAF:  # a whole leaf in this piece: on the pool
                    future = _executor().submit(_leaf, view[at : at + LEAF])
                    self._leaves.append(future)
                    pending.append(future)
                    at += LEAF
                    continue
                take = min(LEAF - self._filled, total - at)
                if self._open is None:
                    self._open = hashlib.sha256()
                self._open.update(view[at : at + take])
                self._filled += take
                at += take
                if self._filled == LEAF:
                    self._leaves.append(self._open.digest())
                    self._open, self._filled = None, 0
            self.length += total
            if not borrowed:
                for future in pending:
                    future.result()  # the caller's buffer may change once this returns

    def settle(self) -> None:
        """Wait for the leaves still hashing (before a borrowed mapping is closed on an error)."""
        for leaf in self._leaves:
            if not isinstance(leaf, bytes):
                leaf.exception()

    def root(self) -> bytes:
        """The digest of every byte fed: SHA-256 over the length, the leaf size and the leaves in order."""
        leaves = [leaf if isinstance(leaf, bytes) else leaf.result() for leaf in self._leaves]
        if self._open is not None:
            leaves.append(self._open.digest())
        return hashlib.sha256(_TAG + struct.pack("<QQ", self.length, LEAF) + b"".join(leaves)).digest()


def of(data: BytesLike) -> bytes:
    """The root of `data` (bytes, a mapping) hashed at once, its leaves on the pool."""
    tree = TreeDigest()
    tree.update(data, borrowed=True)
    return tree.root()
