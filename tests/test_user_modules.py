"""A user's own modules named like rally's (agent.py, launcher/, rendezvous.py, job.py,
bootstrap.py) are the ones a worker imports, whatever the entry point and start mode.

rally installs one import namespace, `rally.*`, and starts workers by file path, so nothing of
rally is on a worker's sys.path. The probe project below is the case that was reported: an RL
project whose `agent.py` defines `PPOAgent`, imported by the training script.

Runs: script and `-m`, plain starts (--no-preload) and template starts (--preload). One run
preloads torch; the other template run preloads the user's own `agent` module, which the
template must import from the user's directory, not rally's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rally
from support.helpers import REPO, clean_env, run_rally, write_probe

USER_NAMES = ("agent", "launcher", "rendezvous", "job", "bootstrap")

TRAIN = """
    import json, os, sys
    from agent import PPOAgent
    import launcher, rendezvous, job, bootstrap
    from rally import job as rally_job
    rally_job.heartbeat()  # rally's helper and the user's job.py side by side
    report = {
        "agent": PPOAgent.origin,
        "launcher": launcher.__file__,
        "rendezvous": rendezvous.__file__,
        "job": job.__file__,
        "bootstrap": bootstrap.__file__,
        "rally_job": rally_job.__file__,
        "path": sys.path,
    }
    with open(os.path.join(os.environ["OUT_DIR"], "rank_" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(report, f)
"""


def make_user_project(root: Path) -> Path:
    write_probe(root / "agent.py", "class PPOAgent:\n    origin = __file__\n")
    write_probe(root / "launcher" / "__init__.py", "NAME = 'the user launcher'\n")
    for name in ("rendezvous", "job", "bootstrap"):
        write_probe(root / f"{name}.py", f"NAME = 'the user {name}'\n")
    write_probe(root / "train.py", TRAIN)
    return root


def rally_source_dirs() -> list[Path]:
    """Every folder rally's code lives in: the repository's and the installed package's."""
    package = Path(rally.__file__).resolve().parent
    return [REPO.resolve(), package, *(REPO / d for d in ("agent", "launcher", "rendezvous"))]


def assert_user_modules(report: dict, project: Path) -> None:
    for name in USER_NAMES:
        origin = Path(report[name]).resolve()
        assert origin.parent in (project, project / "launcher"), f"{name} came from {origin}, not the user's project"
    assert Path(report["rally_job"]).resolve() != Path(report["job"]).resolve()
    for entry in report["path"]:
        resolved = Path(entry or ".").resolve()
        for source in rally_source_dirs():
            assert resolved != source and source not in resolved.parents, (
                f"rally's {source} is on the worker's sys.path: {entry}"
            )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("entry", "start"),
    [
        ("script", ["--no-preload"]),
        ("module", ["--no-preload"]),
        pytest.param("script", ["--preload", "torch"], marks=pytest.mark.torch),
        ("module", ["--preload", "agent,json"]),
    ],
)
def test_the_users_own_modules_are_imported_not_rallys(tmp_path: Path, entry: str, start: list[str]) -> None:
    project = make_user_project(tmp_path / "project").resolve()
    out = tmp_path / "out"
    out.mkdir()
    target = ["-m", "train"] if entry == "module" else ["train.py"]
    env = clean_env(OUT_DIR=str(out), RALLY_NO_PRELOAD=None, RALLY_PRELOAD=None)
    result = run_rally(["--standalone", "--nproc-per-node", "2", *start, *target], cwd=project, env=env, timeout=150)
    assert result.returncode == 0, result.describe()
    if start[0] == "--preload":
        assert "starting workers plainly" not in result.stderr, result.describe()
    reports = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert_user_modules(report, project)


@pytest.mark.timeout(180)
def test_a_non_editable_install_runs_the_users_project_with_its_orphan_guard(tmp_path: Path) -> None:
    """rally installed as a plain package (not editable) runs its helpers from that package:
    the orphan guard is alive while workers run, started from the installed files."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("rally", "agent", "launcher", "rendezvous"):  # a copy: pip builds in the tree
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
        str(source),
    ]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    project = make_user_project(tmp_path / "project").resolve()
    write_probe(
        project / "guard_probe.py",
        """
        import os, sys, psutil
        agent = psutil.Process(os.getppid())
        guards = [p for p in agent.children() if any(a.endswith("orphan_guard.py") for a in p.cmdline())]
        assert guards and guards[0].status() != psutil.STATUS_ZOMBIE, [p.cmdline() for p in agent.children()]
        print("guard", guards[0].cmdline()[-1])
        """,
    )
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(OUT_DIR=str(out), PYTHONPATH=str(site), RALLY_NO_PRELOAD=None, RALLY_PRELOAD=None)
    check = [sys.executable, "-c", "import rally; print(rally.__file__)"]
    assert subprocess.run(check, cwd=project, env=env, capture_output=True, text=True, timeout=60).stdout.startswith(
        str(site)
    )
    result = run_rally(["--standalone", "--no-preload", "guard_probe.py"], cwd=project, env=env)
    assert result.returncode == 0, result.describe()
    assert f"[0] guard {site}/rally/agent/guard/orphan_guard.py" in result.stdout, result.describe()
    result = run_rally(["--standalone", "--no-preload", "--nproc-per-node", "2", "train.py"], cwd=project, env=env)
    assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        report = json.loads((out / f"rank_{rank}.json").read_text())
        assert_user_modules(report, project)
        assert report["rally_job"].startswith(str(site)), report["rally_job"]
