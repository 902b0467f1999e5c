"""Reading a c10d TCPStore without torch: the few questions `rally status` asks, over a plain socket.

`rally status --rdzv-endpoint HOST:PORT` only reads: whether a key exists (CHECK), a key's value
(GET) and a counter (ADD of 0). torch's client would cost its import (1.5 s of CPU, and a NumPy
warning where NumPy is missing) for three queries, so this module speaks them itself, with the
standard library. The wire protocol is c10d's (TCPStoreBackend.hpp, the same from torch 2.4 to
2.15 on both server back ends; rendezvous/c10d/connect.py asks VALIDATE and GETNUMKEYS the same
way): a query is one byte, a key a little-endian uint64 length and its bytes under torch's client
prefix "/", an answer a fixed-size value or a length and its bytes.

What it reads is judged as torch's client would leave it to rally to judge: values are opened
by the job's `Signer` (rendezvous/base/token.py), so a record the job's key does not verify is an
`UntrustedValue`, exactly as on `rendezvous.c10d.store.Store`. Beyond torch's client, nothing here
trusts the peer: every socket call has a timeout, an answer longer than MAX_VALUE_BYTES is not
read into memory (a value is cut, the connection dropped and opened again for the next query),
and an answer of the wrong shape is `StoreUnavailable` with one line. Writes are not offered:
the agent, which writes, runs torch's client anyway (rendezvous/c10d/store.py).
"""

from __future__ import annotations

import socket
import struct

from rally.rendezvous.base.kv import StoreUnavailable, UntrustedValue
from rally.rendezvous.base.token import BadRecord, Signer

# c10d's query codes (TCPStoreBackend.hpp `QueryType`) and its first message's magic number.
QUERY_VALIDATE, QUERY_GET, QUERY_ADD, QUERY_CHECK = 0, 3, 4, 5
VALIDATION_MAGIC = 0x3C85F7CE
CHECK_READY = 0  # `CheckResponseType::READY`
# torch's TCPStore client puts every key under this prefix (TCPStore::keyPrefix_).
CLIENT_KEY_PREFIX = b"/"
# The most of one value read into memory. Every record `rally status` parses is at most 1 MiB
# (status/schema.py `MAX_RECORD_BYTES`); the one list it reads whole (`status/nodes`: 4096 signed
# lines of ~150 bytes) is well under this, and a longer one is read up to here.
MAX_VALUE_BYTES = 16 << 20
RECV_CHUNK = 1 << 16


