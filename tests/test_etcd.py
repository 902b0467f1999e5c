"""rally's rendezvous on a real 3-member etcd cluster: the store's operations, and whole jobs that
survive the loss of the etcd leader and of a node.

The cluster (tests/support/etcd_cluster.py) runs on loopback with ports from the OS; the agents are real
`rally` processes and the workers are stdlib probes that log a timestamped step every 50 ms, so
a pause in training is measured from the workers' own progress, not from rally's log.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from rally.rendezvous.base.membership import RendezvousSettings
from rally.rendezvous.base.records import NodeInfo
from rally.rendezvous.c10d.store import StoreTimeout, StoreUnavailable
from rally.rendezvous.etcd.client import Member
from rally.rendezvous.etcd.open import open_etcd_store
from rally.rendezvous.etcd.store import EtcdStore
from rally.rendezvous.liveness import silent_peer, wait_round_end_or_dead
from rally.rendezvous.protocol import Rendezvous, RoundEnd
from rally.rendezvous.round_channel import RoundChannel
from support.agents import AgentProcess, start_agent, stop_all
from support.etcd_cluster import EtcdCluster, etcd, etcd_cluster, needs_etcd  # noqa: F401 - fixtures
from support.helpers import eventually, free_port, read_events, run_rally, write_probe
from test_bad_input import assert_one_line_only, rally_fails, the_error_line

# The lease TTL in the job tests (rally's default keep_alive_timeout): well above an etcd leader
# election, which stalls every node's calls, so a node never fences itself during one. An
# election takes about 1 s with etcd's default timing on an idle machine, but on the loaded
# 2-core CI machine one took 3 s and a TTL of 3 s (a fence after 2.8 s of silence) failed.
KEEP_ALIVE_TIMEOUT = 5.0


def store_for(cluster: EtcdCluster, op_timeout: float = 10.0) -> EtcdStore:
    members = [Member("127.0.0.1", m.client_port) for m in cluster.members]
    return open_etcd_store(members, f"test/{uuid.uuid4().hex}/", op_timeout)


# ---------------------------------------------------------------- the store's operations
@needs_etcd
@pytest.mark.timeout(60)
def test_first_wins_keys_have_exactly_one_winner_among_threads(etcd):
    store = store_for(etcd)
    results: list[tuple[bool, str]] = []
    lock = threading.Lock()

    def contend(i: int) -> None:
        outcome = store.connect_again().set_once("closer", f"node{i}")
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [value for won, value in results if won]
    assert len(results) == 8 and len(winners) == 1
    assert {value for _, value in results} == {winners[0]}  # every loser sees the winner's value
    assert store.get_str("closer") == winners[0]
    assert store.compare_set("closer", "", "late").decode() == winners[0]
    assert store.compare_set("closer", winners[0], "next").decode() == "next"


@needs_etcd
@pytest.mark.timeout(90)
def test_counters_under_concurrent_threads_never_lose_or_repeat_an_increment(etcd):
    store = store_for(etcd)
    seen: list[int] = []
    lock = threading.Lock()

    def bump() -> None:
        mine = store.connect_again()
        values = [mine.add("joined", 1) for _ in range(15)]
        with lock:
            seen.extend(values)

    threads = [threading.Thread(target=bump) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(seen) == list(range(1, 91))  # every add returned a distinct new value
    assert store.counter("joined") == 90 and store.counter("never-set") == 0
    assert store.add("joined", 10) == 100 and store.counter("joined") == 100 and store.arrive("joined") == 100
    assert not store.check("list")
    store.append("list", "a\n")
    store.append("list", "b\n")
    assert store.check("list") and store.get_unsigned("list") == b"a\nb\n"


@needs_etcd
@pytest.mark.timeout(60)
def test_multi_set_and_multi_get_and_check(etcd):
    store = store_for(etcd)
    items = {f"assign/{i}": f"value {i}" for i in range(300)}  # more than one transaction's worth
    store.multi_set(items)
    assert store.multi_get(list(items)) == [v.encode() for v in items.values()]
    assert store.check("assign/299") and not store.check("assign/300")


@needs_etcd
@pytest.mark.timeout(60)
def test_wait_is_woken_by_the_key_through_a_watch_and_times_out_cleanly(etcd):
    store = store_for(etcd)
    started = time.monotonic()
    assert not store.try_wait(["missing"], 0.5)
    assert 0.5 <= time.monotonic() - started < 3
    with pytest.raises(StoreTimeout):
        store.wait(["missing"], 0.2)

    set_at: list[float] = []

    def set_later() -> None:  # the event's producer runs late, so the waiter is surely blocked
        other = store.connect_again()
        other.set("other", "1")
        set_at.append(time.monotonic())
        other.set("closed", "1")

    threading.Timer(0.5, set_later).start()
    store.wait(["closed", "other"], 20)
    assert set_at and time.monotonic() - set_at[0] < 1.0, "a watch wakes the waiter at once (no polling interval)"
    # get blocks until the key exists, as a c10d store's get does
    threading.Timer(0.3, lambda: store.connect_again().set("late", "here")).start()
    assert store.get_str("late") == "here"


@needs_etcd
@pytest.mark.timeout(60)
def test_a_lease_keeps_its_key_while_refreshed_and_the_key_vanishes_when_it_expires(etcd):
    store = store_for(etcd)
    lease = store.grant_lease(2)
    store.set_leased("alive/0", "node0", lease)
    stop = threading.Event()
    refreshed: list[bool] = []

    def refresh() -> None:
        refresher_store = store.connect_again()
        while not stop.is_set():
            refreshed.append(refresher_store.refresh_lease(lease))
            stop.wait(0.3)

    refresher = threading.Thread(target=refresh, daemon=True)
    refresher.start()
    watcher = store.connect_again()
    assert not watcher.wait_deleted("alive/0", 3.5), "a refreshed lease must not expire"
    stop.set()
    refresher.join(5)
    assert len(refreshed) >= 5 and all(refreshed), refreshed
    stopped = time.monotonic()
    assert watcher.wait_deleted("alive/0", 10)
    gone_after = time.monotonic() - stopped
    assert gone_after < 2 + 1.5, f"the key went {gone_after:.1f} s after the last refresh (TTL 2 s)"
    assert not store.check("alive/0") and not store.refresh_lease(lease)


@needs_etcd
@pytest.mark.timeout(60)
def test_the_peer_check_tells_a_live_peer_from_one_whose_lease_ran_out(etcd):
    """After a local worker failure the agent asks whether a peer is gone (liveness.silent_peer):
    on etcd a peer's alive key holds its signed beat count and vanishes when its lease expires."""
    settings = RendezvousSettings(1, 2, keep_alive_interval=0.2, keep_alive_timeout=2)
    store = store_for(etcd)
    channels = [
        RoundChannel(store.connect_again(), settings, NodeInfo(f"n{g}", "h", "127.0.0.1", 1), 0, 2, g) for g in (0, 1)
    ]
    leases = [channel.hold_alive() for channel in channels]
    stop = threading.Event()

    def beat() -> None:  # node 1's keep-alive thread, on a connection of its own
        mine, beats = channels[1].on(store.connect_again()), 0
        while not stop.wait(settings.keep_alive_interval):
            beats += 1
            mine.refresh_alive(beats, leases[1])

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    began = time.monotonic()
    assert silent_peer(channels[0]) is None, "node 1 refreshes its lease: alive"
    assert time.monotonic() - began < 1.0
    stop.set()
    beater.join(5)
    began = time.monotonic()
    verdict = silent_peer(channels[0])  # node 1 died: its beats stop, then etcd deletes its key
    took = time.monotonic() - began
    assert verdict is not None and verdict[0] == 1 and verdict[1] >= settings.keep_alive_timeout, verdict
    assert took < settings.keep_alive_timeout + 1.5, f"{took:.2f} s"
    assert eventually(lambda: channels[0].alive_count(1) is None, 5), "its lease expires: its key is gone"


