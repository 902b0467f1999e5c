"""One keep-alive HTTP/1.1 connection to an etcd member's JSON gateway, plain or TLS.

Why not `http.client`: it sends a request's headers and body in two segments and parses the
reply's headers with the `email` package, which made the Python client's own CPU cost about
0.14 ms per request against 0.03 ms here (measured against a local etcd; with 1024 nodes each
making about 15 requests in the same few seconds, the client's cost is most of the total).
The gateway speaks a small, well-defined subset of HTTP: a reply has a status line, headers,
and a body with Content-Length or chunked transfer encoding (a watch is one chunked stream of
JSON lines). That subset is all this module reads.

Nothing here trusts the peer further than the gateway's own replies need: a reply's headers (at
most MAX_HEADERS lines), its body and a watch's line are each at most MAX_REPLY_BYTES, so a
hostile gateway's 1 TiB Content-Length or never-ending chunked reply is one HttpError, not a
MemoryError or a process that grows until the kernel stops it (1.4 GB seen before the cap).

`EtcdAccess` is how the cluster is reached: `http` or `https` with a CA, a client certificate
and key (torchrun's `--rdzv-conf protocol=https,cacert=...,cert=...,key=...`), and etcd's own
users (`username`, `password`). One SSL context is built per access and shared by every
connection of the process.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

# The most of one reply (or one line of a watch) read into memory. etcd's own limit on a request
# is 1.5 MiB and on a reply 2 GiB, but what rally reads is small: the biggest, a range over every
# node of a 4096-node round, is a few MiB.
MAX_REPLY_BYTES = 64 << 20
# The most header lines of one reply (the gateway sends fewer than ten).
MAX_HEADERS = 100


class HttpError(Exception):
    """The connection broke or the reply was not HTTP as the gateway writes it."""


def _too_large(size: int) -> HttpError:
    return HttpError(
        f"a reply of {size} bytes or more, over the {MAX_REPLY_BYTES >> 20} MiB no etcd reply to rally needs"
    )


@dataclass
class EtcdAccess:
    """How to reach the cluster: scheme, TLS files and an etcd user (all optional)."""

    protocol: str = "http"
    cacert: str | None = None  # CA bundle that signed the members' certificates (default: the system's)
    cert: str | None = None  # client certificate (etcd --client-cert-auth)
    key: str | None = None  # its private key
    username: str | None = None  # an etcd user (etcd auth enabled)
    password: str | None = field(default=None, repr=False)  # never in a log line or traceback
    _context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def tls(self) -> bool:
        return self.protocol == "https"

    def ssl_context(self) -> ssl.SSLContext:
        """The process's one SSL context for this access (certificates loaded once)."""
        with self._lock:
            if self._context is None:
                context = ssl.create_default_context(cafile=self.cacert)
                if self.cert:
                    context.load_cert_chain(self.cert, self.key)
                self._context = context
            return self._context


class HttpConnection:
    """A persistent connection to one member; one request at a time (the caller holds a lock)."""

    def __init__(self, host: str, port: int, access: EtcdAccess, timeout: float):
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise HttpError(_reason(exc)) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if access.tls:
                sock = access.ssl_context().wrap_socket(sock, server_hostname=host.strip("[]"))
        except (OSError, ValueError) as exc:
            sock.close()
            raise HttpError(_reason(exc)) from exc
        self.sock = sock
        self.host = host
        self.reader = sock.makefile("rb")

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()

    def _send(self, path: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, dict[bytes, bytes]]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
            f"application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
        )
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(head.encode() + body)  # one segment: no delayed-ACK stall, one wake-up
            status_line = self.reader.readline(65536)
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
                raise HttpError(
                    "the connection closed" if not status_line else f"not an HTTP reply: {status_line[:60]!r}"
                )
            reply_headers: dict[bytes, bytes] = {}
            while True:
                if len(reply_headers) >= MAX_HEADERS:
                    raise HttpError(f"a reply with more than {MAX_HEADERS} header lines")
                line = self.reader.readline(65536)
                if line in (b"\r\n", b"\n"):
                    break
                if not line:
                    raise HttpError("the connection closed in the middle of a reply")
                name, _, value = line.partition(b":")
                reply_headers[name.strip().lower()] = value.strip()
            return int(parts[1]), reply_headers
        except ValueError as exc:
            raise HttpError(f"a malformed reply ({exc})") from exc

    def post(self, path: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes, bool]:
        """(status, body, whether the server keeps the connection open)."""
        status, reply_headers = self._send(path, body, headers, timeout)
        try:
            if b"chunked" in reply_headers.get(b"transfer-encoding", b"").lower():
                parts, total = [], 0
                for chunk in self._chunks():
                    total += len(chunk)
                    if total > MAX_REPLY_BYTES:
                        raise _too_large(total)
                    parts.append(chunk)
                data = b"".join(parts)
            else:
                length = _length(reply_headers)
                data = self.reader.read(length)
                if len(data) != length:
                    raise HttpError("the connection closed in the middle of a reply")
        except ValueError as exc:
            raise HttpError(f"a malformed reply ({exc})") from exc
        return status, data, reply_headers.get(b"connection", b"").lower() != b"close"

    def stream(self, path: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, Iterator[bytes]]:
        """Start a streaming request (a watch): its status and an iterator of the reply's lines."""
        status, reply_headers = self._send(path, body, headers, timeout)
        if b"chunked" not in reply_headers.get(b"transfer-encoding", b"").lower():
            try:
                length = _length(reply_headers)
            except ValueError as exc:
                raise HttpError(f"a malformed reply ({exc})") from exc
            return status, iter([self.reader.read(length)])
        return status, self._lines()

    def _chunks(self) -> Iterator[bytes]:
        while True:
            size_line = self.reader.readline(1024)
            if not size_line:
                raise HttpError("the connection closed in the middle of a reply")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size > MAX_REPLY_BYTES:
                raise _too_large(size)
            if size == 0:
                self.reader.readline(1024)  # the empty trailer
                return
            chunk = self.reader.read(size)
            if len(chunk) != size:
                raise HttpError("the connection closed in the middle of a reply")
            self.reader.readline(1024)  # the CRLF after each chunk
            yield chunk

    def _lines(self) -> Iterator[bytes]:
        pending = b""
        for chunk in self._chunks():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_REPLY_BYTES:  # a line that never ends
                raise _too_large(len(pending))
            yield from lines
        if pending:
            yield pending


def _length(reply_headers: dict[bytes, bytes]) -> int:
    """A reply's Content-Length, at most MAX_REPLY_BYTES (ValueError when it is no number)."""
    length = int(reply_headers.get(b"content-length", b"0") or 0)
    if length < 0:
        raise ValueError(f"Content-Length {length}")
    if length > MAX_REPLY_BYTES:
        raise _too_large(length)
    return length


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
