"""`rally store` and `rally status` are click subcommands with their own usage lines, listed in
`rally --help`; `rally [OPTIONS] SCRIPT` is unchanged, and a script literally named `store`
still runs (`rally ./store`, `rally -- store`). Shell completion comes from click."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally, write_probe

STORE_SCRIPT = """
    print("the user's own store script ran")
"""


@pytest.mark.timeout(60)
def test_help_lists_the_subcommands_and_each_has_its_own_usage_line(tmp_path: Path) -> None:
    top = run_rally(["--help"], cwd=tmp_path)
    assert top.returncode == 0 and top.stdout.startswith("Usage: rally [OPTIONS] [SCRIPT]"), top.describe()
    assert "Commands:" in top.stdout and "rally store" in top.stdout and "rally status" in top.stdout
    for name in ("store", "status"):
        sub = run_rally([name, "--help"], cwd=tmp_path)
        assert sub.returncode == 0 and sub.stdout.startswith(f"Usage: rally {name} [OPTIONS]"), sub.describe()
    missing = run_rally(["store"], cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr_lines[-1].endswith("Missing option '--port'."), missing.describe()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spelling", [["./store"], ["--", "store"]])
def test_a_script_named_store_still_runs(tmp_path: Path, spelling: list[str]) -> None:
    write_probe(tmp_path / "store", STORE_SCRIPT)
    result = run_rally(["--standalone", "--no-preload", *spelling], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    assert "[0] the user's own store script ran" in result.stdout, result.describe()


@pytest.mark.timeout(60)
def test_shell_completion_script_and_completions(tmp_path: Path) -> None:
    rally = shutil.which("rally", path=os.path.dirname(os.sys.executable))
    assert rally, "the rally console script is installed next to the interpreter"
    source = run_rally([], cwd=tmp_path, argv=[rally], env=clean_env(_RALLY_COMPLETE="bash_source"))
    assert source.returncode == 0 and "_rally_completion()" in source.stdout and "complete " in source.stdout, (
        source.describe()
    )
    words = clean_env(_RALLY_COMPLETE="bash_complete", COMP_WORDS="rally --nproc", COMP_CWORD="1")
    options = run_rally([], cwd=tmp_path, argv=[rally], env=words)
    assert "plain,--nproc-per-node" in options.stdout.splitlines(), options.describe()
    words = clean_env(_RALLY_COMPLETE="bash_complete", COMP_WORDS="rally st", COMP_CWORD="1")
    names = run_rally([], cwd=tmp_path, argv=[rally], env=words).stdout.splitlines()
    assert "plain,store" in names and "plain,status" in names, names
