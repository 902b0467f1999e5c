"""Test helpers for running several rally agents on 127.0.0.1 as if they were nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from helpers import clean_env, start_rally

REPO = Path(__file__).resolve().parents[1]


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
