"""A node's checkpoint holder dies, then a worker inside `rally.job.run` fails: the re-entered
worker must see what a new worker would, that the memory tier is off (RALLY_CKPT_HOLDER_LOST),
and not keep talking to the dead holder of an earlier round.

Real rally, one worker in the node's memory tier without a checkpoint directory: it saves three
steps, SIGKILLs the holder (its pid is in the worker's environment), waits until it is dead and
raises. The job has one restart to spend.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.helpers import clean_env, read_events, run_rally

pytestmark = pytest.mark.torch

TRAIN = textwrap.dedent(
    """
    import json, os, signal, time
    from pathlib import Path
    import torch
    from rally import job

    OUT = Path(os.environ["OUT"])
    weights = torch.zeros(4)
    entries = 0

    def dead(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    def train():
        global entries
        entries += 1
        ckpt = job.load_latest()
        start = ckpt.step if ckpt is not None else 0
        for step in range(start + 1, 7):
            weights.add_(1.0)
            job.save({"w": weights}, step)
            if entries == 1 and step == 3:
                holder = int(os.environ["RALLY_CKPT_HOLDER_PID"])
                os.kill(holder, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while not dead(holder):
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                time.sleep(0.5)  # the agent's next look at it
                raise ValueError("injected after the holder died")
        (OUT / "result").write_text(json.dumps({"entries": entries, "start": start, "pid": os.getpid()}))

    job.run(train)
    """
)


@pytest.mark.timeout(200)
def test_a_worker_re_entered_after_its_holder_died_sees_the_tier_off(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    argv = ["--nproc-per-node", "1", "--max-restarts", "1", "--log-dir", str(logs), str(script)]
    result = run_rally(argv, cwd=tmp_path, env=clean_env(OUT=str(out)), timeout=150)
    text = result.describe()
    assert result.returncode == 0, text
    assert "checkpoint refused" not in text and "unreachable" not in text, text
    done = json.loads((out / "result").read_text())
    assert done["entries"] == 2 and done["start"] == 0, text  # re-entered; the memory copies died with the holder
    events = read_events(logs)
    assert [e["in_process"] for e in events if e["event"] == "restart"] == [True], text
