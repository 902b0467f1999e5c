"""The tests' one multi-agent harness: several rally agents on 127.0.0.1 (or in network namespaces)
as if they were nodes, a standalone `rally store` for them, and the `cluster` fixture that starts
both and kills everything it started by pid and process group afterwards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from support.helpers import clean_env, eventually, read_jsonl, start_rally

REPO = Path(__file__).resolve().parents[2]


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


@dataclass
class AgentProcess:
    """One `rally` process standing in for a node."""

    name: str
    popen: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill_node(self) -> list[int]:
        """SIGKILL the agent and every process under it, as a node crash would."""
        victims = [self.popen.pid] + [p.pid for p in self.descendants()]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=10)
        return victims


def start_agent(
    name: str,
    tmp: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> AgentProcess:
    """Start one rally agent (`helpers.start_rally`), its merged output going to `<name>.log`;
    `prefix` runs it under another command (`ip netns exec NS`, a node of its own)."""
    log = tmp / f"{name}.log"
    with open(log, "w") as handle:  # the child keeps its own descriptor
        popen = start_rally(
            args, cwd=tmp, env=clean_env(**(env or {})), stdout=handle, stderr=subprocess.STDOUT, prefix=prefix or ()
        )
    return AgentProcess(name, popen, log)


def c10d_args(
    port: int, nnodes: str, run_id: str = "testjob", extra_conf: str = "", preflight: bool = False
) -> list[str]:
    """A c10d job on 127.0.0.1 with short timeouts. Without the pre-flight check (on by default
    for multi-node jobs) unless `preflight`: the tests that use this measure rendezvous, faults
    and restarts, which the probe at each round's formation would only slow down."""
    conf = "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,keep_alive_timeout=2"
    if extra_conf:
        conf += "," + extra_conf
    return [
        "--nnodes",
        nnodes,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
        "--rdzv-conf",
        conf,
        "--shutdown-timeout",
        "3",
        *([] if preflight else ["--no-preflight"]),
    ]


def stop_all(agents: list[AgentProcess]) -> None:
    """Kill whatever a test left running, by pid and process group."""
    for agent in agents:
        pids = [p.pid for p in agent.descendants()]
        if agent.popen.poll() is None:
            try:
                os.killpg(agent.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            agent.popen.wait(timeout=10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_args(port: int, nnodes: str, host: str = "127.0.0.1", extra: str = "") -> list[str]:
    """`c10d_args` with one worker per node, the store (and this node) at `host`."""
    args = c10d_args(port, nnodes, extra_conf=extra)
    return [a.replace("127.0.0.1", host) for a in args] + ["--nproc-per-node", "1"]


class StoreProcess:
    """A standalone `rally store` on port 0 (log: <tmp>/store.log); `prefix` runs it under another
    command (`ip netns exec NS`: a host of its own)."""

    def __init__(self, tmp: Path, prefix: list[str] | None = None):
        self.log = tmp / "store.log"
        with open(self.log, "w") as handle:
            self.popen = start_rally(
                ["store", "--port", "0"], cwd=tmp, stdout=handle, stderr=subprocess.STDOUT, prefix=prefix or ()
            )
        found = eventually(lambda: re.search(r"listening on port (\d+)", self.log.read_text()), 60)
        assert found, self.log.read_text()
        self.port = int(found.group(1))

    def stop(self) -> None:
        """SIGKILL its process group (woken first: a test may have frozen it with SIGSTOP)."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGCONT)
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


class Cluster:
    """Agents and standalone stores for one job in `tmp`; each agent's probe writes its records
    (PROBE_OUT, tagged PROBE_NODE=its name) to `out`. `stop` kills all of them."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.out = tmp / "records.jsonl"
        self.agents: list[AgentProcess] = []
        self.stores: list[StoreProcess] = []

    def store(self, netns: str | None = None) -> StoreProcess:
        self.stores.append(StoreProcess(self.tmp, ["ip", "netns", "exec", netns] if netns else None))
        return self.stores[-1]

    def agent(
        self, name: str, args: list[str], env: dict[str, str] | None = None, netns: str | None = None
    ) -> AgentProcess:
        probe = {"PROBE_OUT": str(self.out), "PROBE_NODE": name, **(env or {})}
        prefix = ["ip", "netns", "exec", netns] if netns else None
        self.agents.append(start_agent(name, self.tmp, args, env=probe, prefix=prefix))
        return self.agents[-1]

    def records(self) -> list[dict]:
        """What the agents' probes wrote to `out` so far."""
        return read_jsonl(self.out)

    def stop(self) -> None:
        stop_all(self.agents)
        for store in self.stores:
            store.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A `Cluster` in the test's tmp directory, everything in it killed by pid/pgid afterwards."""
    made = Cluster(tmp_path)
    try:
        yield made
    finally:
        made.stop()
