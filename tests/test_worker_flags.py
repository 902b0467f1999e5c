"""torchrun 2.13's newer flags under rally, compared with torchrun where the behaviour shows:
--duplicate-stdout-filters / --duplicate-stderr-filters (with the `,,` escape) and
--virtual-local-rank; the others are accepted, and their bad values are one line and exit 2."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally, write_probe

PROBE = """
    import json, os, sys
    print("apple pie", os.environ["RANK"])
    print("banana", os.environ["RANK"])
    print("a,b here", os.environ["RANK"])
    print("err orange", os.environ["RANK"], file=sys.stderr)
    keys = ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
    with open(os.path.join(sys.argv[1], "env_" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
"""


def launch(tmp_path: Path, name: str, torchrun: bool) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """One run of PROBE (written by the caller, once: the two launchers may run at the same time)."""
    probe = tmp_path / "probe.py"
    out, logs = tmp_path / f"{name}_out", tmp_path / f"{name}_logs"
    out.mkdir()
    args = [
        "--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(logs), "--virtual-local-rank",
        "--duplicate-stdout-filters", "apple,a,,b", "--duplicate-stderr-filters", "orange", str(probe), str(out),
    ]  # fmt: skip
    argv = [sys.executable, "-m", "torch.distributed.run", *args] if torchrun else None
    env = clean_env(CUDA_VISIBLE_DEVICES="5,7", RALLY_NO_PRELOAD="1", RALLY_PRELOAD=None)
    result = run_rally(args, cwd=tmp_path, env=env, argv=argv, timeout=120)
    assert result.returncode == 0, result.describe()
    filtered = {p.name: sorted(p.read_text().splitlines()) for p in logs.glob("*/attempt_0/filtered_*.log")}
    envs = {p.stem: json.loads(p.read_text()) for p in out.glob("env_*.json")}
    return filtered, envs


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_duplicate_filters_and_virtual_local_rank_match_torchrun(tmp_path: Path) -> None:
    write_probe(tmp_path / "probe.py", PROBE)
    # Older torchruns (before these flags, e.g. 2.8; .ci/torch-matrix) have nothing to compare with.
    compare = torchrun_knows("--virtual-local-rank", "--duplicate-stdout-filters", "--duplicate-stderr-filters")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrun") as pool:
        # torchrun's run beside rally's (each its own --standalone port, logs and outputs): the
        # two are compared after both ended, so they need not wait for each other.
        under_torchrun = pool.submit(launch, tmp_path, "torchrun", True) if compare else None
        r_filtered, r_envs = launch(tmp_path, "rally", torchrun=False)
        t_filtered, t_envs = under_torchrun.result() if under_torchrun else (None, None)
    assert r_filtered["filtered_stdout.log"] == [
        "[default0]:a,b here 0",
        "[default0]:apple pie 0",
        "[default1]:a,b here 1",
        "[default1]:apple pie 1",
    ]
    assert r_filtered["filtered_stderr.log"] == ["[default0]:err orange 0", "[default1]:err orange 1"]
    assert r_envs == {
        "env_0": {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "5"},
        "env_1": {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "7"},
    }
    if compare:
        assert r_filtered == t_filtered and r_envs == t_envs


def torchrun_knows(*flags: str) -> bool:
    """Whether this torch's torchrun has these flags (its own argument parser says)."""
    from torch.distributed.run import get_args_parser

    known = {option for action in get_args_parser()._actions for option in action.option_strings}
    return all(flag in known for flag in flags)


@pytest.mark.timeout(60)
def test_accepted_flags_say_what_rally_does_with_them(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "ok.py", "print('ok')\n")
    args = ["--standalone", "--no-preload", "--event-log-handler", "console", "--numa-binding", "node", str(probe)]
    result = run_rally(args, cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    assert "--event-log-handler console: rally records its events in events.jsonl" in result.stderr
    assert "--numa-binding node: " in result.stderr and "workers keep every CPU" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--logs-specs", "nosuchspec"],
            "--logs-specs 'nosuchspec': no entry point of that name in the 'torchrun.logs_specs' group",
        ),
        (["--nproc-per-node", "xpu"], "--nproc-per-node xpu: no XPU is available on this node"),
        (["--numa-binding", "everywhere"], "'everywhere' is not one of"),
    ],
)
def test_bad_values_of_the_new_flags_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    probe = write_probe(tmp_path / "ok.py", "print('ok')\n")
    result = run_rally([*args, str(probe)], cwd=tmp_path)
    assert result.returncode == 2, result.describe()
    errors = [line for line in result.stderr_lines if line.startswith("rally: error:")]
    assert len(errors) == 1 and message in errors[0], result.describe()
    assert "Traceback" not in result.stderr


