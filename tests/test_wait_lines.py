"""Long waits say what they wait for and until when, for real (tests/test_waits.py reads
the code, these run the waits): a wait in slices, a worker template slow to import its preload,
a node whose node 0 never publishes its workers' store, the store's host waiting for the others
to read the job's end, and an etcd key never written. Each line comes after one interval
(WAIT_PROGRESS_SECONDS, 5 s) of waiting, so each test waits a little longer than that.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.spec import BOOTSTRAP
from rally.agent.rounds.node_waits import NodeWaits
from rally.agent.template.client import ForkedChild, TemplateClient
from rally.rendezvous.base.membership import RendezvousSettings
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import Store, StoreError, StoreTimeout, connect_tcp_store
from rally.rendezvous.etcd.client import Member
from rally.rendezvous.etcd.open import open_etcd_store
from rally.rendezvous.protocol import Assignment, NodeInfo, Rendezvous, Round, RoundChannel
from rally.rendezvous.status.long_wait import wait_in_slices
from rally.rendezvous.status.waiting import WAIT_PROGRESS_SECONDS, WaitProgress
from support.agents import AgentProcess, c10d_args, start_agent, stop_all, write_script
from support.etcd_cluster import etcd, etcd_cluster, needs_etcd  # noqa: F401 - fixtures
from support.helpers import (
    ProcessTracker,
    Result,
    clean_env,
    eventually,
    free_port,
    procs,  # noqa: F401 - a fixture
    run_rally,
    start_rally,
    wait_for,
    write_probe,
)
from support.live_rally import LiveRally

TOKEN = "wait-lines-token"
RUN_ID = "testjob"
# As c10d_args sets them, so that the test's node and the agent agree on the rules.
SETTINGS = RendezvousSettings(
    min_nodes=2, max_nodes=2, join_timeout=60, last_call_timeout=1, keep_alive_interval=0.2, keep_alive_timeout=2
)


def test_a_wait_in_slices_says_what_it_waits_for_every_interval_and_stops_at_its_bound() -> None:
    lines: list[str] = []
    never = threading.Event()
    started = time.monotonic()
    assert wait_in_slices(never.wait, WAIT_PROGRESS_SECONDS + 2, "waiting for the test's event", lines.append) is False
    took = time.monotonic() - started
    assert WAIT_PROGRESS_SECONDS + 2 <= took < WAIT_PROGRESS_SECONDS + 4, took
    assert len(lines) == 1 and re.fullmatch(r"waiting for the test's event: up to [12] s more", lines[0]), lines
    soon = threading.Event()
    threading.Timer(0.3, soon.set).start()
    started = time.monotonic()
    assert wait_in_slices(soon.wait, 60, "waiting for an event set soon", lines.append) is True
    assert time.monotonic() - started < 3 and len(lines) == 1, "a wait that ends at once says nothing"


def test_a_nodes_record_carries_the_line_of_a_wait_in_the_round_not_the_one_that_formed_it() -> None:
    said: list[str] = []
    waits = NodeWaits(said.append)
    rendezvous = WaitProgress(said.append, interval=0.0)  # as the rendezvous' own waits say theirs
    rendezvous.tick(lambda: "round 0: waiting for 1 more node: 1 of 2 joined (a); join_timeout in 583 s")
    assert waits.fields(0, rendezvous) == {}, "the round has formed: that wait is over"
    rendezvous.tick(lambda: "round 0: waiting for node 0 (a) to start the workers' store; giving up in 33 s")
    assert waits.fields(0, rendezvous) == {
        "waiting": "round 0: waiting for node 0 (a) to start the workers' store; giving up in 33 s"
    }
    waits.announce("waiting for the worker template (pid 7) to import torch before it starts workers: up to 290 s more")
    assert waits.fields(0, rendezvous)["waiting"].startswith("waiting for the worker template"), "the newest line"
    assert waits.fields(1, rendezvous) == {}, "a new round: the last round's waits are over"
    assert len(said) == 3


@pytest.mark.timeout(120)
def test_a_template_slow_to_import_its_preload_says_so_then_forks_the_worker(tmp_path: Path) -> None:
    write_probe(tmp_path / "slowload.py", f"import time\ntime.sleep({WAIT_PROGRESS_SECONDS + 3})\n")
    write_probe(tmp_path / "hello.py", "print('hello')\n")
    argv = [sys.executable, "-u", BOOTSTRAP, "script", "hello.py"]
    env = clean_env()
    warnings: list[str] = []
    lines: list[str] = []
    client = TemplateClient(
        sys.executable, BOOTSTRAP, argv, ("slowload",), env, str(tmp_path), warnings.append, lines.append
    )
    client.start()
    try:
        child = client.spawn(argv, {**env, "RANK": "0"}, str(tmp_path), subprocess.DEVNULL, None)
        assert isinstance(child, ForkedChild), warnings
        assert child.wait(30) == 0
        child.close()
    finally:
        client.stop()
    assert warnings == []
    pattern = (
        rf"waiting for the worker template \(pid {client.pid}\) to import slowload before it starts workers: up to "
        r"\d+ s more"
    )
    assert lines and all(re.fullmatch(pattern, line) for line in lines), lines


# ------------------------------------------------------------------ a node as the test's stand-in
def _connect(port: int) -> Store:
    def reconnect():  # noqa: ANN202 - torch's TCPStore
        return connect_tcp_store("127.0.0.1", port, 30, 10)

    return Store(reconnect(), f"rally/{RUN_ID}/", "the test's store", reconnect, Signer(TOKEN))


class StandIn:
    """A node of the job played by the test with rally's own protocol: it joins, keeps alive
    (so the agent watching it never declares it lost) and does only what the test says."""

    def __init__(self, port: int, group_rank: int):
        me = NodeInfo(
            node_id=f"standin:{group_rank}:{uuid.uuid4().hex[:8]}",
            host="standin",
            addr="127.0.0.1",
            nproc=1,
            preferred_rank=group_rank,
        )
        self.rdzv = Rendezvous(_connect(port), SETTINGS, me)
        self.keeper = Rendezvous(self.rdzv.store.connect_again(), SETTINGS, me)
        self.over = threading.Event()

    def join(self) -> Assignment:
        a = self.rdzv.next_round()
        threading.Thread(target=self._keep_alive, args=(Round(self.keeper, a).channel,), daemon=True).start()
        return a

    def _keep_alive(self, channel: RoundChannel) -> None:
        try:
            while not self.over.wait(SETTINGS.keep_alive_interval):
                channel.keep_alive()
        except StoreError:
            pass  # the store's host is gone: the test is over


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list]:
    """Agents, stores and stand-ins a test starts; every agent is killed by pid and group after it."""
    things: list = []
    yield things
    for thing in things:
        if isinstance(thing, StandIn):
            thing.over.set()
    stop_all([t for t in things if isinstance(t, AgentProcess)])
    for thing in things:
        if isinstance(thing, subprocess.Popen) and thing.poll() is None:
            thing.kill()
            thing.wait(10)


def _rally_store(tmp_path: Path, started: list) -> int:
    log = tmp_path / "store.log"
    with open(log, "w") as handle:
        popen = start_rally(["store", "--port", "0"], cwd=tmp_path, stdout=handle, stderr=subprocess.STDOUT)
    started.append(popen)
    found = wait_for(lambda: re.search(r"listening on port (\d+)", log.read_text()), 60)
    assert found, log.read_text()
    return int(found.group(1))


def _agent(tmp_path: Path, started: list, name: str, port: int, extra: list[str], script: Path) -> AgentProcess:
    args = [*c10d_args(port, "2", run_id=RUN_ID), "--nproc-per-node", "1", *extra, str(script)]
    agent = start_agent(name, tmp_path, args, env={"RALLY_JOB_TOKEN": TOKEN})
    started.append(agent)
    return agent


@pytest.mark.timeout(180)
def test_a_node_whose_node_0_never_publishes_the_workers_store_says_so_on_the_console_and_in_rally_status(
    tmp_path, started
):
    port = _rally_store(tmp_path, started)
    script = write_script(tmp_path, "ok.py", "print('WORKER-RAN')\n")
    agent = _agent(tmp_path, started, "node1", port, ["--node-rank", "1"], script)
    node0 = StandIn(port, 0)
    started.append(node0)
    a = node0.join()  # and never publishes its workers' store
    assert a.group_rank == 0
    line = re.compile(r"round 0: waiting for node 0 \(127\.0\.0\.1\) to start the workers' store; giving up in (\d+) s")
    found = wait_for(lambda: line.search(agent.output()), 60)
    assert found and int(found.group(1)) <= SETTINGS.keep_alive_timeout * 4 + 30, agent.output()
    status = run_rally(
        ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID], cwd=tmp_path, timeout=60
    )
    assert status.returncode == 0 and line.search(status.stdout), status.describe()
    assert "WORKER-RAN" not in agent.output(), "no worker starts without the workers' store"


@pytest.mark.timeout(180)
def test_the_store_host_waiting_for_the_others_to_read_the_end_says_so_and_goes_once_they_have(tmp_path, started):
    port = free_port()
    script = write_script(tmp_path, "fails.py", "import sys\nsys.exit(3)\n")
    host = _agent(tmp_path, started, "node0", port, ["--node-rank", "0", "--max-restarts", "0"], script)
    wait_for(lambda: "hosting the rendezvous store" in host.output(), 60, what="the agent hosting the store")
    node1 = StandIn(port, 1)
    started.append(node1)
    a = node1.join()
    assert a.group_rank == 1
    line = re.compile(
        r"round 0 ended the job: waiting for the other nodes to read that before this node, the store's host, "
        r"exits: up to (\d+) s more"
    )
    found = wait_for(lambda: line.search(host.output()), 90)
    assert found and int(found.group(1)) < 30, host.output()
    status = run_rally(
        ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID], cwd=tmp_path, timeout=60
    )
    assert line.search(status.stdout), status.describe()
    assert host.popen.poll() is None
    read_at = time.monotonic()
    Round(node1.rdzv, a).channel.acknowledge_end()  # the stand-in has read the end
    assert host.wait(30) == 3, host.output()
    assert time.monotonic() - read_at < WAIT_PROGRESS_SECONDS + 3, (
        "the host goes as soon as the others have read the end"
    )


@pytest.mark.timeout(180)
def test_a_pre_flight_probe_waiting_for_a_node_that_never_probes_says_so_on_the_console_and_in_rally_status(
    tmp_path, started
):
    port = _rally_store(tmp_path, started)
    script = write_script(tmp_path, "ok.py", "print('WORKER-RAN')\n")
    args = [
        *c10d_args(port, "2", run_id=RUN_ID, preflight=True),
        "--nproc-per-node",
        "1",
        "--node-rank",
        "0",
        str(script),
    ]
    agent = start_agent("node0", tmp_path, args, env={"RALLY_JOB_TOKEN": TOKEN})
    started.append(agent)
    node1 = StandIn(port, 1)
    started.append(node1)
    assert node1.join().group_rank == 1  # and never runs its probe: node 0's probe waits for it
    line = re.compile(
        r"pre-flight of round 0: waiting for the probe \(pid \d+: compute, all-reduce, links\) to finish: up to "
        r"(\d+) s more"
    )
    found = wait_for(lambda: line.search(agent.output()), 90)
    assert found and int(found.group(1)) < 30, agent.output()

    def status() -> Result:
        return run_rally(["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID], cwd=tmp_path)

    # The node's record is refreshed every STATUS_INTERVAL_SECONDS (2 s): the line is there within one.
    shown = eventually(lambda: (done := status()).returncode == 0 and line.search(done.stdout) and done, 15)
    assert shown, status().describe()


@needs_etcd
@pytest.mark.timeout(60)
def test_an_etcd_get_of_a_key_never_written_says_what_it_waits_for_and_times_out(etcd):  # noqa: F811 - fixture
    lines: list[str] = []
    members = [Member("127.0.0.1", m.client_port) for m in etcd.members]
    store = open_etcd_store(members, f"test/{uuid.uuid4().hex}/", WAIT_PROGRESS_SECONDS + 2, progress=lines.append)
    started_at = time.monotonic()
    with pytest.raises(StoreTimeout, match="never"):
        store.get("never")
    assert time.monotonic() - started_at < WAIT_PROGRESS_SECONDS + 5
    assert len(lines) == 1 and re.fullmatch(
        rf"waiting for store key {re.escape(store.key('never'))} in etcd at .*: up to [12] s more", lines[0]
    ), lines
    threading.Timer(0.5, lambda: store.connect_again().set("late", "here")).start()
    assert store.get_str("late") == "here" and len(lines) == 1


IGNORES_PREEMPTION = """
import signal, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # keeps "checkpointing" through the whole grace
open("ready", "w").close()
while True:
    time.sleep(0.1)
"""


@pytest.mark.timeout(90)
def test_a_preemption_grace_says_how_many_workers_it_still_waits_for(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(tmp_path / "probe.py", IGNORES_PREEMPTION)
    args = ["--standalone", "--nproc-per-node", "1", "--preemption-grace", "7", "probe.py"]  # a line after 5 s
    rally = LiveRally(args, tmp_path, clean_env(), procs)
    wait_for(lambda: (tmp_path / "ready").exists(), 60, what="the worker to start")
    os.kill(rally.proc.pid, signal.SIGUSR1)
    rally.wait_line("waiting for 1 worker(s) of this node to checkpoint and exit: up to", 3 * WAIT_PROGRESS_SECONDS)
    code, _ = rally.wait_exit(40)
    assert code == 75, rally.text()  # the grace over, the worker stopped, the job preempted
