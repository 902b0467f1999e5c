"""rally as a library: `run(argv) -> int`, and `launch(...)` for a Python callable.

`launch` is rally's counterpart of torch's `elastic_launch`
(torch/distributed/launcher/api.py), for tools that drive a launcher from Python (accelerate,
notebooks, test harnesses):

    results = rally.launch({"nproc_per_node": 4, "max_restarts": 1}, train)(cfg)
    results[0]   # what train(cfg) returned on global rank 0

The callable and its arguments are pickled into a file in a fresh run directory; every
worker runs `python -m rally.launcher.callable_worker`, which loads them, calls the function
and pickles its return value to `<run dir>/results/rank_<RANK>.pkl`. The job itself is the
`rally` command run in this process, with every behaviour of the command: restarts, hang
detection, the root cause. `fn` is pickled by reference, so it must be importable by the
workers (a module-level function of an importable module); this process's sys.path is
handed to them for that.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from rally.launcher.cli import run

PAYLOAD = "payload.pkl"
RESULTS = "results"


class LaunchError(RuntimeError):
    """The launched job failed; the message names the root cause (exit code in `exit_code`)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def options_to_argv(options: Mapping[str, Any]) -> list[str]:
    """{"nproc_per_node": 2, "standalone": True} -> ["--nproc-per-node", "2", "--standalone"]."""
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + str(name).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return argv


def launch(config: Mapping[str, Any] | None, fn: Callable[..., Any], **options: Any) -> Callable[..., dict[int, Any]]:
    """Return a function that runs `fn(*args, **kwargs)` on every worker of a rally job and
    returns {global rank: return value} of this node's workers.

    `config` and `options` are rally's options by name (`nproc_per_node=2`, `max_restarts=1`,
    `rdzv_endpoint="node1:29400"`, ...). Without a rendezvous endpoint or master address the
    job is `--standalone`. A failed job raises `LaunchError` naming the root cause.
    """
    merged = {**(config or {}), **options}
    if not any(merged.get(k) for k in ("rdzv_endpoint", "master_addr", "standalone")):
        merged["standalone"] = True

    def call(*args: Any, **kwargs: Any) -> dict[int, Any]:
        run_dir = Path(tempfile.mkdtemp(prefix="rally_launch_", dir=merged.get("log_dir")))
        (run_dir / RESULTS).mkdir()
        with open(run_dir / PAYLOAD, "wb") as f:
            pickle.dump({"fn": fn, "args": args, "kwargs": kwargs}, f)
        (run_dir / "sys_path.json").write_text(json.dumps([os.path.abspath(p or ".") for p in sys.path]))
        argv = [*options_to_argv({**merged, "log_dir": str(run_dir / "logs")}), "-m", "rally.launcher.callable_worker", str(run_dir)]
        code = run(argv)
        if code != 0:
            raise LaunchError(f"rally.launch: {getattr(fn, '__qualname__', fn)} failed: {_root_cause(run_dir)}", code)
        results = {}
        for path in sorted((run_dir / RESULTS).glob("rank_*.pkl")):
            with open(path, "rb") as f:
                results[int(path.stem.split("_")[1])] = pickle.load(f)
        return results

    return call


def _root_cause(run_dir: Path) -> str:
    """The root cause from the job's report.json (see agent/report.py)."""
    for report in sorted((run_dir / "logs").glob("*/report.json")):
        for attempt in reversed(json.loads(report.read_text()).get("attempts", [])):
            end = attempt.get("end")
            if end:
                info = end.get("info") or {}
                last = [line.strip() for line in info.get("stderr_tail") or [] if line.strip()]
                # One line: what failed and, when the worker raised, the exception's last line.
                return end["detail"] + (f"; {last[-1]}" if last else "") + f" (full report: {report})"
    return f"the job did not run (see the error above; logs in {run_dir})"