def beating_members(
    store: EtcdStore, settings: RendezvousSettings, r: int
) -> tuple[list[RoundChannel], threading.Event]:
    """Round r's two members, each refreshing its lease-held alive key from a thread (as a node's
    keep-alive thread does) until the event is set: then they are dead, as SIGKILLed nodes."""
    members = [
        RoundChannel(store.connect_again(), settings, NodeInfo(f"n{g}", "h", "127.0.0.1", 1), r, 2, g) for g in (0, 1)
    ]
    dead = threading.Event()

    def beat(member: RoundChannel, lease: int) -> None:
        beats = 0
        while not dead.wait(settings.keep_alive_interval):
            beats += 1
            member.refresh_alive(beats, lease)

    for member in members:
        lease = member.hold_alive()
        threading.Thread(target=beat, args=(member.on(store.connect_again()), lease), daemon=True).start()
    return members, dead


@needs_etcd
@pytest.mark.timeout(60)
def test_a_spare_waits_on_the_members_leases_and_ends_a_round_whose_members_all_died(etcd):
    """A node beyond --nnodes' maximum (or a relaunch) waits for the running round to end, watching its
    members' keep-alives (liveness.wait_round_end_or_dead): on etcd their signed beats, then no key."""
    settings = RendezvousSettings(1, 2, join_timeout=30, keep_alive_interval=0.2, keep_alive_timeout=2)
    store = store_for(etcd)
    spare = Rendezvous(store.connect_again(), settings, NodeInfo("spare", "h", "127.0.0.1", 1))

    def spare_waits(r: int) -> tuple[threading.Thread, list[RoundEnd]]:
        ended: list[RoundEnd] = []
        running = RoundChannel(spare.store, settings, spare.me, r, 2)
        deadline = time.monotonic() + 20
        waiter = threading.Thread(
            target=lambda: ended.append(wait_round_end_or_dead(spare, running, deadline)), daemon=True
        )
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), f"round {r} runs: the spare waits ({ended})"
        return waiter, ended

    # a member is lost: the survivor's ring ends the round; the spare's wait returns that end
    members, dead = beating_members(store, settings, 0)
    waiter, ended = spare_waits(0)
    dead.set()
    members[0].declare_lost(1, "h", settings.keep_alive_timeout)
    waiter.join(10)
    assert ended and ended[0].kind == "node_lost" and "node 1 (h) was lost" in ended[0].detail, ended
    # every member dies: the spare ends the round itself (a relaunch forms a new job)
    members, dead = beating_members(store, settings, 1)
    waiter, ended = spare_waits(1)
    dead.set()
    began = time.monotonic()
    waiter.join(15)
    assert ended and ended[0].kind == "node_lost" and "all 2 nodes of round 1" in ended[0].detail, ended
    assert time.monotonic() - began < 2 * settings.keep_alive_timeout + 1.5


