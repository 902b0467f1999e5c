"""`--logs-specs NAME`: a user's `LogsSpecs` class decides where each worker's logs go, as in torchrun.

torchrun loads the class from the `torchrun.logs_specs` entry-point group, builds it with
(log_dir, redirects, tee, local_ranks_filter) and, every attempt, calls `reify(envs)`, which
returns a `LogsDest`: per local rank a stdout/stderr file ("" = the console), which of them are
also shown on the console (tee), the error file, and the filtered-output files. rally asks the
same class the same question and writes exactly where it answers; without the flag rally's own
layout (torchrun's default one) is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rally.agent.base.spec import STDERR, STDOUT, JobSpec

if TYPE_CHECKING:  # torch's own class, or --logs-specs' (imported when used)
    from torch.distributed.elastic.multiprocessing import LogsSpecs


@dataclass(frozen=True)
class StreamPlan:
    """Where one worker's streams go this attempt."""

    redirect: int  # stream bits written to a file
    tee: int  # stream bits also shown on the console
    paths: dict[int, Path]  # stream bit -> file
    error_file: str


def load(name: str, spec: JobSpec, log_dir: Path) -> Any:
    """Build the named LogsSpecs as torchrun does (launcher/checks/worker_flags.py checked it exists)."""
    from torch.distributed.elastic.multiprocessing.api import Std

    # wait: not_a_wait: entry points, not select(2)
    (entry,) = entry_points(group="torchrun.logs_specs").select(name=name)
    cls = entry.load()
    return cls(
        log_dir=str(log_dir),
        redirects={r: Std(v) for r, v in spec.redirects.items()},
        tee={r: Std(v) for r, v in spec.tee.items()},
        local_ranks_filter=set(spec.local_ranks_filter) if spec.local_ranks_filter is not None else None,
    )


def plans(logs_specs: LogsSpecs, envs: dict[int, dict[str, str]]) -> tuple[dict[int, StreamPlan], dict[int, Path]]:
    """Each worker's StreamPlan from `reify`, and the filtered-output files by stream bit.

    As under torchrun, the class owns TORCHELASTIC_ERROR_FILE: workers get it only where
    `reify` sets it in `envs` (torch's default spec does)."""
    for env in envs.values():
        env.pop("TORCHELASTIC_ERROR_FILE", None)
    dest = logs_specs.reify(envs)
    out = {}
    for local_rank, env in envs.items():
        files = {STDOUT: dest.stdouts.get(local_rank, ""), STDERR: dest.stderrs.get(local_rank, "")}
        tee = (STDOUT if local_rank in dest.tee_stdouts else 0) | (STDERR if local_rank in dest.tee_stderrs else 0)
        paths = {bit: Path(path) for bit, path in files.items() if path}
        for path in paths.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        error_file = env.get("TORCHELASTIC_ERROR_FILE") or dest.error_files.get(local_rank, "")
        out[local_rank] = StreamPlan(sum(paths), tee, paths, error_file)
    # torch before the --duplicate-*-filters flags (2.8) has no filtered files in its LogsDest.
    wanted = ((STDOUT, getattr(dest, "filtered_stdout", "")), (STDERR, getattr(dest, "filtered_stderr", "")))
    filtered = {bit: Path(p) for bit, p in wanted if p}
    return out, filtered
