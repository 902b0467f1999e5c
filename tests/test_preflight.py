"""The pre-flight check: when a round forms, before the script starts, every node runs a compute
probe and the round's nodes a collective probe over gloo; a node that fails or is slower than the
median by --preflight-factor is named with its numbers and left out while MIN allows, a spare in
its place. No mocks of the network or the CPU: a slow link is `tc netem` delay on the node's own
veth in network namespaces made for this run (a `tbf` rate limit where the kernel lacks netem),
a slow CPU is a cgroup CPU quota; each node has a host name of its own (a UTS namespace). The
two good nodes of a `--nnodes 2:3` job train."""

from __future__ import annotations

import re
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest

from support.agents import StoreProcess, c10d_args, stop_all, write_script
from support.helpers import eventually, read_events, read_jsonl, run_rally
from support.node_checks import agent, bridged_namespaces, need_root, slow_cpu, slow_link

# A DDP-style loop over gloo; each node records its steps, then finishes after STEPS steps (20),
# or at the first step at which any rank saw the file STOP_FILE (the test is done looking).
TRAIN = """
import json, os, socket, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
world = dist.get_world_size()
stop = os.environ.get("STOP_FILE")
for step in range(int(os.environ.get("STEPS", "20"))):
    t = torch.tensor([1.0, 1.0, 1.0, float(bool(stop) and os.path.exists(stop))])
    dist.all_reduce(t)
    assert int(t[0]) == world
    with open(os.environ["PROBE_OUT"], "a") as f:
        record = {"host": socket.gethostname(), "world": world, "round": int(os.environ["RALLY_ROUND"]), "step": step}
        f.write(json.dumps(record) + "\\n")
    if t[3] > 0:
        break
    time.sleep(0.05)
"""


def _check_left_out(tmp: Path, agents: list, slow: str, out: Path, what: str, while_training=None) -> None:
    bad = next(a for a in agents if a.name == slow)
    assert bad.wait(180) == 3, bad.output()
    if while_training is not None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(r["world"] == 2 for r in read_jsonl(out)):
            time.sleep(0.1)
        while_training()
    line = [ln for ln in bad.output().splitlines() if "left out by the pre-flight check" in ln]
    assert len(line) == 1 and re.search(
        rf"node {slow} is left out by the pre-flight check: slower than 2x the median \({what} \d+\.\dx the median",
        line[0],
    ), bad.output()
    for good in (a for a in agents if a.name != slow):
        assert good.wait(120) == 0, good.output()
        assert re.search(
            rf"pre-flight: node {slow} is left out of the round: slower than 2x the median \({what}", good.output()
        ), good.output()
        assert "re-forming the job: pre-flight left out " + slow in good.output()
        events = [e for e in read_events(tmp / f"logs-{good.name}") if e["event"] == "preflight"]
        named = next(n for n in events[0]["nodes"] if n["host"] == slow)
        assert named["bad"] and (named["compute"] if what == "compute" else named["link"]) > 0, events[0]
    last = max(r["step"] for r in read_jsonl(out))
    trained = {r["host"] for r in read_jsonl(out) if r["step"] == last}
    assert trained == {a.name for a in agents if a.name != slow} and {
        r["world"] for r in read_jsonl(out) if r["step"] == last
    } == {2}
    assert not [r for r in read_jsonl(out) if r["host"] == slow]  # its script never started


@pytest.mark.timeout(300)
def test_a_node_with_a_slow_link_is_named_and_left_out_while_the_two_good_nodes_train(tmp_path):
    need_root("network namespaces and tc")
    script = write_script(tmp_path, "train.py", TRAIN)
    out = tmp_path / "records.jsonl"
    agents = []
    with bridged_namespaces(3) as (nodes, bridge):
        store = StoreProcess(tmp_path, prefix=["ip", "netns", "exec", bridge])
        try:
            print(f"slow link on n1: {slow_link(nodes[1], 100)}")
            for i, ns in enumerate(nodes):
                args = [
                    *c10d_args(
                        store.port, "2:3", extra_conf="last_call_timeout=20,keep_alive_timeout=10", preflight=True
                    ),
                    "--nproc-per-node",
                    "1",
                    "--log-dir",
                    str(tmp_path / f"logs-n{i}"),
                    str(script),
                ]
                args = [a.replace("127.0.0.1", "10.77.0.1") for a in args]
                args[args.index("--local-addr") + 1] = f"10.77.0.{10 + i}"
                env = {
                    "PROBE_OUT": str(out),
                    "GLOO_SOCKET_IFNAME": "eth0",
                }  # the host names resolve nowhere: gloo binds to eth0
                agents.append(agent(tmp_path, f"n{i}", args, env, netns=ns))
            _check_left_out(tmp_path, agents, "n1", out, "link")
        finally:
            stop_all(agents)
            store.stop()


