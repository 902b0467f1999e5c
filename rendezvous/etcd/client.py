"""A small client for etcd's v3 JSON gateway (HTTP), with fail-over between cluster members.

rally talks to etcd through the gateway that every etcd member serves next to gRPC on its
client port (`POST /v3/kv/range`, `/v3/kv/txn`, `/v3/watch`, `/v3/lease/...`; keys and values in
base64). That needs nothing beyond the standard library (the connection: rendezvous/etcd/http.py,
plain or TLS): no gRPC stack and no third-party client to keep maintained. With an etcd user,
the client authenticates once and sends the token with every request.

Fail-over: the client holds the list of member endpoints and uses one at a time. When a member
refuses, drops the connection, times out, or answers "no leader / leader changed / unavailable",
the request goes to the next member at once; after a full pass it backs off briefly and tries
again, until the operation's budget (rally's `read_timeout`) runs out. A SIGKILLed member on the
same network is noticed immediately (its sockets are reset), so a leader's death costs one
election (about a second with etcd's defaults), not a time-out.

One caveat, shared with every etcd client: a request whose reply is lost because the member died
after applying it is sent again. Puts are idempotent; rally's counters use compare-and-swap
transactions, and such a doubled increment can only happen when a member dies mid-request.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from rally.rendezvous.etcd.http import EtcdAccess, HttpConnection, HttpError

# One HTTP request (connect + reply) to one member; a slower member is skipped for the next one.
REQUEST_TIMEOUT_SECONDS = 5.0
# Back-off after every member failed once, doubling up to the maximum, until the budget runs out.
RETRY_DELAY_SECONDS = 0.05
RETRY_DELAY_MAX_SECONDS = 0.5
# gRPC status codes (in the gateway's error body) that mean "try again, maybe elsewhere":
# DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, UNAVAILABLE (no leader, leader changed, ...).
RETRYABLE_GRPC_CODES = frozenset({4, 8, 10, 14})
DEFAULT_ETCD_PORT = 2379


class EtcdError(Exception):
    """etcd answered with an error that retrying will not fix (bad request, unknown lease, ...)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class EtcdUnavailable(Exception):
    """No member of the cluster answered within the budget."""


class _TryElsewhere(Exception):
    """This member cannot serve the request right now (internal: triggers fail-over)."""


@dataclass(frozen=True)
class Member:
    """One etcd client endpoint."""

    host: str
    port: int = DEFAULT_ETCD_PORT

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def describe_members(members: list[Member] | tuple[Member, ...], protocol: str = "http") -> str:
    scheme = "https://" if protocol == "https" else ""
    return ",".join(f"{scheme}{m}" for m in members)


