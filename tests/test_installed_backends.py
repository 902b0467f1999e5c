"""A rendezvous backend from another package: installed with pip (from a local directory, no
network, into a target directory of its own), found through the entry-point group
`rally.rendezvous_backends` (rendezvous/backends.py `register`, `load_installed`), and a job runs
on it. rally itself is not touched: the package is the whole backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally, write_probe

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "rally-marked-store"
version = "0.1"

[project.entry-points."rally.rendezvous_backends"]
marked = "rally_marked_store:MarkedBackend"
broken = "rally_marked_store:NoSuchBackend"

[tool.setuptools]
py-modules = ["rally_marked_store"]
"""

MODULE = '''
"""rally's c10d store, opened through a backend of its own that notes each open in a file."""
import os

from rally.rendezvous.backends import C10dBackend


class MarkedBackend(C10dBackend):
    name = "marked"

    def open(self, endpoint, prefix, connect_timeout, op_timeout, signer):
        with open(os.environ["MARKED_STORE_LOG"], "a") as f:
            f.write(f"opened {prefix}\\n")
        return super().open(endpoint, prefix, connect_timeout, op_timeout, signer)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package, installed by pip into a directory that only PYTHONPATH names."""
    root = tmp_path_factory.mktemp("backend")
    package, site = root / "package", root / "site"
    package.mkdir()
    (package / "pyproject.toml").write_text(PYPROJECT)
    (package / "rally_marked_store.py").write_text(MODULE)
    # wait: short: timeout=180: a local build, no index
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(site), str(package)],
        capture_output=True, text=True, timeout=180, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(site.glob("rally_marked_store-0.1.dist-info/entry_points.txt"))
    return site


@pytest.mark.timeout(240)
def test_a_job_runs_on_a_backend_that_an_installed_package_registers(tmp_path: Path, site: Path) -> None:
    write_probe(tmp_path / "probe.py", "import os; print('rank', os.environ['RANK'], 'ran')")
    log = tmp_path / "opened.txt"
    args = ["--rdzv-backend", "marked", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "plugged"]
    env = clean_env(PYTHONPATH=str(site), MARKED_STORE_LOG=str(log))
    done = run_rally([*args, "--nproc-per-node", "2", "probe.py"], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.describe()
    assert "rank 0 ran" in done.stdout and "rank 1 ran" in done.stdout, done.describe()
    assert log.read_text().splitlines() == ["opened rally/plugged/"]  # the package's backend opened the store


@pytest.mark.timeout(120)
def test_an_installed_backend_that_cannot_load_is_one_line_and_the_others_still_work(
    tmp_path: Path, site: Path
) -> None:
    write_probe(tmp_path / "probe.py", "print('the job must not start')")
    env = clean_env(PYTHONPATH=str(site), MARKED_STORE_LOG=str(tmp_path / "opened.txt"))
    done = run_rally(["--rdzv-backend", "broken", "--rdzv-endpoint", "localhost:0", "probe.py"], cwd=tmp_path, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.describe()
    assert "--rdzv-backend 'broken': its package could not be loaded" in done.stderr, done.describe()
    assert "NoSuchBackend" in done.stderr
    done = run_rally(["--rdzv-backend", "markd", "--rdzv-endpoint", "localhost:0", "probe.py"], cwd=tmp_path, env=env)
    assert done.returncode == 2 and "or an installed one: marked; did you mean 'marked'?" in done.stderr, (
        done.describe()
    )
