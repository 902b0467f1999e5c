"""rally as a library: `rally.run(argv)` returns the exit code, and `rally.launch` runs a Python
callable on every worker and returns per-rank results (as torch's `elastic_launch`), raising an
error that names the root cause when the job fails.

Each case runs a small driver program in its own process (the agent runs inside the caller
and installs signal handlers in its main thread; pytest's process stays out of it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally, write_probe

WORK = """
    import os

    def work(base, scale=1):
        return {"value": (base + int(os.environ["RANK"])) * scale, "world": int(os.environ["WORLD_SIZE"])}

    def fail_on_rank_1():
        if os.environ["RANK"] == "1":
            raise ValueError("bad batch 17")
        return "fine"
"""

DRIVER = """
    import json, sys
    import rally
    import work

    mode = sys.argv[1]
    if mode == "run":
        bad = rally.run(["--nproc-per-node", "lots", "ok.py"])
        good = rally.run(["--standalone", "--no-preload", "ok.py"])
        print("CODES", json.dumps([bad, good]), flush=True)
    elif mode == "launch":
        results = rally.launch({"nproc_per_node": 2, "no_preload": True}, work.work)(10, scale=2)
        print("RESULTS", json.dumps(results), flush=True)
    else:
        try:
            rally.launch({"nproc_per_node": 2}, work.fail_on_rank_1, no_preload=True, max_restarts=0)()
        except rally.LaunchError as exc:
            print("ERROR", exc.exit_code, str(exc), flush=True)
"""


def drive(tmp_path: Path, mode: str):
    write_probe(tmp_path / "work.py", WORK)
    write_probe(tmp_path / "ok.py", "print('ok')\n")
    driver = write_probe(tmp_path / "driver.py", DRIVER)
    env = clean_env(RALLY_NO_PRELOAD=None, RALLY_PRELOAD=None)
    return run_rally([], cwd=tmp_path, env=env, argv=[sys.executable, str(driver), mode], timeout=120)


@pytest.mark.timeout(150)
def test_run_returns_the_exit_code_instead_of_exiting(tmp_path: Path) -> None:
    result = drive(tmp_path, "run")
    assert result.returncode == 0, result.describe()
    line = next(x for x in result.stdout.splitlines() if x.startswith("CODES "))
    assert json.loads(line.split(" ", 1)[1]) == [2, 0], result.describe()
    errors = [x for x in result.stderr_lines if "rally: error:" in x]
    assert len(errors) == 1 and "--nproc-per-node 'lots'" in errors[0], result.describe()
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(150)
def test_launch_returns_each_ranks_result(tmp_path: Path) -> None:
    result = drive(tmp_path, "launch")
    assert result.returncode == 0, result.describe()
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.split(" ", 1)[1])
    assert results == {"0": {"value": 20, "world": 2}, "1": {"value": 22, "world": 2}}, result.describe()


@pytest.mark.timeout(150)
def test_launch_raises_an_error_naming_the_root_cause(tmp_path: Path) -> None:
    result = drive(tmp_path, "fail")
    assert result.returncode == 0, result.describe()
    line = next((x for x in result.stdout.splitlines() if x.startswith("ERROR ")), "")
    assert line.startswith("ERROR 1 rally.launch: fail_on_rank_1 failed: "), result.describe()
    assert "rank 1" in line and "ValueError: bad batch 17" in line, line
