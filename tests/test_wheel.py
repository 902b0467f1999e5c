"""Packaging: `python -m build` makes an sdist and a wheel from a clean checkout, the
wheel carries exactly the `rally` package, and what it installs runs.

The checkout is the repository's tracked files (`git ls-files`, links kept as links) copied to a
temporary directory, so nothing untracked (an egg-info, a stray module) can make the build pass.
The build runs without isolation (`--no-isolation`: no network), with the setuptools and build
that the `test` extra installs. Built once per module; each test reads the result.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = {
    "rally": "rally",
    "agent": "rally/agent",
    "launcher": "rally/launcher",
    "rendezvous": "rally/rendezvous",
}
"""Where each tracked top-level folder lands in the installed package (rally/agent is a link to agent/ ...)."""


@dataclass
class Built:
    checkout: Path
    wheel: Path
    sdist: Path


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def package_files_in_source(names: list[str]) -> set[str]:
    """The files of the `rally` package as the source tree holds them, by their installed path."""
    found = set()
    for name in names:
        top, _, rest = name.partition("/")
        if top in PACKAGE_ROOTS and rest and not (REPO / name).is_symlink():
            found.add(f"{PACKAGE_ROOTS[top]}/{rest}")
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    checkout = tmp_path_factory.mktemp("checkout")
    for name in tracked_files():
        source, target = REPO / name, checkout / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        elif source.exists():  # a tracked file deleted in the work tree is not part of the checkout
            shutil.copy2(source, target)
    dist = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(checkout)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return Built(checkout, wheel, sdist)


@pytest.mark.timeout(300)
def test_the_wheel_carries_exactly_the_rally_package(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = wheel.namelist()
    payload = {n for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    expected = package_files_in_source(tracked_files())
    assert payload == expected, (
        f"in the wheel, not in the source: {sorted(payload - expected)}; "
        f"in the source, not in the wheel: {sorted(expected - payload)}"
    )
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(built.wheel) as wheel:
        assert "rally = rally.launcher.entry:main" in wheel.read(entry_points).decode()


@pytest.mark.timeout(300)
def test_the_sdist_holds_the_package_and_what_the_build_needs(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= names
    missing = package_files_in_source(tracked_files()) - names
    assert not missing, f"not in the sdist: {sorted(missing)}"


@pytest.mark.timeout(300)
def test_the_installed_wheel_runs_a_job(built: Built, tmp_path: Path) -> None:
    """Installed on its own (pip --target, no dependencies: torch, click ... come from this
    environment), the wheel's `rally` is the one imported, names its versions and runs a job."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target),
         str(built.wheel)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    env = clean_env(PYTHONPATH=str(target))
    where = subprocess.run(
        [sys.executable, "-c", "import rally, rally.agent.worker_side.job as j; "
         "print(rally.__file__); print(j.__file__)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert all(line.startswith(str(target)) for line in where.stdout.split()), where.stdout
    version = run_rally(["--version"], cwd=tmp_path, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("rally ") and "torch " in version.stdout
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from rank', os.environ['RANK'])\n")
    job = run_rally(
        ["--standalone", "--nproc-per-node", "2", "--log-dir", tmp_path / "logs", script], cwd=tmp_path, env=env
    )
    assert job.returncode == 0, job.describe()
    assert "[0] hello from rank 0" in job.stdout and "[1] hello from rank 1" in job.stdout
