"""The pre-flight check: when a round forms, before the script starts, every node runs a compute
probe and the round's nodes a collective probe over gloo; a node that fails or is slower than the
median by --preflight-factor is named with its numbers and left out while MIN allows, a spare in
its place. No mocks of the network or the CPU: a slow link is `tc netem` delay on the node's own
veth in network namespaces made for this run (a `tbf` rate limit where the kernel lacks netem), a slow CPU is a cgroup CPU quota; each node has a
host name of its own (a UTS namespace). The two good nodes of a `--nnodes 2:3` job train."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agents import c10d_args, stop_all, write_script
from helpers import run_rally
from node_checks_helpers import Store, agent, bridged_namespaces, need_root, slow_cpu, slow_link

# A DDP-style loop over gloo; each node records its steps, then finishes after 20 steps.
TRAIN = """
import json, os, socket, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
world = dist.get_world_size()
for step in range(20):
    t = torch.ones(4)
    dist.all_reduce(t)
    assert int(t[0]) == world
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps({"host": socket.gethostname(), "world": world, "round": int(os.environ["RALLY_ROUND"]), "step": step}) + "\\n")
    time.sleep(0.05)
"""


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _events(tmp: Path, host: str) -> list[dict]:
    (path,) = (tmp / f"logs-{host}").glob("*/events.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_left_out(tmp: Path, agents: list, slow: str, out: Path, what: str) -> None:
    bad = next(a for a in agents if a.name == slow)
    assert bad.wait(180) == 3, bad.output()
    line = [ln for ln in bad.output().splitlines() if "left out by the pre-flight check" in ln]
    assert len(line) == 1 and re.search(rf"node {slow} is left out by the pre-flight check: slower than 2x the median \({what} \d+\.\dx the median", line[0]), bad.output()
    for good in (a for a in agents if a.name != slow):
        assert good.wait(120) == 0, good.output()
        assert re.search(rf"pre-flight: node {slow} is left out of the round: slower than 2x the median \({what}", good.output()), good.output()
        assert "re-forming the job: pre-flight left out " + slow in good.output()
        events = [e for e in _events(tmp, good.name) if e["event"] == "preflight"]
        named = next(n for n in events[0]["nodes"] if n["host"] == slow)
        assert named["bad"] and (named["compute"] if what == "compute" else named["link"]) > 0, events[0]
    trained = {r["host"] for r in _records(out) if r["step"] == 19}
    assert trained == {a.name for a in agents if a.name != slow} and {r["world"] for r in _records(out) if r["step"] == 19} == {2}
    assert not [r for r in _records(out) if r["host"] == slow]  # its script never started


@pytest.mark.timeout(300)
def test_a_node_with_a_slow_link_is_named_and_left_out_while_the_two_good_nodes_train(tmp_path):
    need_root("network namespaces and tc")
    script = write_script(tmp_path, "train.py", TRAIN)
    out = tmp_path / "records.jsonl"
    agents = []
    with bridged_namespaces(3) as (nodes, bridge):
        store = Store(tmp_path, prefix=["ip", "netns", "exec", bridge])
        try:
            print(f"slow link on n1: {slow_link(nodes[1], 100)}")
            for i, ns in enumerate(nodes):
                args = [*c10d_args(store.port, "2:3", extra_conf="last_call_timeout=20,keep_alive_timeout=10"), "--nproc-per-node", "1", "--log-dir", str(tmp_path / f"logs-n{i}"), str(script)]
                args = [a.replace("127.0.0.1", "10.77.0.1") for a in args]
                args[args.index("--local-addr") + 1] = f"10.77.0.{10 + i}"
                env = {"PROBE_OUT": str(out), "GLOO_SOCKET_IFNAME": "eth0"}  # the host names resolve nowhere: gloo binds to eth0
                agents.append(agent(tmp_path, f"n{i}", args, env, netns=ns))
            _check_left_out(tmp_path, agents, "n1", out, "link")
        finally:
            stop_all(agents)
            store.stop()


@pytest.mark.timeout(420)
def test_a_node_with_a_slow_cpu_is_named_and_left_out_while_the_two_good_nodes_train(tmp_path):
    need_root("cgroups and host names of their own")
    script = write_script(tmp_path, "train.py", TRAIN)
    out = tmp_path / "records.jsonl"
    store = Store(tmp_path)
    agents = []
    try:
        with slow_cpu(0.08, period=100_000) as into_cgroup:  # 8 ms of CPU per 100 ms: slow even when the machine is busy
            for host in ("c0", "c1", "c2"):
                args = [*c10d_args(store.port, "2:3", extra_conf="join_timeout=240,last_call_timeout=200"), "--nproc-per-node", "1", "--log-dir", str(tmp_path / f"logs-{host}"), str(script)]
                agents.append(agent(tmp_path, host, args, {"PROBE_OUT": str(out)}, cgroup=into_cgroup if host == "c1" else ""))
            try:
                _check_left_out(tmp_path, agents, "c1", out, "compute")
            finally:
                stop_all(agents)
    finally:
        store.stop()
