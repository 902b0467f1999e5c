"""Finding your job: every mode prints the exact `rally status` command at
start; that command, `rally status RUN_DIR` and `--json` show the job and why it last
restarted; once the job is over, the run directory still tells its outcome and last restart.

Real agents on loopback with stdlib workers (--no-preload); `rally status` is a real process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from support.agents import c10d_args, start_agent, stop_all, write_script
from support.helpers import Result, clean_env, eventually, free_port, rally_status, run_rally

# Rank 1 of the first attempt fails with exit code 3; after the restart every rank runs until
# the file `stop` appears.
FAIL_ONCE = """
import os, sys, time
from pathlib import Path
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(3)
while not Path("stop").exists():
    time.sleep(0.05)
"""
STATUS_LINE = re.compile(r"rally: see this job with: rally status (.+?)  \(or: rally status (\S+)\)")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["standalone", "c10d"])
def test_the_printed_status_command_and_the_run_directory_find_the_job_and_its_last_restart(tmp_path, mode):
    script = write_script(tmp_path, "fail_once.py", FAIL_ONCE)
    flags = ["--standalone"] if mode == "standalone" else c10d_args(free_port(), "1", run_id="findme")
    args = [
        *flags,
        "--nproc-per-node",
        "2",
        "--no-preload",
        "--max-restarts",
        "1",
        "--log-dir",
        str(tmp_path / "logs"),
        str(script),
    ]
    agent = start_agent(mode, tmp_path, args)
    try:
        assert eventually(lambda: "round 1:" in agent.output(), 90), agent.output()
        found = STATUS_LINE.search(agent.output())
        assert found, agent.output()
        printed_flags, run_dir = shlex.split(found.group(1)), Path(found.group(2))
        assert run_dir.is_absolute() and run_dir.parent == tmp_path / "logs" and (run_dir / "report.json").exists()
        if mode == "c10d":
            assert "--rdzv-id" in printed_flags and "findme" in printed_flags

        def shows_the_restart(done: Result) -> bool:  # the round-1 workers are listed once the node republishes
            return (
                done.returncode == 0
                and "last restart: round 0 ended (worker_failed): rank 1" in done.stdout
                and "exit code 3" in done.stdout
                and re.search(r"│ 1\s+│ \d+\s+│ running", done.stdout) is not None
            )

        # The exact command printed, run from another directory: the table and the restart's cause.
        assert eventually(lambda: shows_the_restart(rally_status(printed_flags, Path("/"))), 30), (
            rally_status(printed_flags, Path("/")).stdout + agent.output()
        )

        # The run directory (and the log dir holding only it) name the same job: node 0 runs
        # here, so its view of the job (agent/observe/job_view.py), refreshed every 2 s, answers.
        def json_of_round_1(where: Path) -> dict | None:
            done = rally_status([str(where), "--json"], Path("/"))
            assert done.returncode == 0, done.stderr
            record = json.loads(done.stdout)
            return record if record["round"] == 1 and record["nodes"][0]["round"] == 1 else None

        for where in (run_dir, tmp_path / "logs"):
            record = eventually(lambda where=where: json_of_round_1(where), 30)
            assert record, rally_status([str(where), "--json"], Path("/")).stdout
            assert record["source"] == "view" and 0 <= record["age"] < 10 and len(record["nodes"]) == 1
            assert record["last_restart"]["kind"] == "worker_failed" and record["last_restart"]["round"] == 0
            assert "exit code 3" in record["last_restart"]["detail"], record
            workers = record["nodes"][0]["workers"]
            assert sorted(w["rank"] for w in workers) == [0, 1] and {w["state"] for w in workers} == {"running"}
        (tmp_path / "stop").touch()
        assert agent.wait(60) == 0, agent.output()
    finally:
        stop_all([agent])

    # Over: the store went with the agent; the run directory still answers, at once.
    done = rally_status([str(run_dir)], Path("/"))
    assert done.returncode == 0 and done.elapsed < 10, done.describe()
    assert "has ended" in done.stdout and "outcome: succeeded, exit code 0" in done.stdout, done.stdout
    assert "last restart: round 0 ended (worker_failed): rank 1" in done.stdout, done.stdout
    record = json.loads(rally_status([str(run_dir), "--json"], Path("/")).stdout)
    assert record["source"] == "run_dir" and record["outcome"] == "succeeded" and record["exit_code"] == 0
    assert record["last_restart"]["kind"] == "worker_failed"


@pytest.mark.timeout(60)
def test_a_directory_that_is_not_a_run_is_one_line_and_exit_2(tmp_path):
    for args, expected in (
        ([str(tmp_path / "missing")], "no such directory"),
        ([str(tmp_path)], "is not a rally run directory"),
    ):
        done = rally_status(args, tmp_path)
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.describe()
        assert len(done.stderr_lines) == 1, done.stderr
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "endpoint.json").write_text(json.dumps({"run_id": name, "endpoint": "127.0.0.1:1"}))
    done = rally_status([str(tmp_path)], tmp_path)
    assert done.returncode == 2 and "holds 2 runs; give one of them" in done.stderr, done.describe()


@pytest.mark.timeout(60)
def test_status_json_of_an_unreachable_store_is_one_line_and_no_traceback(tmp_path):
    done = rally_status(
        ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "nobody", "--json", "--timeout", "1"], tmp_path
    )
    assert done.returncode != 0 and done.stdout == "" and "Traceback" not in done.stderr, done.describe()
    assert os.linesep not in done.stderr.strip(), done.stderr


RAISES_ON_RANK_1 = """
import os, time
if os.environ["RANK"] == "1":
    raise ValueError("learning rate must be positive, got -0.1")