@needs_etcd
@pytest.mark.timeout(60)
def test_the_store_fails_over_past_a_dead_endpoint(etcd):
    dead = Member("127.0.0.1", free_port())
    members = [dead, *(Member("127.0.0.1", m.client_port) for m in etcd.members)]
    store = open_etcd_store(members, f"test/{uuid.uuid4().hex}/", 10)
    store.set("k", "v")
    assert store.get_str("k") == "v" and store.client.member != dead


@pytest.mark.timeout(30)
def test_an_unreachable_cluster_is_one_clear_error():
    members = [Member("127.0.0.1", free_port()), Member("127.0.0.1", free_port())]
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as failure:
        open_etcd_store(members, "test/", 5, connect_timeout=1)
    assert time.monotonic() - started < 5
    message = str(failure.value)
    assert "cannot reach etcd at" in message and str(members[0]) in message and str(members[1]) in message


# ---------------------------------------------------------------- whole jobs
PROBE = """
import json, os, sys, time
out, finish_world, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "RALLY_ROUND", "TORCHELASTIC_RESTART_COUNT")}
started, step = time.time(), 0
with open(out, "a") as f:
    while True:  # one timestamped step every 50 ms; finishes only in a world of `finish_world`
        f.write(json.dumps({**env, "pid": os.getpid(), "step": step, "t": time.time()}) + "\\n")
        f.flush()
        step += 1
        if int(env["WORLD_SIZE"]) == finish_world and time.time() - started >= seconds:
            break
        time.sleep(0.05)
"""


