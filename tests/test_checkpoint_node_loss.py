"""A DDP job (rally.job.save of the whole state, memory tier on) resumes
bit-identical after the loss of a whole node. Two nodes of one worker each and a spare, rally
agents on 127.0.0.1; the node that does not host the store is SIGKILLed with everything under it
once a checkpoint is durable. The round resumes from the step every node can load (the survivor
from its memory, the spare, which holds no copy, from disk), and the final parameters are those of
an uninterrupted two-rank run (examples/train.py prints their sha256): the session's one run of the
same job (tests/support/ddp_reference.py), so this file starts no torch workers for a reference of its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rally.agent.worker_side import job
from support.agents import AgentProcess, c10d_args, start_agent, stop_all
from support.ddp_reference import EVERY, STEPS, TRAIN, params_hash
from support.helpers import eventually, free_port, is_alive

pytestmark = pytest.mark.torch


@pytest.mark.timeout(400)
def test_a_ddp_job_resumes_bit_identical_on_a_spare_after_a_whole_node_is_lost(
    tmp_path: Path, ddp_clean_hash: str
) -> None:
    work = [str(TRAIN), "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
    ckpt, port = tmp_path / "ckpt", free_port()
    args = [
        *c10d_args(port, "2"),
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        "--checkpoint-dir",
        str(ckpt),
        *work,
        "--step-time",
        "0.25",
    ]
    agents: list[AgentProcess] = []
    try:
        agents += [start_agent(name, tmp_path, args) for name in ("a", "b", "c")]  # the last to arrive is the spare
        assert eventually(lambda: any("waiting as a spare" in a.output() for a in agents), 120), "\n".join(
            a.output() for a in agents
        )
        active = [a for a in agents if "waiting as a spare" not in a.output()]
        assert eventually(lambda: any("hosting the rendezvous store" in a.output() for a in active), 60)
        victim = next(a for a in active if "hosting the rendezvous store" not in a.output())
        assert eventually(lambda: any(s >= EVERY for s in job.durable_steps(ckpt)), 120), victim.output()
        pids = victim.kill_node()
        assert eventually(lambda: not any(is_alive(pid) for pid in pids), 10)
        survivors = [a for a in agents if a is not victim]
        for agent in survivors:
            agent.wait(240)
        text = "\n".join(a.output() for a in survivors)
        assert [a.popen.returncode for a in survivors] == [0, 0], text[-5000:]
        assert "sent no keep-alive" in text, text[-5000:]
        # Every rank resumes from the agreed step: the survivor's from its memory, the spare's from disk.
        assert re.search(r"rally: resuming from step \d+ \((from memory|\S*/ckpt/step_\d+\.pt)\)", text), text[-5000:]
        assert params_hash(text) == ddp_clean_hash
    finally:
        stop_all(agents)
