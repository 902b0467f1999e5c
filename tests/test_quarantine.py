"""Quarantine: a node named as the root cause of `--quarantine-after` failures is kept out of the
next rounds while the job can run without it. Three real agents, each on a "machine" of its own
name (a UTS namespace), a real store; one node's worker fails every time it runs."""

from __future__ import annotations

import json
import re
import time

import pytest

from support.agents import StoreProcess, c10d_args, stop_all, write_script
from support.helpers import run_rally
from support.node_checks import agent, need_root

# "bad"'s worker fails after 0.5 s; the others train 6 s with three nodes, and with two until the
# test has seen what it looks for (the file RELEASE, at most 60 s), then finish.
WORKER = """
import json, os, socket, sys, time
host, world = socket.gethostname(), int(os.environ["WORLD_SIZE"])
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(json.dumps({"host": host, "world": world, "round": int(os.environ["RALLY_ROUND"])}) + "\\n")
if host == "bad":
    time.sleep(0.5)
    sys.exit(1)
if world == 3:
    time.sleep(6)
deadline = time.time() + 60
while world == 2 and not os.path.exists(os.environ["RELEASE"]) and time.time() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.timeout(240)
def test_a_node_that_caused_two_failures_is_quarantined_and_the_others_train_without_it(tmp_path):
    need_root("a host name per agent (UTS namespaces)")
    store = StoreProcess(tmp_path)
    script = write_script(tmp_path, "w.py", WORKER)
    out = tmp_path / "records.jsonl"
    agents = []
    try:
        args = [
            *c10d_args(store.port, "2:3"),
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "5",
            str(script),
        ]  # (c10d_args: --no-preflight)
        env = {"PROBE_OUT": str(out), "RELEASE": str(tmp_path / "release")}
        agents = [
            agent(tmp_path, h, [*args[:-1], "--log-dir", str(tmp_path / f"logs-{h}"), args[-1]], env)
            for h in ("good1", "bad", "good2")
        ]
        bad = agents[1]
        assert bad.wait(150) == 3, bad.output()
        text = bad.output()
        line = [ln for ln in text.splitlines() if "quarantined" in ln]
        assert len(line) == 1 and "node bad is quarantined (the root cause of 2 failures within 3600 s" in line[0], text
        assert "Traceback" not in text
        # While the two good nodes train, `rally status` lists the quarantined node.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            json.loads(r)["world"] == 2 for r in out.read_text().splitlines()
        ):
            time.sleep(0.1)
        status = run_rally(
            ["status", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "testjob"], cwd=tmp_path, timeout=30
        )
        assert status.returncode == 0 and "quarantined: bad (the root cause of 2 failures" in status.stdout, (
            status.describe()
        )
        again = agent(tmp_path, "bad", [*args[:-1], "--log-dir", str(tmp_path / "logs-bad-again"), args[-1]], env)
        agents.append(again)
        assert again.wait(60) == 3 and "node bad is quarantined" in again.output(), (
            again.output()
        )  # started again: leaves at join
        (tmp_path / "release").touch()
        for good in (agents[0], agents[2]):
            assert good.wait(90) == 0, good.output()
            assert re.search(
                r"node bad is quarantined \(the root cause of 2 failures.*\); the job goes on without it", good.output()
            ), good.output()
        records = [json.loads(r) for r in out.read_text().splitlines()]
        assert [r["round"] for r in records if r["host"] == "bad"] == [0, 1]  # never admitted again
        assert {r["host"] for r in records if r["world"] == 2} == {"good1", "good2"}
        for h in ("good1", "good2"):
            (report,) = (tmp_path / f"logs-{h}").glob("*/report.json")
            assert "bad" in json.loads(report.read_text())["quarantined"]
        (report,) = (tmp_path / "logs-bad").glob("*/report.json")
        assert json.loads(report.read_text())["outcome"] == "quarantined"
    finally:
        stop_all(agents)
        store.stop()


def test_failures_count_once_per_round_and_only_within_the_window():
    from rally.agent.checks.quarantine import recent_failures, record_failure

    record: dict = {"failures": {}, "quarantined": {}}
    record_failure(record, "n1", 4, 1000.0)
    record_failure(record, "n1", 4, 1000.5)  # a second node writing the same round's end
    record_failure(record, "n1", 7, 2000.0)
    assert record["failures"]["n1"] == [[4, 1000.0], [7, 2000.0]]
    assert recent_failures(record, "n1", 3600, 2001.0) == 2
    assert recent_failures(record, "n1", 500, 2001.0) == 1
    assert recent_failures(record, "n2", 3600, 2001.0) == 0


def test_under_slurm_the_line_names_the_node_to_exclude_on_requeue():
    """SLURM says how to keep the node out (launcher/schedulers/slurm.py `agent_view`); the agent
    only prints it."""
    from rally.agent.checks.quarantine import excluded_line
    from rally.launcher.schedulers.slurm import SlurmJob, expand_hostlist

    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "gpu[17-18]",
           "SLURM_STEP_NUM_NODES": "2", "SLURMD_NODENAME": "gpu17"}  # fmt: skip
    slurm = SlurmJob.from_env(env, expand=expand_hostlist)
    assert slurm is not None
    line = excluded_line("gpu17.cluster", "the root cause of 2 failures", slurm.agent_view().keep_node_out)
    assert line.startswith(
        "node gpu17.cluster is quarantined (the root cause of 2 failures); this agent leaves the job"
    )
    assert line.endswith(
        "to keep SLURM node gpu17 out when the job is requeued: scontrol update JobId=4242 ExcNodeList=gpu17"
    )
    assert "SLURM" not in excluded_line("n1", "x")