# PROBE with a gloo all_reduce every step: a peer's death fails this worker ("connection closed")
# before the peer's lease can expire, as a DDP job's would.
GLOO_PROBE = PROBE.replace(
    "started, step = time.time(), 0",
    "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\nstarted, step = time.time(), 0",
).replace("        step += 1\n", "        step += 1\n        dist.all_reduce(torch.ones(1))\n")


class EtcdJob:
    """Agents of one job on the etcd cluster, each standing in for a node, and their workers' steps.
    `last_call_timeout`: 1 s unless a test needs to see that a round does not wait for it."""

    def __init__(self, tmp: Path, endpoints: str, nnodes: str, probe: str = PROBE, last_call_timeout: float = 1):
        self.tmp, self.endpoints, self.nnodes = tmp, endpoints, nnodes
        self.run_id = f"job-{uuid.uuid4().hex[:8]}"
        self.steps_path = tmp / "steps.jsonl"
        self.probe = write_probe(tmp / "probe.py", probe)
        self.last_call_timeout = last_call_timeout
        self.agents: list[AgentProcess] = []

    def start(
        self, name: str, finish_world: int, seconds: float, extra_conf: str = "", options: tuple[str, ...] = ()
    ) -> AgentProcess:
        """`options`: more rally options (e.g. --no-preflight where the pre-flight would only slow a test down)."""
        conf = f"join_timeout=60,last_call_timeout={self.last_call_timeout:g},keep_alive_interval=0.2"
        conf += f",keep_alive_timeout={KEEP_ALIVE_TIMEOUT:g}"
        conf += f",{extra_conf}" if extra_conf else ""
        args = [
            "--nnodes", self.nnodes, "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", self.endpoints, "--rdzv-id", self.run_id, "--local-addr", "127.0.0.1",
            "--rdzv-conf", conf, "--shutdown-timeout", "3", "--max-restarts", "3",
            "--log-dir", str(self.tmp / f"logs-{name}"), *options,
            str(self.probe), str(self.steps_path), str(finish_world), str(seconds),
        ]  # fmt: skip
        agent = start_agent(name, self.tmp, args)
        self.agents.append(agent)
        return agent

    def steps(self) -> list[dict]:
        if not self.steps_path.exists():
            return []
        return [json.loads(line) for line in self.steps_path.read_text().splitlines() if line.endswith("}")]

    def stepping(self, ranks: int, at_least: int) -> bool:
        """True when `ranks` ranks have each logged `at_least` steps."""
        counts: dict[str, int] = {}
        for s in self.steps():
            counts[s["RANK"]] = counts.get(s["RANK"], 0) + 1
        return len(counts) >= ranks and min(counts.values()) >= at_least

    def outputs(self) -> str:
        return "\n".join(f"===== {a.name}\n{a.output()}" for a in self.agents)


@pytest.fixture
def etcd_job(tmp_path: Path):
    jobs: list[EtcdJob] = []

    def make(endpoints: str, nnodes: str, **options: Any) -> EtcdJob:
        jobs.append(EtcdJob(tmp_path, endpoints, nnodes, **options))
        return jobs[-1]

    yield make
    for job in jobs:
        stop_all(job.agents)


def longest_pause(steps: list[dict]) -> float:
    """The longest gap between two consecutive steps of one worker."""
    by_pid: dict[int, list[float]] = {}
    for s in steps:
        by_pid.setdefault(s["pid"], []).append(s["t"])
    return max((b - a for times in by_pid.values() for a, b in itertools.pairwise(times)), default=0.0)


def kill_node(agent: AgentProcess) -> float:
    """SIGKILL a node as a whole: the process group of its agent and of each of its workers."""
    worker_groups: set[int] = set()
    for process in agent.descendants():
        try:
            worker_groups.add(os.getpgid(process.pid))
        except ProcessLookupError:
            pass
    worker_groups.discard(agent.popen.pid)
    killed_at = time.time()
    for pgid in [agent.popen.pid, *worker_groups]:  # the agent first: a crashed node reports nothing
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.popen.wait(timeout=10)
    return killed_at


