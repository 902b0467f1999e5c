"""Nodes for the quarantine and pre-flight tests (tests/test_quarantine.py, tests/test_preflight.py):
each agent gets a host name of its own (a UTS namespace), optionally a network namespace of its
own behind a veth on a bridge (names unique per run: they include this process's pid), and a slow
link (`tc netem`) or a slow CPU (a cgroup's CPU quota, v2 `cpu.max` or v1 `cpu.cfs_quota_us`).
Everything made here is removed by the fixture or context that made it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agents import AgentProcess, start_agent

# Run the rest of argv with this host name, in a UTS namespace of its own (root only).
_SET_HOSTNAME = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"


def named(host: str) -> list[str]:
    """A command prefix that runs what follows as if on a machine called `host`."""
    return ["unshare", "--uts", sys.executable, "-c", _SET_HOSTNAME, host]


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root")
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` (util-linux) for host names of their own")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def agent(
    tmp: Path, host: str, args: list[str], env: dict[str, str], netns: str | None = None, cgroup: str = ""
) -> AgentProcess:
    """An agent on a "machine" called `host` (log: <tmp>/<host>.log), in `netns`, moved into a
    cgroup first by the `cgroup` shell snippet of `slow_cpu`."""
    prefix = (
        (["ip", "netns", "exec", netns] if netns else [])
        + (["sh", "-c", f'{cgroup} exec "$@"', "sh"] if cgroup else [])
        + named(host)
    )
    return start_agent(host, tmp, args, env, prefix=prefix)


@contextlib.contextmanager
def bridged_namespaces(nodes: int) -> Iterator[tuple[list[str], str]]:
    """A bridge namespace (the store at .1) and `nodes` node namespaces at .10, .11, ... joined to
    it by veths; yields (namespace names, bridge namespace); the node's veth is `eth0` in each."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("no `ip`/`tc` (iproute2) for network namespaces")
    tag = f"pf{os.getpid()}"
    bridge, names = f"{tag}-br", [f"{tag}-n{i}" for i in range(nodes)]
    made: list[str] = []
    try:
        for name in (bridge, *names):
            ip("netns", "add", name)
            made.append(name)
        ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge, "addr", "add", "10.77.0.1/24", "dev", "br0")
        ip("-n", bridge, "link", "set", "br0", "up")
        ip("-n", bridge, "link", "set", "lo", "up")
        for i, ns in enumerate(names):
            ip("link", "add", f"{tag}b{i}", "netns", bridge, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", bridge, "link", "set", f"{tag}b{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"10.77.0.{10 + i}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    try:
        yield names, bridge
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def slow_link(netns: str, delay_ms: int, fallback_rate: str = "40mbit") -> str:
    """Slow down what the node sends on its own end of the veth: `tc netem` delay, or, on a kernel
    built without netem (this machine's: "Specified qdisc kind is unknown"), a `tbf` rate limit.
    Returns what was done, for the test's output."""
    tc = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "eth0", "root"]
    done = subprocess.run([*tc, "netem", "delay", f"{delay_ms}ms"], capture_output=True, text=True, timeout=10)
    if done.returncode == 0:
        return f"netem delay {delay_ms} ms"
    if "unknown" not in done.stderr:
        raise RuntimeError(f"tc netem failed: {done.stderr.strip()}")
    subprocess.run(
        [*tc, "tbf", "rate", fallback_rate, "burst", "32kb", "latency", "400ms"],
        check=True,
        capture_output=True,
        timeout=10,
    )
    return f"tbf rate {fallback_rate} (this kernel has no netem)"


class SlowCpu:
    """A cgroup for one node's processes: `into` is a shell snippet that moves the shell into it
    (prefix a command with `sh -c '<snippet> exec "$@"' sh`); `limit()` gives the group its share
    of one CPU, at once for the processes already in it."""

    def __init__(self, group: Path, v2: bool, share: float, period: int):
        self.group, self.v2, self.quota, self.period = group, v2, int(period * share), period
        self.into = f"echo $$ > {group / 'cgroup.procs'} &&"

    def limit(self) -> None:
        if self.v2:
            (self.group / "cpu.max").write_text(f"{self.quota} {self.period}")
        else:
            (self.group / "cpu.cfs_period_us").write_text(str(self.period))
            (self.group / "cpu.cfs_quota_us").write_text(str(self.quota))


@contextlib.contextmanager
def slow_cpu(share: float, period: int = 50_000, limited: bool = True) -> Iterator[SlowCpu]:
    """A cgroup whose processes get `share` of one CPU (SlowCpu); with `limited=False` the share
    applies only from `limit()` on (a node that starts up at full speed, then slows down).
    cgroup v2 (`cpu.max`) where the unified hierarchy has the cpu controller, else v1
    (`cpu.cfs_quota_us`)."""
    unified = Path("/sys/fs/cgroup")
    v2 = (unified / "cgroup.controllers").exists() and "cpu" in (unified / "cgroup.controllers").read_text().split()
    if v2:
        group = unified / f"rally-slow-{os.getpid()}"
    else:
        if not (unified / "cpu" / "cpu.cfs_quota_us").exists():
            pytest.skip("no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) to slow a CPU with")
        group = unified / "cpu" / f"rally-slow-{os.getpid()}"
    group.mkdir()
    cpu = SlowCpu(group, v2, share, period)
    if limited:
        cpu.limit()
    try:
        yield cpu
    finally:
        procs = group / "cgroup.procs"
        deadline = time.monotonic() + 10
        while procs.exists() and procs.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)  # the test killed them by pid; wait until they are gone
        group.rmdir()
