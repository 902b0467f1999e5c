"""docs/slurm.md shows the sbatch scripts of slurm/ as they are: each is included in a
code block with pymdownx.snippets (`--8<-- "slurm/NAME"`), so the page cannot drift from the
files, and each is valid bash. The scripts themselves run on a real SLURM cluster in
tests/test_slurm_jobs.py, train.sbatch as written; that test also checks the lines the page shows
under it (its `printed` block) against what the run printed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from test_docs_render import CODE_COLUMNS

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))


@pytest.mark.timeout(30)
def test_the_slurm_page_includes_every_sbatch_script() -> None:
    page = (REPO / "docs" / "slurm.md").read_text()
    assert SCRIPTS
    missing = [s.name for s in SCRIPTS if f'--8<-- "slurm/{s.name}"' not in page]
    assert not missing, f"docs/slurm.md does not include {missing}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_each_sbatch_script_is_valid_bash_with_lines_that_fit_the_page(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=20)
    long = [n for n, line in enumerate(script.read_text().splitlines(), 1) if len(line) > CODE_COLUMNS]
    assert not long, f"{script.name}: lines over {CODE_COLUMNS} columns (cut off on the page): {long}"


@pytest.mark.timeout(30)
def test_the_plain_script_has_what_the_page_says() -> None:
    text = (REPO / "slurm" / "train.sbatch").read_text()
    for part in ("--nodes=", "--gpus-per-node=", "--time=", "--signal=B:USR1@90", "--requeue", "srun ", "trap "):
        assert part in text, part


@pytest.mark.timeout(30)
def test_the_plain_script_is_followed_by_the_lines_its_run_printed() -> None:
    page = (REPO / "docs" / "slurm.md").read_text()
    script_at = page.index('--8<-- "slurm/train.sbatch"')
    printed_at = page.index("<!-- snippet: printed ")
    next_section = page.index("## What rally takes from SLURM")
    assert script_at < printed_at < next_section, "the printed block belongs to the script"
    assert "tests/test_slurm_jobs.py" in page[printed_at : page.index("-->", printed_at)]