@needs_etcd
@pytest.mark.timeout(180)
def test_the_etcd_leader_sigkilled_mid_training_costs_no_restart_and_no_pause(etcd, etcd_job):
    leader = etcd.wait_healthy()
    job = etcd_job(etcd.endpoints(first=leader), "2")  # both agents start out talking to the leader
    agents = [job.start(f"n{i}", finish_world=2, seconds=8) for i in range(2)]
    assert eventually(lambda: job.stepping(ranks=2, at_least=20), 90), job.outputs()
    killed_at = time.time()
    etcd.kill(leader)
    new_leader = eventually(lambda: etcd.leader() not in (None, leader), 20)
    assert new_leader, "the two remaining members elect a new leader"
    codes = [agent.wait(90) for agent in agents]
    steps = job.steps()
    assert codes == [0, 0], job.outputs()
    assert {(s["RALLY_ROUND"], s["TORCHELASTIC_RESTART_COUNT"]) for s in steps} == {("0", "0")}, (
        "one round, restart count 0"
    )
    assert any(s["t"] > killed_at + 3 for s in steps), "training went on after the leader died"
    pause = longest_pause(steps)
    print(f"longest pause in training: {pause:.3f} s (leader {leader.name} killed)")
    assert pause < 5.0, f"training paused {pause:.2f} s\n{job.outputs()}"
    assert "re-forming" not in job.outputs() and "restarting" not in job.outputs()


@needs_etcd
@pytest.mark.timeout(180)
def test_a_node_sigkilled_is_lost_by_lease_expiry_and_the_survivor_trains_again_within_ttl_plus_2s(etcd, etcd_job):
    job = etcd_job(etcd.endpoints(), "1:2")
    agents = [job.start(f"n{i}", finish_world=1, seconds=1) for i in range(2)]
    assert eventually(lambda: job.stepping(ranks=2, at_least=10), 90), job.outputs()
    status_argv = ["status", "--rdzv-backend", "etcd", "--rdzv-endpoint", job.endpoints, "--rdzv-id", job.run_id]

    def status_shows_both_workers() -> bool:  # records are refreshed every 2 s by each agent
        status = run_rally(status_argv, cwd=job.tmp, timeout=60)
        assert status.returncode == 0 and f"job {job.run_id} at etcd at" in status.stdout, status.describe()
        return status.stdout.count("running") == 2

    assert eventually(status_shows_both_workers, 20), "`rally status` reads the job from etcd"
    rank0_pid = next(s["pid"] for s in job.steps() if s["GROUP_RANK"] == "0")
    victim = next(a for a in agents if rank0_pid in {p.pid for p in a.descendants()})  # the workers' store host
    survivor = next(a for a in agents if a is not victim)
    killed_at = kill_node(victim)
    assert survivor.wait(60) == 0, job.outputs()
    again = [s for s in job.steps() if s["WORLD_SIZE"] == "1"]
    assert again and {s["TORCHELASTIC_RESTART_COUNT"] for s in again} == {"0"}, job.outputs()
    back_after = min(s["t"] for s in again) - killed_at
    print(f"the survivor trained again {back_after:.2f} s after the kill (lease TTL {KEEP_ALIVE_TIMEOUT:g} s)")
    killed = time.strftime("%H:%M:%S", time.localtime(killed_at)) + f".{int(killed_at * 1000) % 1000:03d}"
    assert back_after <= KEEP_ALIVE_TIMEOUT + 2, (
        f"the survivor trained again {back_after:.2f} s after the kill at {killed}\n{job.outputs()}"
    )
    text = survivor.output()
    assert "sent no keep-alive" in text and "re-forming the job" in text, text
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in victim.descendants())


