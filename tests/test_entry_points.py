"""Specification: the four ways to name what a worker runs, and what the worker sees in sys.argv.

    rally ... script.py ARGS       python -u script.py ARGS          sys.argv == [script.py, *ARGS]
    rally ... -m pkg.mod ARGS      python -u -m pkg.mod ARGS         sys.argv == [<pkg/mod.py path>, *ARGS]
    rally ... --no-python EXE ARGS EXE ARGS                          argv == [EXE, *ARGS]
    rally ... --run-path FILE ARGS runpy.run_path(FILE, '__main__')  sys.argv == [FILE, *ARGS]

Everything after the script belongs to the script, even when it looks like a rally flag
(`--nnodes 5`, `--help`, `--`): these are exactly torchrun's rules. The probes write what
they saw to $PROBE_OUT, so that their argv holds only what is being tested.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.helpers import clean_env, run_probe, run_rally, write_probe

# Looks like rally's (and python's) own options; must reach the script untouched.
SCRIPT_ARGS = ["--lr", "0.1", "--nnodes", "5", "--nproc-per-node", "7", "-m", "--help", "--", "two words", ""]

ARGV_PROBE = """
    import json, os, sys
    record = {"argv": sys.argv, "name": __name__, "rank": os.environ["RANK"]}
    with open(os.path.join(os.environ["PROBE_OUT"], "argv_" + os.environ["LOCAL_RANK"] + ".json"), "w") as f:
        json.dump(record, f)
"""


def probe_records(
    tmp_path: Path, launcher_args: list[str], nproc: int = 2, env: dict[str, str] | None = None
) -> list[dict]:
    """Run rally with these arguments, and return what each local rank's probe recorded."""
    result = run_probe(tmp_path, launcher_args, nproc=nproc, env=env)
    assert result.returncode == 0, result.describe()
    records = [json.loads((tmp_path / "out" / f"argv_{rank}.json").read_text()) for rank in range(nproc)]
    assert [r["rank"] for r in records] == [str(rank) for rank in range(nproc)]
    return records


@pytest.mark.timeout(120)
def test_script_gets_its_own_path_and_every_argument_untouched(tmp_path: Path) -> None:
    write_probe(tmp_path / "train.py", ARGV_PROBE)
    for record in probe_records(tmp_path, ["train.py", *SCRIPT_ARGS]):
        assert record["argv"] == ["train.py", *SCRIPT_ARGS]
        assert record["name"] == "__main__"


# Same start either way: with -m rally's default is the template already (launcher/checks/preload.py).
@pytest.mark.same_start_either_way
@pytest.mark.timeout(120)
def test_module_runs_from_the_working_directory_like_python_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    write_probe(package / "__init__.py", "")
    module_file = write_probe(package / "entry.py", ARGV_PROBE)
    for record in probe_records(tmp_path, ["-m", "mypkg.entry", *SCRIPT_ARGS]):
        assert record["argv"] == [str(module_file), *SCRIPT_ARGS]
        assert record["name"] == "__main__"


# Same start either way: with -m rally's default is the template already (launcher/checks/preload.py).
@pytest.mark.same_start_either_way
@pytest.mark.timeout(120)
def test_module_is_found_on_pythonpath(tmp_path: Path) -> None:
    elsewhere = tmp_path / "lib"
    write_probe(elsewhere / "otherpkg" / "__init__.py", "")
    module_file = write_probe(elsewhere / "otherpkg" / "entry.py", ARGV_PROBE)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(elsewhere), env.get("PYTHONPATH")]))
    for record in probe_records(tmp_path, ["--module", "otherpkg.entry", "--x", "1"], nproc=1, env=env):
        assert record["argv"] == [str(module_file), "--x", "1"]


# Same start either way: --no-python starts every worker plainly, whatever the start mode.
@pytest.mark.same_start_either_way
@pytest.mark.timeout(120)
def test_no_python_executes_the_program_itself_with_the_arguments(tmp_path: Path) -> None:
    write_probe(
        tmp_path / "run.sh",
        """
        #!/bin/sh
        # One argument per line, then the rank; a JSON encoder would need python.
        {
          printf '%s\\n' "$0" "$@"
          printf 'RANK=%s\\n' "$RANK"
        } > "$PROBE_OUT/argv_$LOCAL_RANK.txt"
        """,
        executable=True,
    )
    args = [arg for arg in SCRIPT_ARGS if arg]  # an empty line would be ambiguous in the text format
    out = tmp_path / "out"
    out.mkdir()
    result = run_rally(
        ["--standalone", "--nproc-per-node", "2", "--no-python", "./run.sh", *args],
        cwd=tmp_path,
        env=clean_env(PROBE_OUT=str(out)),
    )
    assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        lines = (out / f"argv_{rank}.txt").read_text().splitlines()
        assert lines == ["./run.sh", *args, f"RANK={rank}"]


@pytest.mark.timeout(120)
def test_run_path_runs_the_file_as_main_with_the_arguments(tmp_path: Path) -> None:
    script = write_probe(tmp_path / "scripts" / "job.py", ARGV_PROBE)
    for record in probe_records(tmp_path, ["--run-path", str(script), *SCRIPT_ARGS]):
        assert record["argv"] == [str(script), *SCRIPT_ARGS]
        assert record["name"] == "__main__"


# Same start either way: PET_NO_PYTHON=1 starts every worker plainly, whatever the start mode.
@pytest.mark.same_start_either_way
@pytest.mark.timeout(150)
def test_pet_variables_alone_launch_a_job_and_pet_module_with_pet_no_python_is_refused(tmp_path: Path) -> None:
    """torchrun's options as PET_* variables only, no flag: PET_NO_PYTHON=1 runs the executable
    on PET_NPROC_PER_NODE workers under PET_RDZV_ID; PET_MODULE=1 beside it is the same one line
    and exit 2 as -m with --no-python; PET_MODULE=0 is unset."""
    write_probe(tmp_path / "run.sh", '#!/bin/sh\ntouch "$PROBE_OUT/$RANK-$TORCHELASTIC_RUN_ID"\n', executable=True)
    out = tmp_path / "out"
    out.mkdir()
    pet = {
        "PET_NNODES": "1", "PET_NPROC_PER_NODE": "3", "PET_RDZV_ID": "pet7", "PET_MONITOR_INTERVAL": "1",
        "PET_START_METHOD": "spawn", "PET_NO_PYTHON": "1", "PROBE_OUT": str(out),
    }  # fmt: skip
    refused = run_rally(["./run.sh"], cwd=tmp_path, env=clean_env(**pet, PET_MODULE="1"))
    assert refused.returncode == 2 and "cannot be used together" in refused.stderr, refused.describe()
    assert os.listdir(out) == [], "nothing started"
    result = run_rally(["./run.sh"], cwd=tmp_path, env=clean_env(**pet, PET_MODULE="0"))
    assert result.returncode == 0, result.describe()
    assert sorted(os.listdir(out)) == ["0-pet7", "1-pet7", "2-pet7"]
