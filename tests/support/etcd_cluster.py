"""A real 3-member etcd cluster on loopback for the tests (etcd from the OS packages).

Ports come from the OS (bind port 0, read it, release it) for every member's client and peer
URL; data directories live in pytest's tmp; each member runs in its own session and is stopped
by pid / process group, never by name. `EtcdCluster.kill(member)` SIGKILLs one member (the
leader, in the fail-over test) and `restart(member)` brings it back with its data directory,
so the cluster is whole again for the next test.

One cluster per test module, stopped when the module ends: an idle member still costs ~1 % of a
core (raft heartbeats), and a session-scoped cluster lived on beside every later module of its
pytest-xdist worker (10 minutes and more of .ci/run's main pass, ~20 CPU-seconds per cluster),
against a second or so of CPU to start one per module (4 modules of the main pass use it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.helpers import free_port

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(
    ETCD is None, reason="etcd is not installed (Debian: apt-get install etcd-server etcd-client; .ci/install does it)"
)
# How long a member may take to start or a cluster to elect a leader on a loaded 2-core machine.
START_SECONDS = 30.0


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def status(self) -> dict | None:
        """This member's /v3/maintenance/status, or None when it does not answer."""
        request = urllib.request.Request(
            f"http://{self.endpoint}/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                return json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None


@dataclass
class EtcdCluster:
    members: list[EtcdMember]
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def endpoints(self, first: EtcdMember | None = None) -> str:
        """The client endpoints as rally's --rdzv-endpoint list; `first` leads the list."""
        ordered = sorted(self.members, key=lambda m: m is not first)
        return ",".join(m.endpoint for m in ordered)

    def start(self, member: EtcdMember) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        handle = open(member.log, "ab")  # owned by the child
        member.process = subprocess.Popen(
            [
                str(ETCD),
                "--name",
                member.name,
                "--data-dir",
                str(member.data_dir),
                "--listen-client-urls",
                f"http://{member.endpoint}",
                "--advertise-client-urls",
                f"http://{member.endpoint}",
                "--listen-peer-urls",
                member.peer_url,
                "--initial-advertise-peer-urls",
                member.peer_url,
                "--initial-cluster",
                initial,
                "--initial-cluster-token",
                self.token,
                "--initial-cluster-state",
                "new",
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        handle.close()

    def kill(self, member: EtcdMember) -> None:
        """SIGKILL one member (its whole session), as a crashed machine."""
        if member.process is not None and member.process.poll() is None:
            os.killpg(member.process.pid, signal.SIGKILL)
            member.process.wait(timeout=10)

    def restart(self, member: EtcdMember) -> None:
        """Start a killed member again from its data directory; it rejoins the cluster."""
        self.kill(member)
        self.start(member)

    def leader(self) -> EtcdMember | None:
        for member in self.members:
            status = member.status()
            if status and status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return member
        return None

    def wait_healthy(self, timeout: float = START_SECONDS) -> EtcdMember:
        """Wait until every member answers and they agree on one leader; return the leader."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = [m.status() for m in self.members]
            leaders = {s.get("leader") for s in statuses if s}
            if all(statuses) and len(leaders) == 1 and None not in leaders:
                leader = self.leader()
                if leader is not None:
                    return leader
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {m.name}\n{m.log.read_text(errors='replace')[-2000:]}" for m in self.members)
                pytest.fail(f"the etcd cluster was not healthy within {timeout} s\n{logs}")
            time.sleep(0.1)

    def stop(self) -> None:
        for member in self.members:
            self.kill(member)


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Three etcd members on 127.0.0.1, started once per test module (see the module's docstring)."""
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server etcd-client)")
    root = tmp_path_factory.mktemp("etcd")
    ports = _distinct_free_ports(6)
    members = [
        EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], root / f"m{i}.data", root / f"m{i}.log") for i in range(3)
    ]
    cluster = EtcdCluster(members)
    try:
        for member in members:
            cluster.start(member)
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd(etcd_cluster: EtcdCluster) -> EtcdCluster:
    """The module's cluster, whole again (every member up, one leader) before each test."""
    for member in etcd_cluster.members:
        if member.process is None or member.process.poll() is not None:
            etcd_cluster.restart(member)
    etcd_cluster.wait_healthy()
    return etcd_cluster


def losing_one_txn_reply() -> type:
    """An EtcdClient class whose first transaction's reply is lost after etcd applied it: the
    client tries again elsewhere, as after a member died mid-request."""
    from rally.rendezvous.etcd.client import EtcdClient, _TryElsewhere

    class LosesAReply(EtcdClient):
        lost = True

        def _post(self, path, body, timeout):  # type: ignore[no-untyped-def]
            reply = super()._post(path, body, timeout)
            if path.endswith("/txn") and LosesAReply.lost:
                LosesAReply.lost = False
                raise _TryElsewhere("the reply was lost (simulated)")
            return reply

    return LosesAReply
