"""The etcd half of the simulated rendezvous (bench/simrdzv.py): a local etcd member, and
simulated nodes that run rally's round protocol on it, each with its own EtcdStore.

* `LocalEtcd` starts one etcd member (the OS's `etcd` binary) on 127.0.0.1 with ports from the
  OS and a data directory of its own, in its own session; `stop()` kills it by pid. Its data
  directory is on the same disk as /tmp, so every write pays etcd's real fsync.
* `CountingClient` is rally's `EtcdClient` with every request counted: the unary calls
  (range, put, txn, lease) and the watches. For each request it adds the wall time and the
  calling thread's CPU time (`time.thread_time`) spent inside the Python client: JSON and
  base64 encoding, `http.client`, parsing the reply. That CPU time is the client's own cost per
  request; the parent reads the etcd process's CPU time around each trial for the store's.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from rally.rendezvous.etcd.client import EtcdClient, Member

START_SECONDS = 30.0


class _Closer(threading.local):
    won = False  # this thread closed a round (set by bench.simrdzv's counting store, for --profile)


CLOSER = _Closer()


def two_free_ports() -> tuple[int, int]:
    """Two distinct ports the OS assigns on 127.0.0.1 (bound together, then released)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return sockets[0].getsockname()[1], sockets[1].getsockname()[1]
    finally:
        for sock in sockets:
            sock.close()


