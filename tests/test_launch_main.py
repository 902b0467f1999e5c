"""`rally.launch` of a function defined in the script being run (`__main__`), as torch's
`elastic_launch` runs it; what no worker can import is refused before
anything starts, with one line.

Each case is a real driver process (the agent runs inside the caller, as in test_python_api.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.helpers import Result, clean_env, run_rally, write_probe

MAIN_FUNCTION = """
    import os, rally

    class Box:
        def __init__(self, value):
            self.value = value

    def work(box, scale=1):
        return box.value * scale + int(os.environ["RANK"])

    if __name__ == "__main__":
        print("RESULTS", rally.launch({"nproc_per_node": 2}, work)(Box(10), scale=2), flush=True)
"""

UNGUARDED = """
    import os, rally

    def work():
        return int(os.environ["RANK"])

    rally.launch({"nproc_per_node": 2, "max_restarts": 0}, work)()
"""

INTERACTIVE = """
import rally, sys
def work():
    return 1
for fn in (work, lambda: 1):
    try:
        rally.launch({"nproc_per_node": 2, "log_dir": sys.argv[1]}, fn)()
    except rally.LaunchError as exc:
        print("ERROR", exc.exit_code, exc, flush=True)
"""


def drive(tmp_path: Path, argv: list[str], timeout: float = 120) -> Result:
    env = clean_env(RALLY_NO_PRELOAD=None, RALLY_PRELOAD=None)
    return run_rally([], cwd=tmp_path, env=env, argv=[sys.executable, *argv], timeout=timeout)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["script", "module"])
def test_a_function_of_the_script_being_run_runs_on_every_worker(tmp_path: Path, how: str) -> None:
    """`python train.py` and `python -m train`: the workers import the script as `__mp_main__`
    (its main block does not run again) and return each rank's result, a class of the script too."""
    write_probe(tmp_path / "train.py", MAIN_FUNCTION)
    done = drive(tmp_path, [str(tmp_path / "train.py")] if how == "script" else ["-m", "train"])
    assert done.returncode == 0, done.describe()
    assert "RESULTS {0: 20, 1: 21}" in done.stdout, done.describe()
    assert done.stdout.count("RESULTS") == 1  # the main block ran in the caller only


@pytest.mark.timeout(150)
def test_an_unguarded_launch_fails_naming_the_missing_main_guard(tmp_path: Path) -> None:
    write_probe(tmp_path / "unguarded.py", UNGUARDED)
    done = drive(tmp_path, [str(tmp_path / "unguarded.py")])
    assert done.returncode != 0, done.describe()
    assert 'put the launch under `if __name__ == "__main__":`' in done.stderr, done.describe()


@pytest.mark.timeout(60)
def test_what_no_worker_can_import_is_refused_before_anything_starts(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    done = drive(tmp_path, ["-c", INTERACTIVE, str(logs)], timeout=45)
    assert done.returncode == 0, done.describe()
    lines = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 2, done.describe()
    assert lines[0].startswith("ERROR 2 rally.launch: work is defined in __main__ of an interactive session")
    assert "define it in a .py file" in lines[0]
    assert lines[1].startswith("ERROR 2 rally.launch: cannot hand <lambda>") and "top level of a .py file" in lines[1]
    assert list(logs.iterdir()) == [] and "rally:" not in done.stderr, done.describe()  # nothing started