time.sleep(0.2)
"""


@pytest.mark.timeout(120)
def test_after_a_failed_job_status_shows_its_root_cause_and_with_no_argument_lists_your_recent_runs(
    tmp_path: Path,
) -> None:
    """`rally status RUN_DIR` of a failed job names the root cause (rank, exit, the exception's last
    line), not only "outcome: failed"; `rally status` with nothing named lists this user's runs on the
    machine, newest first, with their outcomes and run directories, instead of an error. TMPDIR is the
    test's own, so only its runs are found (the default --log-dir and the run index live there)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**clean_env(), "COLUMNS": "250", "TMPDIR": str(tmp)}
    none = run_rally(["status"], cwd=tmp_path, env=env, timeout=60)
    assert none.returncode == 0 and "no runs of yours on this machine" in none.stdout, none.describe()

    ok = write_script(tmp_path, "ok.py", "print('fine')\n")
    bad = write_script(tmp_path, "bad.py", RAISES_ON_RANK_1)
    first = run_rally(["--standalone", "--no-preload", ok], cwd=tmp_path, env=env, timeout=90)
    assert first.returncode == 0, first.describe()
    failed = run_rally(
        ["--standalone", "--no-preload", "--nproc-per-node", "2", bad], cwd=tmp_path, env=env, timeout=90
    )
    assert failed.returncode == 1, failed.describe()
    run_dir = Path(STATUS_LINE.search(failed.stderr).group(2))  # type: ignore[union-attr]

    done = run_rally(["status", str(run_dir)], cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 0 and "outcome: failed, exit code 1" in done.stdout, done.describe()
    (cause,) = [line for line in done.stdout.splitlines() if line.startswith("root cause: ")]
    assert "rank 1" in cause and "ValueError: learning rate must be positive, got -0.1" in cause, done.stdout
    record = json.loads(run_rally(["status", str(run_dir), "--json"], cwd=tmp_path, env=env, timeout=60).stdout)
    assert "ValueError: learning rate must be positive" in record["root_cause"], record

    listed = run_rally(["status"], cwd=tmp_path, env=env, timeout=60)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.describe()
    lines = listed.stdout.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("    rally status ")]
    assert len(rows) == 2, listed.stdout
    assert "failed" in lines[rows[0] - 1] and "succeeded" in lines[rows[1] - 1], listed.stdout  # newest first
    assert lines[rows[0]] == f"    rally status {run_dir}", listed.stdout  # the command, whole, to copy
    runs = json.loads(run_rally(["status", "--json"], cwd=tmp_path, env=env, timeout=60).stdout)["runs"]
    assert [r["outcome"] for r in runs] == ["failed", "succeeded"] and runs[0]["run_dir"] == str(run_dir), runs