FLAT_LOGS = '''
import os
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs


class FlatLogs(LogsSpecs):
    """Every worker's logs flat in one folder per attempt; only rank 0's stdout also on the console."""

    def root_log_dir(self):
        return self._root_log_dir

    def reify(self, envs):
        folder = os.path.join(self._root_log_dir, "flat", "attempt" + envs[0]["TORCHELASTIC_RESTART_COUNT"])
        os.makedirs(folder, exist_ok=True)
        ranks = range(len(envs))
        for r in ranks:  # as torch's DefaultLogsSpecs does
            envs[r]["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, f"rank{r}.error.json")
        return LogsDest(
            stdouts={r: os.path.join(folder, f"rank{r}.out") for r in ranks},
            stderrs={r: os.path.join(folder, f"rank{r}.err") for r in ranks},
            tee_stdouts={0: os.path.join(folder, "rank0.out")},
            tee_stderrs={},
            error_files={r: os.path.join(folder, f"rank{r}.error.json") for r in ranks},
        )
'''

LOGS_PROBE = """
    import os, sys
    print("out of", os.environ["RANK"], os.path.basename(os.environ["TORCHELASTIC_ERROR_FILE"]))
    print("err of", os.environ["RANK"], file=sys.stderr)
"""


def _install_flat_logs(site: Path) -> None:
    """A real distribution on PYTHONPATH whose entry point names FlatLogs (as a pip install would)."""
    site.mkdir()
    (site / "flatlogs.py").write_text(FLAT_LOGS)
    info = site / "flatlogs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flatlogs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = flatlogs:FlatLogs\n")


@pytest.mark.timeout(180)
def test_a_custom_logs_specs_class_decides_where_logs_go_as_under_torchrun(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install_flat_logs(site)
    probe = write_probe(tmp_path / "probe.py", LOGS_PROBE)

    def run(name: str, torchrun: bool) -> tuple[dict[str, list[str]], list[str]]:
        """The log files FlatLogs placed ({path: words}) and the tee'd console lines of one launcher."""
        logs = tmp_path / f"{name}_logs"
        args = ["--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--logs-specs", "flat", str(probe)]
        argv = [sys.executable, "-m", "torch.distributed.run", *args] if torchrun else None
        env = clean_env(PYTHONPATH=str(site), RALLY_NO_PRELOAD="1", RALLY_PRELOAD=None)
        result = run_rally(args, cwd=tmp_path, env=env, argv=argv, timeout=120)
        assert result.returncode == 0, result.describe()
        placed = {
            str(p.relative_to(logs / "flat")): p.read_text().split()
            for p in (logs / "flat").rglob("*.*")
            if p.suffix != ".json"
        }
        return placed, [line for line in result.stdout.splitlines() if "out of" in line]

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrun") as pool:  # side by side, as above
        under_torchrun = pool.submit(run, "torchrun", True)
        under_rally = run("rally", False)
        runs = {"rally": under_rally, "torchrun": under_torchrun.result()}
    files = {name: placed for name, (placed, _) in runs.items()}
    consoles = {name: lines for name, (_, lines) in runs.items()}
    assert (
        files["rally"]
        == files["torchrun"]
        == {
            "attempt0/rank0.out": ["out", "of", "0", "rank0.error.json"],
            "attempt0/rank1.out": ["out", "of", "1", "rank1.error.json"],
            "attempt0/rank0.err": ["err", "of", "0"],
            "attempt0/rank1.err": ["err", "of", "1"],
        }
    )
    assert len(consoles["rally"]) == len(consoles["torchrun"]) == 1  # only rank 0's stdout is tee'd
    assert "out of 0" in consoles["rally"][0] and "out of 0" in consoles["torchrun"][0]


@pytest.mark.torch
@pytest.mark.timeout(150)
def test_torch_s_own_default_logs_specs_runs_the_job_launched_by_torchelastic(tmp_path: Path) -> None:
    """`--logs-specs default` names torch's DefaultLogsSpecs by its entry point: the job runs,
    the worker sees itself launched by torchelastic, and its redirected stdout lands where that
    class puts it (<log-dir>/<run-id>_*/attempt_0/0/stdout.log)."""
    probe = write_probe(
        tmp_path / "launched.py",
        """
        import torch.distributed as dist
        print("launched by torchelastic:", dist.is_torchelastic_launched())
        """,
    )
    logs = tmp_path / "logs"
    args = ["--standalone", "--run-path", "--logs-specs", "default", "--log-dir", str(logs), "--redirects", "3"]
    result = run_rally([*args, "--rdzv-id", "spec1", str(probe)], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    outputs = list(logs.glob("*_*/attempt_0/0/stdout.log"))
    assert len(outputs) == 1 and outputs[0].read_text() == "launched by torchelastic: True\n", outputs
