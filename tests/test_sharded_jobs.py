"""FSDP2 jobs that checkpoint only through job.save / job.load_latest resume bit-identical: after a
SIGKILL of one rank (from memory), after the loss of a whole node with a spare taking its place
(from memory, the lost node's shards coming from their replica on the surviving node; from disk
when replicas are off), and on fewer nodes (the survivor reshards the two-rank checkpoint from
disk onto one rank). No memory-tier copy outlives its job (conftest's no_shared_memory_left).

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

from agents import AgentProcess, c10d_args, start_agent, stop_all
from helpers import clean_env, eventually, finish, free_port, is_alive, start_rally
from rally.agent.checkpoint import dcp_files

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_fsdp.py"
STEPS, EVERY = 20, 2
LINE = re.compile(r"\b(start|saved|final) step (\d+) world (\d+) digest ([0-9a-f]{64})$")

pytestmark = pytest.mark.torch


def digests(text: str, kind: str) -> list[tuple[int, int, str]]:
    """(step, world size, digest) of every `kind` line the workers printed, in order."""
    found = []
    for line in text.splitlines():
        match = LINE.search(line)
        if match and match.group(1) == kind:
            found.append((int(match.group(2)), int(match.group(3)), match.group(4)))
    return found


def train_args(ckpt: Path, *extra: str) -> list[str]:
    return ["--checkpoint-dir", str(ckpt), str(TRAIN), "--steps", str(STEPS), "--checkpoint-every", str(EVERY), *extra]


def assert_no_temps(ckpt: Path) -> None:
    assert [n for n in ckpt.iterdir() if dcp_files.TEMP_RE.match(n.name)] == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Digest of the full state at every saved step, and at the end (key STEPS + 1), of an
    uninterrupted two-rank run."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = start_rally(["--standalone", "--nproc-per-node", "2", *train_args(tmp / "ckpt")], cwd=tmp, env=clean_env())
    result = finish(proc, 240)
    assert result.returncode == 0, result.describe()
    saved = {step: digest for step, world, digest in digests(result.stdout, "saved") if world == 2}
    assert sorted(saved) == list(range(EVERY, STEPS + 1, EVERY)), result.describe()
    (final,) = {digest for _, _, digest in digests(result.stdout, "final")}
    return saved | {STEPS + 1: final}


@pytest.mark.timeout(300)
def test_fsdp2_job_resumes_bit_identical_from_memory_after_one_rank_is_sigkilled(
    tmp_path: Path, reference: dict[int, str]
) -> None:
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *train_args(tmp_path / "ckpt", "--fail-at-step", "9", "--fail-rank", "1")]
    result = finish(start_rally(args, cwd=tmp_path, env=clean_env()), 240)
    assert result.returncode == 0, result.describe()
    assert "SIGKILL" in result.stderr, result.describe()
    assert "resuming from step 8 from memory (sharded, world size 2; every rank's shards from its own node)" in result.stderr
    resumed = [(step, digest) for step, world, digest in digests(result.stdout, "start") if step > 0]
    assert resumed == [(8, reference[8])] * 2, result.describe()  # both ranks, the state saved at step 8
    assert {digest for _, _, digest in digests(result.stdout, "final")} == {reference[STEPS + 1]}
    assert_no_temps(tmp_path / "ckpt")


def _start_nodes(tmp: Path, port: int, names: list[str], ckpt: Path, nnodes: str, env: dict[str, str] | None = None) -> list[AgentProcess]:
    args = [*c10d_args(port, nnodes), "--nproc-per-node", "1", "--max-restarts", "1", *train_args(ckpt, "--step-time", "0.25")]
    return [start_agent(name, tmp, args, env=env) for name in names]


def _kill_a_node_after_a_save(agents: list[AgentProcess], saved_step: int, durable_in: Path | None = None) -> AgentProcess:
    """SIGKILL the node that does not host the store once it saved `saved_step` (and, given
    `durable_in`, once that step is published there: the persist runs in the background, so on
    a busy machine a save can still be in memory only); return it."""
    assert eventually(lambda: any("hosting the rendezvous store" in a.output() for a in agents), 60)
    victim = next(a for a in agents if "hosting the rendezvous store" not in a.output())
    assert eventually(lambda: any(s == saved_step for s, _, _ in digests(victim.output(), "saved")), 120), victim.output()
    if durable_in is not None:
        assert eventually(lambda: (durable_in / dcp_files.step_name(saved_step)).is_dir(), 120), victim.output()
    pids = victim.kill_node()
    assert eventually(lambda: not any(is_alive(pid) for pid in pids), 10)
    return victim


def _finish_all(agents: list[AgentProcess], timeout: float) -> str:
    for agent in agents:
        try:
            agent.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("\n".join(a.output()[-3000:] for a in agents)) from None
    return "\n".join(a.output() for a in agents)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("replicas", ["on", "off"])
def test_fsdp2_job_resumes_bit_identical_on_a_spare_after_a_whole_node_is_lost(
    tmp_path: Path, reference: dict[int, str], replicas: str
) -> None:
    port, ckpt = free_port(), tmp_path / "ckpt"
    env = {"RALLY_CKPT_REPLICAS": "1" if replicas == "on" else "0"}
    agents: list[AgentProcess] = []
    try:
        # All three at once, two nodes wanted: the last to arrive waits as a spare (no race with a
        # job that could finish before a late spare started on a busy machine).
        agents += _start_nodes(tmp_path, port, ["a", "b", "c"], ckpt, "2", env)
        assert eventually(lambda: any("waiting as a spare" in a.output() for a in agents), 120), "\n".join(a.output() for a in agents)
        active = [a for a in agents if "waiting as a spare" not in a.output()]
        victim = _kill_a_node_after_a_save(active, 6)
        survivors = [a for a in agents if a is not victim]
        text = _finish_all(survivors, 180)
        assert [a.popen.returncode for a in survivors] == [0, 0], text
        assert "sent no keep-alive" in text
        resumed = [(step, world, digest) for step, world, digest in digests(text, "start") if step > 0]
        assert len(resumed) == 2 and {world for _, world, _ in resumed} == {2}, text
        step = resumed[0][0]
        assert {digest for _, _, digest in resumed} == {reference[step]}, text
        assert {digest for _, _, digest in digests(text, "final")} == {reference[STEPS + 1]}
        if replicas == "on":  # the lost node's shards from their replica on the survivor: memory
            assert re.search(rf"resuming from step {step} from memory \(sharded, world size 2; rank \d from the ring " r"replica on node \d: its own node lost its copy\)", text), text
        else:
            assert f"resuming from step {step} (" in text and "not from memory: step" in text and "have no live copy in memory, neither own nor replica" in text, text
        assert_no_temps(ckpt)
    finally:
        stop_all(agents)


@pytest.mark.timeout(300)
def test_fsdp2_job_reshards_onto_the_surviving_node_after_a_node_loss(
    tmp_path: Path, reference: dict[int, str]
) -> None:
    port, ckpt = free_port(), tmp_path / "ckpt"
    agents: list[AgentProcess] = []
    try:
        agents += _start_nodes(tmp_path, port, ["n0", "n1"], ckpt, "1:2")
        victim = _kill_a_node_after_a_save(agents, 6, durable_in=ckpt)
        (survivor,) = [a for a in agents if a is not victim]
        text = _finish_all([survivor], 180)
        assert survivor.popen.returncode == 0, text
        resumed = [(step, world, digest) for step, world, digest in digests(text, "start") if step > 0]
        assert len(resumed) == 1, text
        step, world, digest = resumed[0]
        assert world == 1 and step >= 6 and digest == reference[step], text  # two ranks' shards, one rank, same bytes
        assert f"resuming from step {step} (" in text and "sharded, world size 1); not from memory: the world size changed (2 -> 1)" in text
        assert [s for s, w, _ in digests(text, "final")] == [STEPS]
        assert dcp_files.newest_intact_step(ckpt) == STEPS
        assert_no_temps(ckpt)
    finally:
        stop_all(agents)
