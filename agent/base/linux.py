"""The few Linux calls rally needs that the standard library does not wrap (stdlib only).

Shared by the agent (processes.py) and the worker template (template_server.py), which runs in
every worker and so must not import anything heavy.
"""

from __future__ import annotations

import ctypes
import select

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

# Loaded at import, not on first use: prctl is also called between fork and exec
# (processes._die_with_parent), where loading a library is not safe.
_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> int:
    """prctl(2) with one argument; returns its result (-1 with errno set on failure)."""
    return _libc.prctl(option, value, 0, 0, 0)


def readable(fd: int, timeout: float | None) -> bool:
    """Whether `fd` becomes readable within `timeout` seconds (None: wait for ever)."""
    # wait: not_a_wait: creates a poll object
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    # wait: slice, said by the job: the caller's timeout; None only for a worker's own exit
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))