class EtcdClient:
    """Requests to one etcd cluster. Thread-safe: unary requests share one connection under a lock;
    every watch opens its own connection, so a blocked watch never delays other calls.

    With an etcd user in `access`, the client authenticates once (`/v3/auth/authenticate`) and
    sends the token with every request; a token the cluster no longer knows (it expired, or the
    member restarted) is replaced by authenticating again. Forks share the token.
    """

    def __init__(
        self,
        members: list[Member] | tuple[Member, ...],
        start_at: int = 0,
        access: EtcdAccess | None = None,
        auth: _Auth | None = None,
    ):
        if not members:
            raise ValueError("an etcd client needs at least one endpoint")
        self.members = tuple(members)
        self.access = access or EtcdAccess()
        self._auth = auth or _Auth(self.access)
        self._current = start_at % len(self.members)
        self._connection: HttpConnection | None = None
        self._lock = threading.Lock()

    @property
    def member(self) -> Member:
        """The member requests go to now."""
        return self.members[self._current]

    def describe(self) -> str:
        return describe_members(self.members, self.access.protocol)

    def fork(self) -> EtcdClient:
        """A client of its own (own connection) that starts at the member this one uses now."""
        return EtcdClient(self.members, self._current, self.access, self._auth)

    def close(self) -> None:
        with self._lock:
            self._drop_connection()

    # ------------------------------------------------------------------ unary requests
    def call(self, path: str, body: dict[str, Any], budget: float) -> dict[str, Any]:
        """POST `body` to `path` on some member; fail over until `budget` seconds are spent."""
        deadline = time.monotonic() + budget
        delay = RETRY_DELAY_SECONDS
        failures: dict[Member, str] = {}  # the latest reason of each member
        while True:
            for _ in range(len(self.members)):
                with self._lock:
                    member = self.member
                    try:
                        return self._post(
                            path, body, max(0.05, min(REQUEST_TIMEOUT_SECONDS, deadline - time.monotonic()))
                        )
                    except _TryElsewhere as exc:
                        failures[member] = str(exc)
                        self._drop_connection()
                        self._advance()
                if time.monotonic() >= deadline:
                    break
            if time.monotonic() + delay >= deadline:
                raise EtcdUnavailable(f"no member answered within {budget:g} s: {_summary(failures)}")
            # wait: short: backoff up to RETRY_DELAY_MAX_SECONDS within the call's budget
            time.sleep(delay)  # every member failed just now: give the cluster a moment
            delay = min(delay * 2, RETRY_DELAY_MAX_SECONDS)

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        data = json.dumps(body).encode()
        for attempt in range(2):  # a second time only with a fresh auth token
            token = self._auth.token(self._authenticate, timeout)
            status, reply = self._exchange(path, data, {"Authorization": token} if token else {}, timeout)
            try:
                return _parse_reply(status, reply)
            except EtcdError as exc:
                if attempt or not (token and _token_refused(exc)):
                    raise
                self._auth.forget(token)
        raise AssertionError("unreachable")

    def _exchange(self, path: str, data: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
        """One request on this client's connection to the current member. A connection kept
        from earlier that turns out closed (the member restarted, a proxy dropped it while idle)
        is replaced once at once; any other failure means: try elsewhere."""
        for reused in (self._connection is not None, False):
            try:
                if self._connection is None:
                    self._connection = HttpConnection(self.member.host, self.member.port, self.access, timeout)
                status, reply, keep = self._connection.post(path, data, headers, timeout)
            except (OSError, HttpError) as exc:
                self._drop_connection()
                if reused and not isinstance(exc, TimeoutError):
                    continue
                raise _TryElsewhere(_reason(exc)) from exc
            if not keep:
                self._drop_connection()
            return status, reply
        raise AssertionError("unreachable")

    def _authenticate(self, timeout: float) -> str:
        """A fresh token for the configured etcd user (on this client's connection)."""
        body = json.dumps({"name": self.access.username, "password": self.access.password or ""}).encode()
        status, reply = self._exchange("/v3/auth/authenticate", body, {}, timeout)
        try:
            token = _parse_reply(status, reply).get("token")
        except EtcdError as exc:
            raise EtcdError(f"etcd refused user '{self.access.username}': {exc}", exc.code) from None
        if not token:
            raise EtcdError(
                f"etcd gave user '{self.access.username}' no token: is authentication enabled (etcdctl auth enable)?"
            )
        return token

    def _authenticate_elsewhere(self, timeout: float) -> str:
        """As `_authenticate`, on a connection of its own (a watch must not take the call lock)."""
        other = self.fork()
        try:
            return other._authenticate(timeout)
        finally:
            other.close()

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _advance(self) -> None:
        self._current = (self._current + 1) % len(self.members)

    # ------------------------------------------------------------------ watches
    def watch(
        self, request: dict[str, Any], deadline: float, also: tuple[dict[str, Any], ...] = ()
    ) -> Generator[dict[str, Any], None, None]:
        """Open a watch on the current member and yield its events until `deadline`; `also`: more
        watches on the same stream (one HTTP request: the gateway passes each JSON object of the
        body on as a request of its own), whose events come mixed with the first's.

        Returns (ends the iteration) at the deadline. Raises `EtcdUnavailable` when the member
        cannot serve the watch or the stream breaks; the caller re-reads the key (which fails
        over) and watches again from the revision it read, so no event is lost.
        """
        member = self.member
        connection: HttpConnection | None = None
        token: str | None = None
        try:
            try:
                token = self._auth.token(self._authenticate_elsewhere, _left(deadline, REQUEST_TIMEOUT_SECONDS))
                connection = HttpConnection(
                    member.host, member.port, self.access, _left(deadline, REQUEST_TIMEOUT_SECONDS)
                )
                body = b"\n".join(json.dumps({"create_request": r}).encode() for r in (request, *also))
                status, lines = connection.stream(
                    "/v3/watch",
                    body,
                    {"Authorization": token} if token else {},
                    _left(deadline, REQUEST_TIMEOUT_SECONDS),
                )
                if status != 200:
                    _parse_reply(status, b"".join(lines))  # raises with etcd's reason
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    connection.sock.settimeout(remaining)
                    line = next(lines, None)
                    if line is None:
                        raise _TryElsewhere("the watch stream ended")
                    if not line.strip():
                        continue
                    reply = _json_object(line)
                    if reply.get("error"):
                        _parse_reply(200, line)  # raises: a refused watch (auth) or try elsewhere
                    result = reply.get("result") or {}
                    events = result.get("events", []) if isinstance(result, dict) else None
                    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
                        raise _TryElsewhere("a watch reply of the wrong shape")
                    if result.get("canceled"):
                        raise _TryElsewhere(str(result.get("cancel_reason") or "the watch was cancelled")[:200])
                    yield from events
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return
                self._switch_from(member)
                raise EtcdUnavailable(f"{member}: the watch timed out") from None
            except (_TryElsewhere, OSError, HttpError, ValueError) as exc:
                self._switch_from(member)
                raise EtcdUnavailable(f"{member}: {_reason(exc)}") from exc
            except EtcdError as exc:
                if not (token and _token_refused(exc)):
                    raise
                self._auth.forget(token)  # the caller reads again (authenticating anew), then watches
                raise EtcdUnavailable(f"{member}: {exc}") from exc
        finally:
            if connection is not None:
                connection.close()

    def _switch_from(self, member: Member) -> None:
        with self._lock:
            if self.member == member:
                self._drop_connection()
                self._advance()


class _Auth:
    """The etcd user's token, shared by a client and its forks (authenticate once, not per thread)."""

    def __init__(self, access: EtcdAccess):
        self.access = access
        self._token: str | None = None
        self._lock = threading.Lock()

    def token(self, authenticate: Callable[[float], str], timeout: float) -> str | None:
        if not self.access.username:
            return None
        with self._lock:
            if self._token is None:
                self._token = authenticate(timeout)
            return self._token

    def forget(self, token: str) -> None:
        with self._lock:
            if self._token == token:
                self._token = None


def _token_refused(exc: EtcdError) -> bool:
    """etcd's answer to an expired or unknown auth token (gRPC UNAUTHENTICATED)."""
    return exc.code == 16 or "auth token" in str(exc)


def _left(deadline: float, cap: float) -> float:
    return max(0.05, min(cap, deadline - time.monotonic()))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror  # "Connection refused", not "[Errno 111] Connection refused"
    text = str(exc).strip()
    if isinstance(exc, HttpError) and text:
        return text  # its own words: what was wrong with the reply
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _summary(failures: dict[Member, str]) -> str:
    reasons = set(failures.values())
    if len(reasons) == 1 and len(failures) > 1:
        return f"{reasons.pop()} (every member)"
    return "; ".join(f"{member}: {reason}" for member, reason in failures.items())


def _json_object(data: bytes) -> dict[str, Any]:
    """One JSON object of the gateway's; _TryElsewhere for anything else: no JSON (ValueError, left
    to the caller), nested deeper than the parser goes (RecursionError), or not an object. What an
    object holds is checked where it is read (rendezvous/etcd/store.py `_shape_checked`)."""
    try:
        reply = json.loads(data) if data else {}
    except RecursionError:
        raise _TryElsewhere("a reply nested deeper than any etcd reply") from None
    if not isinstance(reply, dict):
        raise _TryElsewhere(f"a reply that is a JSON {type(reply).__name__}, not an object")
    return reply


def _parse_reply(status: int, data: bytes) -> dict[str, Any]:
    """The gateway's JSON reply; errors carry a gRPC code that says whether to try elsewhere."""
    try:
        reply = _json_object(data)
    except ValueError:
        text = data.decode(errors="replace").strip().splitlines()
        reason = f"HTTP {status}: {text[0][:200]}" if text else f"HTTP {status} with an empty reply"
        if status >= 500 or status == 200:
            raise _TryElsewhere(reason) from None
        raise EtcdError(reason) from None  # e.g. the gateway refusing a client certificate
    if status == 200 and "error" not in reply:
        return reply
    code = reply.get("code")
    message = str(reply.get("message") or reply.get("error") or f"HTTP {status}")[:200]
    if code in RETRYABLE_GRPC_CODES or status >= 500 and code is None:
        raise _TryElsewhere(message)
    raise EtcdError(message, code)
