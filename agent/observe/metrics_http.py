"""The /metrics endpoint's HTTP server: one thread, however many clients connect, and none held long.

prometheus-client's own server starts a thread per connection and waits on each for ever: 400
half-open connections (anyone who can reach the port) took an agent from 8 threads to 89 in 12 s,
and under a pids limit scrapes died with `can't start new thread`. Here one thread multiplexes
every connection with a selector: a client has REQUEST_SECONDS to send its request head (at most
MAX_REQUEST_BYTES) and is dropped after; at most MAX_CLIENTS wait at once, the oldest dropped to
make room, so a scrape that arrives during a flood is served as soon as its request is in. The
response is prometheus-client's WSGI app's (content negotiation, gzip), written with a
SEND_SECONDS bound, then the connection is closed.

One client's error never ends the server: a connection the accept loop dropped (to make room)
while the same select() also reported it readable is skipped, and anything unexpected while
serving one connection drops that connection only. (Before, a connect/close flood hit the first
case: KeyError in `_read`, a traceback on the job's console, the port closed for the rest of the
job.)
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

# A connection has this long to send its whole request head; it is then dropped.
REQUEST_SECONDS = 5.0
# The most a request head may hold; a longer one is dropped.
MAX_REQUEST_BYTES = 16384
# Connections waiting for their request at once; the oldest is dropped for a new one.
MAX_CLIENTS = 64
# The bound on writing one response (a client that does not read it is dropped).
SEND_SECONDS = 5.0

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BoundedHttpServer:
    """Serves `app` on (addr, port) from one daemon thread until `close()`."""

    def __init__(self, addr: str, port: int, app: WsgiApp):
        family, _, _, _, where = socket.getaddrinfo(
            addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(where)
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.server_port: int = self.sock.getsockname()[1]
        self.app = app
        self._wake_read, self._wake_write = socket.socketpair()
        self.thread = threading.Thread(target=self._serve, name="rally-metrics", daemon=True)
        self.thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._wake_write.send(b"x")
        # wait: short: timeout=5
        self.thread.join(timeout)
        self._wake_write.close()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self._wake_read, selectors.EVENT_READ)
        waiting: dict[socket.socket, tuple[float, bytearray]] = {}  # oldest first
        try:
            while True:
                due = min((deadline for deadline, _ in waiting.values()), default=None)
                timeout = None if due is None else max(0.0, due - time.monotonic())
                # wait: background: the metrics thread waits for clients; each waits REQUEST_SECONDS at most
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._wake_read:
                        return
                    if key.fileobj is self.sock:
                        self._accept(selector, waiting)
                    elif key.fileobj in waiting:  # else dropped by _accept since this select() returned
                        self._serve_one(selector, waiting, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in waiting.items() if deadline <= now]:
                    _drop(selector, waiting, conn)
        finally:
            for conn in list(waiting):
                _drop(selector, waiting, conn)
            selector.close()
            self.sock.close()
            self._wake_read.close()

    def _accept(self, selector: selectors.BaseSelector, waiting: dict) -> None:
        while True:
            try:
                # wait: not_a_wait: a non-blocking socket
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: try again at the next wake-up
                return
            if len(waiting) >= MAX_CLIENTS:
                _drop(selector, waiting, next(iter(waiting)))
            conn.setblocking(False)
            waiting[conn] = (time.monotonic() + REQUEST_SECONDS, bytearray())
            selector.register(conn, selectors.EVENT_READ)

    def _serve_one(self, selector: selectors.BaseSelector, waiting: dict, conn: socket.socket) -> None:
        """Read from (and maybe answer) one client; whatever goes wrong with it drops it alone."""
        try:
            self._read(selector, waiting, conn)
        except Exception:  # one client's failure (a reset mid-answer, a head no parser expects)
            _drop(selector, waiting, conn)

    def _read(self, selector: selectors.BaseSelector, waiting: dict, conn: socket.socket) -> None:
        try:
            # wait: not_a_wait: a non-blocking socket
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        head = waiting[conn][1]
        head += data
        complete = b"\r\n\r\n" in head[: MAX_REQUEST_BYTES + 4]
        if data and not complete and len(head) <= MAX_REQUEST_BYTES:
            return  # more to come, within REQUEST_SECONDS
        selector.unregister(conn)
        del waiting[conn]
        if complete:
            self._respond(conn, bytes(head).partition(b"\r\n\r\n")[0])
        conn.close()

    def _respond(self, conn: socket.socket, head: bytes) -> None:
        status, headers, body = self._answer(head)
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers)]
        lines += [f"Content-Length: {len(body)}", "Connection: close"]
        try:
            conn.settimeout(SEND_SECONDS)
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        except OSError:
            pass  # the client went away or does not read: dropped

    def _answer(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        """Run the WSGI app on the request `head` (request line and headers)."""
        request, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", [("Content-Type", "text/plain")], b"bad request line\n"
        method, target, _ = parts
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query}
        for line in header_lines:
            name, _, value = line.partition(":")
            environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> None:
            # exc_info: WSGI's sys.exc_info() of an app failing mid-response; unused, the status says it
            answer[:] = [status, headers]

        try:
            body = b"".join(self.app(environ, start_response))
        except Exception as exc:  # a collector that failed: the scrape says so, the server lives on
            return "500 Internal Server Error", [("Content-Type", "text/plain")], f"{exc}\n".encode()
        return answer[0], answer[1], body


def _drop(selector: selectors.BaseSelector, waiting: dict, conn: socket.socket) -> None:
    """Forget `conn` and close it; a connection already forgotten is left as it is."""
    waiting.pop(conn, None)
    try:
        selector.unregister(conn)
    except (KeyError, ValueError):  # not registered, or already closed
        pass
    conn.close()