@needs_etcd
@pytest.mark.timeout(180)
def test_a_node_lost_under_gloo_is_a_node_loss_no_restart_and_the_next_round_waits_no_last_call(etcd, etcd_job):
    """The survivor's worker fails first (gloo: "connection closed by peer"), seconds before the dead
    node's lease expires: the loss is still the root cause, no restart is spent, and the next round
    closes at once (a last call of 30 s would be waited out for a node known dead)."""
    job = etcd_job(etcd.endpoints(), "1:2", probe=GLOO_PROBE, last_call_timeout=30)
    agents = [job.start(f"n{i}", finish_world=1, seconds=1, options=("--no-preflight",)) for i in range(2)]
    assert eventually(lambda: job.stepping(ranks=2, at_least=10), 120), job.outputs()
    rank1_pid = next(s["pid"] for s in job.steps() if s["GROUP_RANK"] == "1")
    victim = next(a for a in agents if rank1_pid in {p.pid for p in a.descendants()})
    survivor = next(a for a in agents if a is not victim)
    killed_at = kill_node(victim)
    assert survivor.wait(90) == 0, job.outputs()
    again = [s for s in job.steps() if s["WORLD_SIZE"] == "1"]
    back_after = min(s["t"] for s in again) - killed_at
    print(f"etcd, gloo: the survivor trained again {back_after:.2f} s after the kill (TTL {KEEP_ALIVE_TIMEOUT:g} s)")
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in again} == {"0"}, job.outputs()
    assert back_after <= KEEP_ALIVE_TIMEOUT + 2, f"{back_after:.2f} s after the kill\n{job.outputs()}"
    text = survivor.output()
    cause = [line for line in text.splitlines() if "root cause" in line]
    assert cause and "node 1" in cause[0] and "was lost" in cause[0], text
    assert not any("root cause: rank" in line for line in cause), "the gloo failure it caused is not blamed"
    events = read_events(job.tmp / f"logs-{survivor.name}")
    changes = [e["event"] for e in events if e["event"] in ("restart", "membership_change")]
    assert changes == ["membership_change"], events
    exits = [e for e in events if e["event"] == "worker_exited" and e["round"] == 0]
    assert exits and exits[0]["returncode"] not in (0, None), "the survivor's worker really failed first"


@needs_etcd
@pytest.mark.timeout(180)
def test_losing_the_whole_etcd_cluster_stops_every_node_with_a_clear_message(etcd, etcd_job):
    job = etcd_job(etcd.endpoints(), "2")
    agents = [job.start(f"n{i}", finish_world=3, seconds=0, extra_conf="read_timeout=3") for i in range(2)]
    assert eventually(lambda: job.stepping(ranks=2, at_least=10), 90), job.outputs()
    workers = {s["pid"] for s in job.steps()}
    for member in etcd.members:
        etcd.kill(member)
    codes = [agent.wait(60) for agent in agents]
    assert codes == [1, 1], job.outputs()
    for agent in agents:
        # Either the node's store watchdog (no answer for the lease TTL less one interval: it
        # cannot tell a dead cluster from being cut off) or the client's own read_timeout speaks first.
        out = agent.output()
        assert ("has not answered for" in out and "workers were stopped" in out) or (
            "is unreachable: no member answered within 3 s" in out and "so this node stops" in out
        ), job.outputs()
    assert not [
        pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]


@pytest.mark.timeout(60)
def test_etcd_unreachable_at_start_is_one_clear_line_and_a_fast_exit(tmp_path):
    endpoints = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    result = rally_fails(
        tmp_path, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", "x", "train.py"
    )
    line = the_error_line(result)
    assert "cannot reach etcd at" in line and endpoints in line and "--rdzv-endpoint" in line, line
    assert result.elapsed < 20, result.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, expected",
    [
        pytest.param(["--rdzv-backend", "etcd", "--rdzv-id", "x"], "needs --rdzv-endpoint", id="no-endpoint"),
        pytest.param(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379"], "needs --rdzv-id", id="no-run-id"),
        pytest.param(
            ["--rdzv-backend", "etcd", "--rdzv-endpoint", "ftp://h:2379", "--rdzv-id", "x"],
            "http:// or https://",
            id="scheme",
        ),
        pytest.param(
            ["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:99999", "--rdzv-id", "x"], "out of range", id="bad-port"
        ),
    ],
)
def test_bad_etcd_options_are_one_line_and_exit_2(tmp_path, args, expected):
    line = assert_one_line_only(rally_fails(tmp_path, "--nnodes", "2", *args, "train.py"))
    assert expected in line, line
