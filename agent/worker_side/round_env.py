"""A re-entered worker's environment variables, set each round without glibc keeping every value.

`os.environ[key] = value` calls setenv(3), and glibc's setenv never frees a "KEY=value" string
it made: a pointer getenv returned earlier may still be in use, so every distinct value is kept
(in a search tree, for reuse) for the life of the process. A worker that `rally.job.run`
re-enters is given a new MASTER_PORT, RALLY_ROUND and TORCHELASTIC_RESTART_COUNT every round:
three strings kept for good per entry (135 B measured by `python -m bench.reentry_heap`), for as
many entries as the job's restart budget allows.

Here each such variable has one buffer of rally's, put into the C environment with putenv(3)
(which stores the pointer, copying nothing) and rewritten in place the next round. Python's
`os.environ` mapping is updated beside it, so both views agree: `os.environ`, `getenv` from C
(torch, NCCL, gloo) and the environment a child process inherits. A value too long for its
buffer gets a larger one. Linux with glibc only (musl's setenv frees the old value already);
elsewhere, and for what `os.environ` itself refuses (a key with "=", a NUL), plain `os.environ`
assignment.
"""

from __future__ import annotations

import ctypes
import os
import platform

from rally.agent.base import linux

BUFFER_BYTES = 256  # "KEY=value" of a round's variable; a longer one gets a buffer of its own size

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"  # os.confstr: no file read

# key -> the buffer its "KEY=value" lives in; kept for the process's life (the C environment
# points into it), one per variable however many rounds
_buffers: dict[str, ctypes.Array[ctypes.c_char]] = {}


def set_variable(key: str, value: str) -> None:
    """`os.environ[key] = value`, without a string kept for good by glibc for each new value."""
    if not GLIBC or "=" in key or not key or "\0" in key + value:
        os.environ[key] = value
        return
    if os.environ.get(key) == value:
        return  # nothing changes (setenv too would find this string in its tree)
    entry = os.fsencode(key) + b"=" + os.fsencode(value) + b"\0"
    buffer = _buffers.get(key)
    if buffer is None or len(buffer) < len(entry):
        buffer = ctypes.create_string_buffer(max(BUFFER_BYTES, len(entry)))
    # in place: what a getenv returned earlier is never freed (another thread reading it now, which
    # nothing does at a round's start, could see a half-written value, never freed memory)
    ctypes.memmove(buffer, entry, len(entry))
    # every time, not only for a new buffer: the script may have set the variable itself since,
    # and putenv of the pointer already there replaces it with itself, allocating nothing
    if not linux.putenv_pointer(buffer):
        os.environ[key] = value  # ENOMEM: as Python would
        return
    _buffers[key] = buffer  # an older, shorter buffer is no longer in the environment: freed
    # the mapping's own copy, as os.environ.__setitem__ stores it after its putenv
    os.environ._data[os.environ.encodekey(key)] = os.environ.encodevalue(value)  # type: ignore[attr-defined]
