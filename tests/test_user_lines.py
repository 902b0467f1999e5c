"""Specification: what a new user meets first, each told in one line.

    rally --no-python w.sh (w.sh in the working directory)  -> one line "did you mean ./w.sh", exit 2
    Ctrl-C while workers ignore it                          -> a line with the grace and "Ctrl-C again";
                                                               a second Ctrl-C kills them at once
    --standalone with --nnodes 2 / 1:2 / --rdzv-endpoint    -> one line naming the flags it overrides
    the endpoint's port held by another job's store         -> named at once, with that job's run id
    one worker                                              -> "1 worker", never "all 1 workers"
    --tee                                                   -> one line saying the console follows torchrun's prefix
    a worker killed by SIGKILL                              -> no "@record" hint, which cannot help there
    a --config file with several mistakes                   -> all of them in one run

Workers are plain Python (no torch): each case costs one rally start.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from rally.rendezvous.c10d.store import HOST_MARKER_WAIT_SECONDS
from support.helpers import (
    ProcessTracker,
    clean_env,
    free_port,
    procs,  # noqa: F401 - a fixture
    run_rally,
    write_probe,
)
from support.live_rally import LiveRally


# Same under load: a check of the command line, before anything starts.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_no_python_with_a_program_in_the_working_directory_asks_for_its_dot_slash(tmp_path: Path) -> None:
    write_probe(tmp_path / "w.sh", "#!/bin/sh\necho the job must not start\n", executable=True)
    result = run_rally(["--standalone", "--nproc-per-node", "2", "--no-python", "w.sh"], cwd=tmp_path)
    assert result.returncode == 2, result.describe()
    assert "Traceback" not in result.stderr and "the job must not start" not in result.stdout
    (line,) = result.stderr_lines
    assert line.startswith("rally: error: --no-python: 'w.sh' is not a program on PATH; did you mean ./w.sh"), line


@pytest.mark.timeout(90)
def test_ctrl_c_says_how_long_it_waits_and_a_second_one_kills_now(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(
        tmp_path / "stubborn.py",
        """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(120)
        """,
    )
    rally = LiveRally(
        ["--standalone", "--nproc-per-node", "1", "--shutdown-timeout", "60", "stubborn.py"],
        tmp_path,
        clean_env(),
        procs,
    )
    rally.wait_line("[0] ready", 60)
    rally.proc.send_signal(signal.SIGINT)
    rally.wait_line("received SIGINT", 30)
    line = next(line for _, line in rally.lines if "received SIGINT" in line)
    assert "up to 60 s" in line and "--shutdown-timeout" in line and "Ctrl-C again kills them now" in line, line
    second = time.monotonic()
    rally.proc.send_signal(signal.SIGINT)
    code, ended = rally.wait_exit(30)
    assert code == 128 + signal.SIGINT, rally.text()
    assert ended - second < 10, f"the second Ctrl-C took {ended - second:.1f} s, not at once\n{rally.text()}"


@pytest.mark.timeout(90)
def test_standalone_names_the_flags_it_overrides_and_one_worker_is_not_all_1_workers(tmp_path: Path) -> None:
    write_probe(tmp_path / "ok.py", "print('fine')")
    result = run_rally(
        ["--standalone", "--nnodes", "1:2", "--rdzv-endpoint", "node1:29400", "--nproc-per-node", "1", "--tee", "3",
         "ok.py"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    overrides = [line for line in result.stderr_lines if "--standalone overrides" in line]
    assert len(overrides) == 1 and "--nnodes 1:2, --rdzv-endpoint node1:29400" in overrides[0], result.describe()
    assert "job succeeded: 1 worker on 1 node finished" in result.stderr, result.describe()
    assert "all 1 workers" not in result.stderr and "1 workers" not in result.stderr
    assert "[default0]:fine" in result.stdout.splitlines(), "--tee'd lines are torchrun's: " + result.describe()


# Same under load: a check of the command line, before anything starts.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_standalone_with_nnodes_2_says_so(tmp_path: Path) -> None:
    result = run_rally(["--standalone", "--nnodes", "2", "--nproc-per-node", "1", "--no-python", "true"], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    assert any("--standalone overrides --nnodes 2:" in line for line in result.stderr_lines), result.describe()


@pytest.mark.timeout(90)
def test_a_port_held_by_another_jobs_store_is_named_at_once(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(tmp_path / "sleep.py", "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    port = free_port()
    common = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "sleep.py"]
    first = LiveRally(["--rdzv-id", "job-one", *common], tmp_path, clean_env(), procs)
    first.wait_line("[0] ready", 60)
    started = time.monotonic()
    second = run_rally(["--rdzv-id", "job-two", *common], cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - started
    assert second.returncode == 2, second.describe()
    assert f"port {port}" in second.stderr and "the store of another job (run id job-one)" in second.stderr
    # Before, it waited HOST_MARKER_WAIT_SECONDS (10 s) for a marker that never comes.
    assert elapsed < HOST_MARKER_WAIT_SECONDS, f"named after {elapsed:.1f} s\n{second.describe()}"


@pytest.mark.timeout(90)
def test_a_sigkilled_worker_gets_no_record_hint(tmp_path: Path) -> None:
    write_probe(tmp_path / "killed.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    result = run_rally(["--standalone", "--nproc-per-node", "1", "killed.py"], cwd=tmp_path)
    assert result.returncode == 128 + signal.SIGKILL, result.describe()
    assert "SIGKILL" in result.stderr and "it wrote nothing to stderr" in result.stderr, result.describe()
    assert "@record" not in result.stderr, result.describe()


# Same under load: a check of the config file, before anything starts.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_every_mistake_of_a_config_file_is_told_in_one_run(tmp_path: Path) -> None:
    write_probe(tmp_path / "train.py", "print('the job must not start')")
    (tmp_path / "job.yaml").write_text(
        "nprocs-per-node: 2\nstandalone: 1\nmax-restarts: 2.9\nnproc-per-node: two\nscript: train.py\n"
    )
    result = run_rally(["--config", "job.yaml"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.describe()
    first, *others = result.stderr_lines
    assert first.startswith("rally: error: --config job.yaml, line 1: unknown key 'nprocs-per-node'"), first
    assert "(4 mistakes, the others below)" in first, first
    assert [line.split(":")[0].strip() for line in others] == [f"--config job.yaml, line {n}" for n in (2, 3)] + [
        "--config job.yaml, line 4, 'nproc-per-node'"
    ], result.describe()