class LocalEtcd:
    """One etcd member on loopback, started for a benchmark and killed by pid afterwards."""

    def __init__(self, client_port: int, peer_port: int):
        self.client_port = client_port
        self.data_dir = tempfile.mkdtemp(prefix="rally_bench_etcd_")
        self.log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # kept for the member's life
        client = f"http://127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.process = subprocess.Popen(
            [etcd, "--name", "sim", "--data-dir", os.path.join(self.data_dir, "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"sim={peer}", "--initial-cluster-state", "new",
             "--logger", "zap", "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout: float = START_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.client_port}/v3/kv/range",
            data=b'{"key": "AA=="}',
            headers={"Content-Type": "application/json"},
        )
        while True:
            try:
                with urllib.request.urlopen(request, timeout=2) as reply:
                    reply.read()
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start within {timeout:g} s (log: {self.log.name})") from None
                time.sleep(0.1)

    def cpu_seconds(self) -> float:
        """The member's user + system CPU time so far (from /proc, in clock ticks)."""
        with open(f"/proc/{self.process.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class CountingClient(EtcdClient):
    """rally's etcd client, with each request's count, wall time and client CPU time added to `counter`."""

    def __init__(self, members: list[Member] | tuple[Member, ...], counter: Any, start_at: int = 0):
        super().__init__(members, start_at)
        self.counter = counter

    def fork(self) -> CountingClient:
        return CountingClient(self.members, self.counter, self._current)

    def call(self, path: str, body: dict[str, Any], budget: float) -> dict[str, Any]:
        t, wall, cpu = time.monotonic(), time.perf_counter(), time.thread_time()
        try:
            return super().call(path, body, budget)
        finally:
            self.counter.bump(time.perf_counter() - wall, time.thread_time() - cpu)
            self._record(path, body, t, wall)

    def _record(self, path: str, body: dict[str, Any], t: float, wall: float) -> None:
        """bench.simrdzv --profile: one line per request, named by its first key (see Counter.record)."""
        if getattr(self.counter, "log", None) is None:
            return
        first = body
        for op in body.get("success") or body.get("compare") or []:
            first = next(iter(op.values())) if "key" not in op else op
            break
        key = base64.b64decode(first.get("key", "")).decode(errors="replace").split("\x00")[0]
        size = len(json.dumps(body))
        self.counter.record(path.rsplit("/", 1)[-1], key, size, 0, t, time.perf_counter() - wall, CLOSER.won)

    def watch(
        self, request: dict[str, Any], deadline: float, also: tuple[dict[str, Any], ...] = ()
    ) -> Iterator[dict[str, Any]]:
        """One request: the watch's set-up and the parsing of its events count as client CPU."""
        t, wall, cpu = time.monotonic(), time.perf_counter(), time.thread_time()
        try:
            # (`also` only when given: the same harness runs against main's client, which has none)
            yield from super().watch(request, deadline, also) if also else super().watch(request, deadline)
        finally:
            self.counter.bump(time.perf_counter() - wall, time.thread_time() - cpu)
            self._record("/watch", request, t, wall)


def etcd_clients(port: int, count: int, counter: Any) -> list[CountingClient]:
    """One client (one HTTP connection) per simulated node, connected before any trial starts."""
    clients = [CountingClient([Member("127.0.0.1", port)], counter) for _ in range(count)]
    for client in clients:
        EtcdClient.call(client, "/v3/kv/range", {"key": "AA==", "count_only": True}, 30)  # not counted
    return clients


class Etcd3gwClient(CountingClient):
    """rally's client with etcd3gw (https://opendev.org/openstack/etcd3gw, on `requests`) as the
    transport, for issue 28's evaluation (docs/etcd.md, "Why this etcd client"): every request
    goes through `Etcd3Client.post` and every watch through `etcd3gw.watch.Watcher` (a streaming
    `requests` response read by a thread pool of its own), counted as rally's are. rally's
    fail-over and authentication stay around it: etcd3gw has neither (one host per client, no
    `/v3/auth/authenticate`), nor several watches on one stream (`also` is opened as watches of
    their own)."""

    def __init__(self, members: list[Member] | tuple[Member, ...], counter: Any, start_at: int = 0):
        super().__init__(members, counter, start_at)
        from etcd3gw.client import Etcd3Client

        member = self.members[self._current]
        # api_path given: no `/version` request per client to find it
        self.gw = Etcd3Client(host=member.host, port=member.port, api_path="/v3/", timeout=30)

    def fork(self) -> Etcd3gwClient:
        return Etcd3gwClient(self.members, self.counter, self._current)

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        from etcd3gw import exceptions

        from rally.rendezvous.etcd.client import _TryElsewhere

        try:
            return self.gw.post(self.gw.get_url(path.removeprefix("/v3")), data=json.dumps(body))
        except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError) as exc:
            raise _TryElsewhere(str(exc)) from exc

    def _raw_watch(self, request: dict[str, Any], deadline: float, also: tuple[dict[str, Any], ...] = ()):
        import queue

        from etcd3gw.watch import Watcher

        events: queue.Queue = queue.Queue()
        watchers = []
        for one in (request, *also):
            options = {"range_end": base64.b64decode(one["range_end"])} if "range_end" in one else {}
            watchers.append(
                Watcher(
                    self.gw,
                    base64.b64decode(one["key"]),
                    events.put,
                    start_revision=int(one["start_revision"]) if "start_revision" in one else None,
                    filters=one.get("filters"),
                    **options,
                )
            )
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = events.get(timeout=left)
                except queue.Empty:
                    return
                kv = dict(event["kv"])  # etcd3gw hands keys and values out decoded: back to the gateway's base64
                kv["key"] = base64.b64encode(kv["key"]).decode()
                if "value" in kv:
                    kv["value"] = base64.b64encode(kv["value"]).decode()
                yield {**event, "kv": kv}
        finally:
            for watcher in watchers:
                watcher.stop()

    def watch(self, request: dict[str, Any], deadline: float, also: tuple[dict[str, Any], ...] = ()):
        t, wall, cpu = time.monotonic(), time.perf_counter(), time.thread_time()
        try:
            yield from self._raw_watch(request, deadline, also)
        finally:
            self.counter.bump(time.perf_counter() - wall, time.thread_time() - cpu)
            self._record("/watch", request, t, wall)
            for _ in also:  # each is a watch request (and a connection) of its own here
                self.counter.bump()


def etcd3gw_clients(port: int, count: int, counter: Any) -> list[Etcd3gwClient]:
    """`etcd_clients` with etcd3gw as the transport (one `requests` session per node)."""
    clients = [Etcd3gwClient([Member("127.0.0.1", port)], counter) for _ in range(count)]
    for client in clients:
        client.gw.post(client.gw.get_url("/kv/range"), data=json.dumps({"key": "AA==", "count_only": True}))
    return clients
