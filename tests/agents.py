"""Test helpers for running several rally agents on 127.0.0.1 as if they were nodes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port the OS says is free right now (bind to 0, read it, release it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
) -> AgentProcess:
    log = tmp / f"{name}.log"
    handle = open(log, "wb")  # noqa: SIM115 - owned by the child
    # Hook: RALLY_TEST_START_MODE=plain|template picks how workers start (see start_mode_env in
    # tests/helpers.py and agent/template.py); unset keeps rally's default.
    start_mode = {"plain": {"RALLY_NO_PRELOAD": "1"}, "template": {"RALLY_PRELOAD": "torch"}}
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **start_mode.get(os.environ.get("RALLY_TEST_START_MODE", ""), {}), **(env or {})}
    popen = subprocess.Popen(
        [sys.executable, "-m", "rally", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        cwd=tmp,
        env=full_env,
        start_new_session=True,
    )
    handle.close()
    return AgentProcess(name, popen, log)


def c10d_args(port: int, nnodes: str, run_id: str = "testjob", extra_conf: str = "") -> list[str]:
    conf = "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,keep_alive_timeout=2"
    if extra_conf:
        conf += "," + extra_conf
    return [
        "--nnodes", nnodes,
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1",
        "--rdzv-conf", conf,
        "--shutdown-timeout", "3",
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


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
