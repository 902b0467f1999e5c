"""FSDP2 jobs that checkpoint only through job.save / job.load_latest resume bit-identical: after a
SIGKILL of one rank (from memory), after the loss of a whole node with a spare taking its place
(from memory, the lost node's shards coming from their replica on the surviving node; from disk
when replicas are off), and on fewer nodes (the survivor reshards the two-rank checkpoint from
disk onto one rank). No memory-tier copy outlives its job (conftest's no_shared_memory_left).

Each rally run costs seconds of torch start-ups, so one job goes through three of these faults in
turn (a rank SIGKILLed, then a node lost with a spare waiting, then a node lost with none left)
and is checked for bit-identity after each; a second job proves the node loss without replicas.

The workload is examples/train_fsdp.py (fully_shard, gloo, CPU, Adam): at every save and after a
resume each rank prints the sha256 of the full model and optimizer state, compared here with an
uninterrupted run of the same job. Nodes are rally agents on 127.0.0.1 with one worker each, so
the file starts few torch processes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rally.agent.checkpoint.sharded import files as dcp_files
from support.agents import AgentProcess, c10d_args, start_agent, stop_all
from support.fsdp_reference import EVERY, STEPS, TRAIN, digests
from support.helpers import eventually, free_port, is_alive

pytestmark = pytest.mark.torch


def train_args(ckpt: Path, *extra: str) -> list[str]:
    return ["--checkpoint-dir", str(ckpt), str(TRAIN), "--steps", str(STEPS), "--checkpoint-every", str(EVERY), *extra]


def assert_no_temps(ckpt: Path) -> None:
    assert [n for n in ckpt.iterdir() if dcp_files.TEMP_RE.match(n.name)] == []


@pytest.fixture
def reference(fsdp_reference: dict[int, str]) -> dict[int, str]:
    """The session's uninterrupted run (tests/support/fsdp_reference.py): digests by step, STEPS + 1 the end."""
    return fsdp_reference


def _start_nodes(
    tmp: Path, port: int, names: list[str], ckpt: Path, nnodes: str, *extra: str, env: dict[str, str] | None = None
) -> list[AgentProcess]:
    # last_call_timeout: a round never forms without a node that is merely slow to come back on a
    # busy machine (with --nnodes 1:2 one node would do), so every round below is the one meant.
    # No quarantine: these nodes share one host name, so two faults would quarantine "all" of them.
    rdzv = c10d_args(port, nnodes, extra_conf="last_call_timeout=30")
    args = [*rdzv, "--nproc-per-node", "1", "--max-restarts", "1", "--quarantine-after", "0"]
    args += train_args(ckpt, "--step-time", "0.25", *extra)
    return [start_agent(name, tmp, args, env=env) for name in names]


def _host(agents: list[AgentProcess]) -> AgentProcess:
    """The node hosting the rendezvous store: never the one killed (the job would go with it)."""
    assert eventually(lambda: any("hosting the rendezvous store" in a.output() for a in agents), 60), _tails(agents)
    return next(a for a in agents if "hosting the rendezvous store" in a.output())


def _tails(agents: list[AgentProcess]) -> str:
    return "\n".join(f"--- {a.name} ---\n{a.output()[-3000:]}" for a in agents)


def _members(agents: list[AgentProcess], r: int) -> list[AgentProcess]:
    """The nodes round `r` runs on, once it formed with two (any node may be the spare, the store's
    host too: after a restart the spare can be faster to join)."""

    def both() -> list[AgentProcess]:
        found = [a for a in agents if f"round {r}: node " in a.output()]
        return found if len(found) == 2 else []

    assert eventually(both, 120), _tails(agents)
    return both()


def _resumes(text: str) -> list[tuple[int, int, str]]:
    return [(step, world, digest) for step, world, digest in digests(text, "start") if step > 0]


def _new_resumes(agents: list[AgentProcess], seen: dict[str, int], count: int) -> list[tuple[int, int, str]]:
    """The next `count` resumes the ranks printed (waiting for them) after those counted in `seen`."""

    def new() -> list[tuple[int, int, str]]:
        return [x for a in agents for x in _resumes(a.output())[seen.get(a.name, 0) :]]

    assert eventually(lambda: len(new()) >= count, 120), _tails(agents)
    found = new()
    assert len(found) == count, _tails(agents)
    seen.update({a.name: len(_resumes(a.output())) for a in agents})
    return found


def _kill_once_saved(victim: AgentProcess, agents: list[AgentProcess], after: int) -> None:
    """SIGKILL `victim` and everything under it once its rank saved a step after step `after`."""
    assert eventually(lambda: any(s > after for s, _, _ in digests(victim.output(), "saved")), 120), _tails(agents)
    pids = victim.kill_node()
    assert eventually(lambda: not any(is_alive(pid) for pid in pids), 10)


def _finish_all(agents: list[AgentProcess], timeout: float) -> str:
    for agent in agents:
        try:
            agent.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(_tails(agents)) from None
    return "\n".join(a.output() for a in agents)


