"""The wire protocol between the agent and its worker template (see agent/template/client.py).

Protocol, over a SOCK_STREAM socketpair (the template's stdin at start): each message is an
8-byte header (body length, fd count), a JSON body, and fds passed with SCM_RIGHTS.

    agent -> template   {"op": "init", "preload": [...], "path0": DIR}
                        {"op": "spawn", "argv", "mode", "target", "args", "env", "cwd"}
                        + fds stdin, stdout, stderr
    template -> agent   {"op": "ready", "preloaded", "failed", "threads", "seconds"}
                        {"op": "spawned", "pid"} + the child's pidfd  |  {"op": "refused", "reason"}
                        {"op": "exit", "pid", "status", "time"}

Both sides import this module, so it uses only the standard library.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
from collections.abc import Sequence
from typing import Any

_HEADER = struct.Struct("!II")  # body length, number of fds
_MAX_FDS = 8


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body), len(fds)) + body
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sent = sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One whole message and the fds that came with it (close-on-exec); None at end of file."""
    fds: list[int] = []
    header = b""
    try:
        while len(header) < _HEADER.size:
            chunk, ancdata, flags, _ = sock.recvmsg(
                _HEADER.size - len(header), socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(data[: len(data) - len(data) % received.itemsize])
                    fds.extend(received)
            if flags & socket.MSG_CTRUNC:
                raise ConnectionError("file descriptors were cut off in transit")
            if not chunk:
                if header:
                    raise ConnectionError("the connection closed in the middle of a message")
                return None
            header += chunk
        length, _count = _HEADER.unpack(header)
        body = bytearray()
        while len(body) < length:
            # wait: slice: the socket's timeout
            chunk = sock.recv(min(length - len(body), 1 << 20))
            if not chunk:
                raise ConnectionError("the connection closed in the middle of a message")
            body += chunk
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# Python ignores these at start-up whatever it inherited (subprocess resets them before exec).
PYTHON_IGNORES = frozenset({signal.SIGPIPE, signal.SIGXFSZ})


def ignored_signals() -> set[int]:
    """Signals this process ignores that a child would inherit ignored (agent side)."""
    out = set()
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP) and signum not in PYTHON_IGNORES:
            if signal.getsignal(signum) is signal.SIG_IGN:
                out.add(int(signum))
    return out