class WireStore:
    """A read-only connection to a c10d TCPStore, every key under `prefix`: what
    rendezvous/status/reader.py's `read_job_status` calls (`get_if_present`, `get_unsigned`, `counter`,
    `key`, `signer`), as `rendezvous.c10d.store.Store` answers them."""

    def __init__(self, host: str, port: int, prefix: str, timeout: float, signer: Signer | None = None):
        """`timeout` bounds every connect, send and receive (not the whole session: the caller
        bounds that, as `rally status` does with connect.bounded)."""
        self.host, self.port, self.prefix, self.timeout = host, port, prefix, timeout
        self.signer = signer or Signer()
        self.describe = f"the rendezvous store at {host}:{port}"
        self._conn: socket.socket | None = None

    # ------------------------------------------------------------------ what status reads
    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def check(self, name: str) -> bool:
        """Whether `name` exists (never waits for it)."""
        answer = self._ask(bytes([QUERY_CHECK]) + struct.pack("<Q", 1) + self._wire_key(name), 1)
        return answer[0] == CHECK_READY

    def get_unsigned(self, name: str) -> bytes | None:
        """The raw bytes of `name`, None when absent (a `check`, then a GET: a GET of a missing key
        is answered only once it exists), at most MAX_VALUE_BYTES of them (an append-list is read
        from its start)."""
        if not self.check(name):
            return None
        value, _whole = self._get(name)
        return value

    def get_if_present(self, name: str, *, nobody_waits: bool = False) -> bytes | None:
        """The checked payload of `name`, None when absent: a `check` and a `get`, two requests (a
        status reader writes nothing, not even `Store.get_if_present`'s no-op compare_set)."""
        return self.get(name) if self.check(name) else None

    def get(self, name: str) -> bytes:
        """The checked payload of `name` (it must exist); UntrustedValue when this job's key does
        not verify it, or it is longer than any value rally writes."""
        value, whole = self._get(name)
        if not whole:
            raise UntrustedValue(
                f"store key '{self.key(name)}' holds more than {MAX_VALUE_BYTES} bytes: no rally record"
            )
        try:
            return self.signer.open(self.key(name), value)
        except BadRecord as exc:
            raise UntrustedValue(str(exc)) from None

    def get_str(self, name: str) -> str:
        try:
            return self.get(name).decode()
        except UnicodeDecodeError:
            raise UntrustedValue(f"store key '{self.key(name)}' holds bytes that are not text") from None

    def counter(self, name: str, limit: int | None = None) -> int:
        """A counter's value (an ADD of 0, as `Store.counter`: a missing counter is made 0),
        checked to lie in 0..limit. A value that is no counter makes the server drop the
        connection: that is told apart from a lost store by reading the value on a new one."""
        try:
            (value,) = struct.unpack(
                "<q", self._ask(bytes([QUERY_ADD]) + self._wire_key(name) + struct.pack("<q", 0), 8)
            )
        except StoreUnavailable:
            if not self.check(name):
                raise
            raise UntrustedValue(
                f"store key '{self.key(name)}' holds {(self.get_unsigned(name) or b'')[:40]!r}, not a counter "
                "(garbage written by a stranger)"
            ) from None
        if value < 0 or (limit is not None and value > limit):
            bound = "" if limit is None else f" (at most {limit})"
            raise UntrustedValue(
                f"store key '{self.key(name)}' holds {value}, out of range{bound}: a stranger wrote to the store"
            )
        return value

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ the wire
    def _wire_key(self, name: str) -> bytes:
        data = CLIENT_KEY_PREFIX + self.key(name).encode()
        return struct.pack("<Q", len(data)) + data

    def _get(self, name: str) -> tuple[bytes, bool]:
        """The value of `name` and whether it is whole (False: cut at MAX_VALUE_BYTES, and the
        connection, which still carries the rest, closed)."""
        (length,) = struct.unpack("<Q", self._ask(bytes([QUERY_GET]) + self._wire_key(name), 8))
        value = self._receive(min(length, MAX_VALUE_BYTES))
        if length > MAX_VALUE_BYTES:
            self.close()
        return value, length <= MAX_VALUE_BYTES

    def _ask(self, query: bytes, answer_bytes: int) -> bytes:
        conn = self._connected()
        try:
            conn.sendall(query)
        except OSError as exc:
            self.close()
            raise StoreUnavailable(f"{self.describe} is gone ({exc.strerror or exc})") from None
        return self._receive(answer_bytes)

    def _receive(self, size: int) -> bytes:
        conn, parts, left = self._connected(), [], size
        try:
            while left:
                # wait: short: the socket's timeout (`timeout`, the status command's) per receive
                chunk = conn.recv(min(left, RECV_CHUNK))
                if not chunk:
                    raise StoreUnavailable(f"{self.describe} closed the connection in the middle of an answer")
                parts.append(chunk)
                left -= len(chunk)
        except TimeoutError:
            self.close()
            raise StoreUnavailable(f"{self.describe} did not answer within {self.timeout:g} s") from None
        except OSError as exc:
            self.close()
            raise StoreUnavailable(f"{self.describe} is gone ({exc.strerror or exc})") from None
        except StoreUnavailable:
            self.close()
            raise
        return b"".join(parts)

    def _connected(self) -> socket.socket:
        if self._conn is None:
            try:
                conn = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except OSError as exc:
                raise StoreUnavailable(f"could not reach {self.describe} ({exc.strerror or exc})") from None
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn.sendall(struct.pack("<BI", QUERY_VALIDATE, VALIDATION_MAGIC))
            except OSError as exc:
                conn.close()
                raise StoreUnavailable(f"{self.describe} is gone ({exc.strerror or exc})") from None
            self._conn = conn
        return self._conn