@pytest.mark.timeout(420)
def test_a_node_with_a_slow_cpu_is_named_and_left_out_while_the_two_good_nodes_train(tmp_path):
    need_root("cgroups and host names of their own")
    from torch.distributed import TCPStore

    script = write_script(tmp_path, "train.py", TRAIN)
    out = tmp_path / "records.jsonl"
    store = StoreProcess(tmp_path)
    client = TCPStore("127.0.0.1", store.port, is_master=False)

    def round0_has(nodes: int) -> bool:
        return client.add("rally/testjob/0/joined", 0) == nodes

    agents = []
    try:
        # 8 ms of CPU per 100 ms: slow even when the machine is busy. c1 starts up (its torch
        # imports) at full speed and slows down once it has joined round 0, before the round forms
        # (three nodes, at most three): at 8 % its start-up alone took some 25 s.
        with slow_cpu(0.08, period=100_000, limited=False) as cpu:
            for joined, host in enumerate(("c0", "c1", "c2")):
                conf = "join_timeout=240,last_call_timeout=200"
                args = [*c10d_args(store.port, "2:3", extra_conf=conf, preflight=True), "--nproc-per-node", "1",
                        "--metrics-port", "0", "--log-dir", str(tmp_path / f"logs-{host}"), str(script)]  # fmt: skip
                env = {
                    "PROBE_OUT": str(out),
                    "STEPS": "1200",
                    "STOP_FILE": str(tmp_path / "stop"),
                }  # trains until the checks are done
                agents.append(agent(tmp_path, host, args, env, cgroup=cpu.into if host == "c1" else ""))
                if host == "c2":
                    break  # round 0 closes now: three nodes, at most three
                # c0, then c1 join round 0 before the next node starts: c1 is node 1 of 3
                assert eventually(partial(round0_has, joined + 1), 120), agents[-1].output()
                if host == "c1":
                    cpu.limit()  # before the round forms; its template may still be importing torch

            def named_in_status_and_metrics() -> None:
                port = re.search(r"Prometheus metrics at http://[^:]+:(\d+)/metrics", agents[0].output()).group(1)
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                assert (
                    'rally_preflight_left_out{node="c1"} 1.0' in metrics
                    and 'rally_preflight_seconds{probe="compute"}' in metrics
                ), metrics
                status = run_rally(
                    ["status", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "testjob"],
                    cwd=tmp_path,
                    timeout=30,
                )
                assert (
                    status.returncode == 0 and "pre-flight of round 0: 3 nodes, 1 named, 1 left out" in status.stdout
                ), status.describe()
                assert re.search(
                    r"c1: slower than 2x the median \(compute \d+\.\dx the median\); compute \d\.\d+ s", status.stdout
                ), status.stdout
                (tmp_path / "stop").touch()

            try:
                _check_left_out(tmp_path, agents, "c1", out, "compute", named_in_status_and_metrics)
            finally:
                stop_all(agents)
    finally:
        store.stop()


def test_the_verdict_names_failing_and_slow_nodes_and_leaves_out_only_what_min_allows():
    from rally.agent.checks.preflight import judge

    def result(host: str, compute: float, link: float | None = 0.001, error: str | None = None) -> dict:
        return {"host": host, "compute": None if error else compute, "link": link, "allreduce": 0.01, "error": error}

    verdict = judge(
        {
            0: result("a", 0.1),
            1: result("b", 0.5),
            2: result("c", 0.11),
            3: result("d", 0.1, error="RuntimeError: boom"),
        },
        2.0,
        2,
    )
    assert verdict["left_out"] == [3, 1]  # a failed probe first, then the slowest
    named = {n["host"]: n["bad"] for n in verdict["nodes"]}
    assert (
        named["d"].startswith("its probe failed: RuntimeError: boom")
        and "compute 4.5x the median" in named["b"]
        and not named["a"]
    )
    tight = judge({0: result("a", 0.1), 1: result("b", 0.5), 2: result("c", 0.1, link=0.2)}, 2.0, 3)
    assert (
        tight["left_out"] == [] and tight["kept_bad"] == [2, 1] and "(MIN=3)" in tight["summary"]
    )  # the job goes on, and says so
    two = judge({0: result("a", 0.1, link=0.001), 1: result("b", 0.1, link=0.3)}, 2.0, 1)
    assert two["left_out"] == [] and two["median_link"] is None  # one pair: the link tells nobody apart
    broken = judge({0: result("a", 0, error="x"), 1: result("b", 0, error="x"), 2: result("c", 0.1)}, 2.0, 1)
    assert broken["left_out"] == [] and "no culprit" in broken["summary"]  # failed on most nodes: nobody to blame
    missing = judge({0: result("a", 0.1), 1: None, 2: result("c", 0.1)}, 2.0, 2)
    assert missing["left_out"] == [1] and "no result within the time limit" in missing["nodes"][1]["bad"]


def test_every_pair_of_ranks_meets_once_in_the_round_robin_probe():
    import importlib.util

    from rally.agent.checks.preflight import PROBE

    spec = importlib.util.spec_from_file_location("probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    for world in range(2, 10):
        turns = probe.pairings(world)
        pairs = [p for turn in turns for p in turn]
        assert sorted(pairs) == sorted((a, b) for a in range(world) for b in range(a + 1, world))
        assert all(len({r for p in turn for r in p}) == 2 * len(turn) for turn in turns)  # nobody twice in a turn
