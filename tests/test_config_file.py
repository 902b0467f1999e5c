"""Specification: a job can be described in a YAML file, and flags and environment override it.

    # job.yaml
    standalone: true
    nproc_per_node: 3
    max_restarts: 2
    script: probe.py
    args: [--lr, "0.1"]

    rally --config job.yaml

Precedence, highest first: command-line flag > PET_<NAME> environment variable (torchrun's
spelling) > the --config file > rally's default. Observed from inside the job: WORLD_SIZE of
a single-node job is its --nproc-per-node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally, write_probe

PROBE = """
    import json, os, sys
    record = {k: os.environ[k] for k in ("WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS")}
    record["argv"] = sys.argv
    with open(os.path.join(os.environ["PROBE_OUT"], "rank_" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(record, f)
"""


def run_job(tmp_path: Path, config: str | None, *flags: str, pet_nproc: str | None = None) -> list[dict]:
    """Run rally (with job.yaml when `config` is given) and return what each rank recorded."""
    write_probe(tmp_path / "probe.py", PROBE)
    out = tmp_path / "out"
    out.mkdir()
    args = list(flags)
    if config is not None:
        (tmp_path / "job.yaml").write_text(config)
        args = ["--config", "job.yaml", *args]
    env = clean_env(PROBE_OUT=str(out), PET_NPROC_PER_NODE=pet_nproc)
    result = run_rally(args, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.describe()
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    world_sizes = {r["WORLD_SIZE"] for r in records}
    assert world_sizes == {str(len(records))}, f"every rank agrees on WORLD_SIZE == the number of workers: {records}"
    return records


@pytest.mark.timeout(120)
def test_config_file_alone_describes_and_runs_the_whole_job(tmp_path: Path) -> None:
    config = """
standalone: true
nproc_per_node: 3
max_restarts: 2
script: probe.py
args: [--lr, "0.1", --nnodes, 5]
"""
    records = run_job(tmp_path, config)
    assert len(records) == 3
    for record in records:
        assert record["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert record["argv"] == ["probe.py", "--lr", "0.1", "--nnodes", "5"]


FILE_SAYS_3 = "standalone: true\nnproc_per_node: 3\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("config", "flag", "pet", "workers"),
    [
        pytest.param(None, None, None, 1, id="default-is-1"),
        pytest.param(FILE_SAYS_3, None, None, 3, id="file-beats-default"),
        pytest.param(FILE_SAYS_3, None, "2", 2, id="PET-env-beats-file"),
        pytest.param(FILE_SAYS_3, "4", "2", 4, id="flag-beats-PET-env"),
    ],
)
def test_nproc_per_node_precedence_is_flag_then_env_then_file_then_default(
    tmp_path: Path, config: str | None, flag: str | None, pet: str | None, workers: int
) -> None:
    flags = ["--standalone"] if config is None else []
    if flag is not None:
        flags += ["--nproc-per-node", flag]
    records = run_job(tmp_path, config, *flags, "probe.py", pet_nproc=pet)
    assert len(records) == workers


def test_rdzv_conf_timeout_is_torchs_name_for_join_timeout():
    """torch's static and etcd backends call the forming wait `timeout`; rally honours it."""
    from rally.launcher.config import parse_rdzv_conf

    assert parse_rdzv_conf("timeout=42")["join_timeout"] == 42
    assert parse_rdzv_conf("timeout=42,join_timeout=42")["join_timeout"] == 42
    assert parse_rdzv_conf("")["join_timeout"] == 600
