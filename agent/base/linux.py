"""The few Linux calls rally needs that the standard library does not wrap (stdlib only).

Shared by the agent (agent/guard/processes.py) and the worker template (agent/template/server.py), which runs in
every worker and so must not import anything heavy.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

# Loaded at import, not on first use: prctl is also called between fork and exec
# (processes._die_with_parent), where loading a library is not safe.
# One handle for the process: each ctypes.CDLL makes classes of its own (reference cycles), so one
# made per call is garbage, which job.run's gc.freeze at the next entry would keep for good.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
# glibc's malloc_trim; None under another C library
_malloc_trim = getattr(_libc, "malloc_trim", None)
_libc.putenv.argtypes = [ctypes.c_void_p]


def prctl(option: int, value: int) -> int:
    """prctl(2) with one argument; returns its result (-1 with errno set on failure)."""
    return _libc.prctl(option, value, 0, 0, 0)


def putenv_pointer(entry: ctypes.Array[ctypes.c_char]) -> bool:
    """putenv(3) of the "KEY=value\\0" in `entry`: the C environment points into that buffer
    (nothing is copied), which must stay alive while it does; False on failure (ENOMEM)."""
    return bool(_libc.putenv(ctypes.addressof(entry)) == 0)


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) over [address, address + length), `address` page-aligned; False on failure
    (errno set: EINVAL where the kernel does not know the advice)."""
    return bool(_libc.madvise(address, length, advice) == 0)


MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # linux/mman.h, Linux 5.14+; not in Python's mmap before 3.13
POPULATE_CHUNK = 8 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def populate(address: int, length: int, *, write: bool) -> bool:
    """Map every page of [address, address + length) now (`madvise(MADV_POPULATE_READ/WRITE)`),
    8 MB at a time; False where the kernel has no such advice (before 5.14).

    Why in chunks, from ctypes: one madvise over a 400 MB slot holds the process's mmap lock for
    its whole 0.1-0.3 s, and every mmap and brk of the other threads (a training step's large
    allocations) waits for it; between chunks they get in (measured: a 1 MB allocation's worst
    wait 0.10 s whole, 0.016 s in chunks). ctypes lets go of the GIL during each call, where
    Python's own `mmap(..., MAP_POPULATE)` holds it for the whole populate, stopping every
    other thread of the process, the training thread first."""
    start = address // PAGE * PAGE
    end = address + length
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    for chunk in range(start, end, POPULATE_CHUNK):
        if not madvise(chunk, min(POPULATE_CHUNK, end - chunk), advice):
            return False
    return True


def malloc_trim() -> None:
    """Give the pages freed in glibc's arenas back to the kernel (malloc_trim(0)); nothing under
    another C library."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def readable(fd: int, timeout: float | None) -> bool:
    """Whether `fd` becomes readable within `timeout` seconds (None: wait for ever)."""
    # wait: not_a_wait: creates a poll object
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    # wait: slice, said by the job: the caller's timeout; None only for a worker's own exit
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


# process_mrelease(2) (Linux 5.15): the same number in the generic syscall table of x86-64 and arm64.
_PROCESS_MRELEASE = {"x86_64": 448, "aarch64": 448}.get(platform.machine())
MRELEASE_AVAILABLE = _PROCESS_MRELEASE is not None


def release_memory(pidfd: int) -> int:
    """Free a dying process's private memory from this thread (process_mrelease(2)), while the
    process frees the rest itself: its own exit unmaps one mapping after the other on one core,
    and a stopped worker's address space (hundreds of MB to GB of tensors) is the longest part
    of a restart's stop. Only a process already killed by a signal is touched: the kernel refuses
    any other (EINVAL); shared mappings (the checkpoint tier's slots) are left to its own exit.
    Blocks for as long as the freeing takes. 0 once done, else the errno (ESRCH: it had already
    exited; ENOSYS where the call is not available)."""
    if _PROCESS_MRELEASE is None:
        return errno.ENOSYS
    if _libc.syscall(_PROCESS_MRELEASE, pidfd, 0) == 0:
        return 0
    return ctypes.get_errno()


def release_memory_soon(pidfd: int) -> None:
    """`release_memory` on a thread of its own, on a duplicate of `pidfd` (the caller may close
    its own at once): the caller goes on waiting for the exit, which this only makes sooner."""
    import threading

    if _PROCESS_MRELEASE is None:
        return
    own = os.dup(pidfd)

    def release() -> None:
        try:
            release_memory(own)
        finally:
            os.close(own)

    threading.Thread(target=release, name="rally-release-memory", daemon=True).start()