@pytest.mark.timeout(300)
def test_fsdp2_job_resumes_bit_identical_after_a_rank_sigkill_a_node_loss_and_on_fewer_nodes(
    tmp_path: Path, reference: dict[int, str]
) -> None:
    """One job, three faults in turn, two nodes at most (--nnodes 1:2), a third node waiting as the
    spare: rank 1 SIGKILLs itself at step 5 (both ranks resume from memory at step 4), then a whole
    node is lost and the spare takes its place (the lost rank's shards from their ring replica:
    memory), then the last other node is lost with no spare left (the store's host alone: the two
    ranks' checkpoint resharded from disk onto one rank). Bit-identical to the uninterrupted run
    at each resume."""
    port, ckpt = free_port(), tmp_path / "ckpt"
    agents: list[AgentProcess] = []
    seen: dict[str, int] = {}
    try:
        agents += _start_nodes(tmp_path, port, ["a", "b", "c"], ckpt, "1:2", "--fail-at-step", "5", "--fail-rank", "1")
        host = _host(agents)

        # 1. Rank 1 SIGKILLed: both ranks resume at step 4 from memory. Round 1 may take the spare
        # instead of a node of round 0 (all three were ready): its rank comes from the ring replica.
        first = _members(agents, 1)
        assert _new_resumes(agents, seen, 2) == [(4, 2, reference[4])] * 2, _tails(agents)
        text = "".join(a.output() for a in agents)
        assert "failed with SIGKILL" in text, _tails(agents)
        whence = (
            r"(every rank's shards from its own node|rank \d from the ring replica on node \d: its own node lost its "
            r"copy)"
        )
        assert re.search(rf"resuming from step 4 from memory \(sharded, world size 2; {whence}\)", text), _tails(agents)

        # 2. A node of round 1 lost (not the store's host), the spare takes its place: from memory,
        # the lost rank's shards from their replica on the surviving node.
        lost = [a for a in first if a is not host][0]
        _kill_once_saved(lost, agents, 4)
        second = _members([a for a in agents if a is not lost], 2)
        resumed = _new_resumes(agents, seen, 2)
        step = resumed[0][0]
        assert resumed == [(step, 2, reference[step])] * 2, _tails(agents)
        text = "".join(a.output() for a in agents)
        assert "sent no keep-alive" in text, _tails(agents)
        replica = r"rank \d from the ring replica on node \d: its own node lost its copy"
        assert re.search(rf"resuming from step {step} from memory \(sharded, world size 2; {replica}\)", text), _tails(
            agents
        )

        # 3. The other node lost too, no spare left: the store's host alone reshards from disk.
        (other,) = [a for a in second if a is not host]
        _kill_once_saved(other, agents, step)
        text = _finish_all([host], 180)
        assert host.popen.returncode == 0, _tails(agents)
        ((step, world, digest),) = _new_resumes([host], seen, 1)
        assert world == 1 and digest == reference[step], text  # two ranks' shards, one rank, same bytes
        assert f"resuming from step {step} (" in text, text
        assert "sharded, world size 1); not from memory: the world size changed (2 -> 1)" in text, text
        assert [s for s, w, _ in digests(text, "final")] == [STEPS]
        assert dcp_files.newest_intact_step(ckpt) == STEPS
        assert_no_temps(ckpt)
    finally:
        stop_all(agents)


@pytest.mark.timeout(300)
def test_fsdp2_job_without_replicas_resumes_bit_identical_from_disk_on_a_spare_after_a_node_loss(
    tmp_path: Path, reference: dict[int, str]
) -> None:
    port, ckpt = free_port(), tmp_path / "ckpt"
    agents: list[AgentProcess] = []
    try:
        # All three at once, two nodes wanted: the last to arrive waits as a spare (no race with a
        # job that could finish before a late spare started on a busy machine).
        agents += _start_nodes(tmp_path, port, ["a", "b", "c"], ckpt, "2", env={"RALLY_CKPT_REPLICAS": "0"})
        host = _host(agents)
        victim = [a for a in _members(agents, 0) if a is not host][0]
        _kill_once_saved(victim, agents, 4)
        survivors = [a for a in agents if a is not victim]
        text = _finish_all(survivors, 180)
        assert [a.popen.returncode for a in survivors] == [0, 0], text
        assert "sent no keep-alive" in text
        resumed = _new_resumes(survivors, {}, 2)
        assert {world for _, world, _ in resumed} == {2}, text
        step = resumed[0][0]
        assert {digest for _, _, digest in resumed} == {reference[step]}, text
        assert {digest for _, _, digest in digests(text, "final")} == {reference[STEPS + 1]}
        assert f"resuming from step {step} (" in text and "not from memory: step" in text, text
        assert "have no live copy in memory, neither own nor replica" in text, text
        assert_no_temps(ckpt)
    finally:
        stop_all(agents)
