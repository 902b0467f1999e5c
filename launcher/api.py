"""rally as a library: `run(argv) -> int`, and `launch(...)` for a Python callable.

`launch` is rally's counterpart of torch's `elastic_launch`
(torch/distributed/launcher/api.py), for tools that drive a launcher from Python (accelerate,
notebooks, test harnesses):

    results = rally.launch({"nproc_per_node": 4, "max_restarts": 1}, train)(cfg)
    results[0]   # what train(cfg) returned on global rank 0

Its options are the fields of `launcher.options.Options` by name, the same as the command's
flags (an unknown name is one error line with the nearest valid one); PET_*/RALLY_* variables
and then SLURM fill in what they leave open, as for the command. The callable and its arguments are pickled into a file in a
fresh run directory; every worker runs `python -m rally.launcher.callable_worker`, which loads
them, calls the function and pickles its return value to `<run dir>/results/rank_<RANK>.pkl`.
The job runs in this process with every behaviour of the command: restarts, hang detection,
the root cause, which a failed job's `LaunchError` names (from the agent, as a value). `fn` is
pickled by reference, so it must be importable by the workers (a module-level function of an
importable module); this process's sys.path is handed to them for that.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from rally.launcher import console
from rally.launcher.cli import in_this_process, launch_and_run, run
from rally.launcher.config import ConfigError
from rally.launcher.options import Options, by_name, from_environment

__all__ = ["LaunchError", "launch", "run"]

PAYLOAD = "payload.pkl"
RESULTS = "results"
EXIT_BAD_INPUT = 2


class LaunchError(RuntimeError):
    """The launched job failed; the message names the root cause (exit code in `exit_code`)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def launch(config: Mapping[str, Any] | None, fn: Callable[..., Any], **options: Any) -> Callable[..., dict[int, Any]]:
    """Return a function that runs `fn(*args, **kwargs)` on every worker of a rally job and
    returns {global rank: return value} of this node's workers.

    `config` and `options` are rally's options by name (`nproc_per_node=2`, `max_restarts=1`,
    `rdzv_endpoint="node1:29400"`, ...). Without a rendezvous endpoint or master address the
    job is `--standalone`. A failed job raises `LaunchError` naming the root cause.
    """
    try:
        # As for the command: what the caller names wins over PET_*/RALLY_* variables.
        given = {**from_environment(os.environ), **by_name({**(config or {}), **options})}
    except ConfigError as exc:
        raise LaunchError(str(exc), EXIT_BAD_INPUT) from None
    if not any(given.get(k) for k in ("rdzv_endpoint", "master_addr", "standalone")):
        given["standalone"] = True
    chosen = Options(**given)
    name = getattr(fn, "__qualname__", fn)
    named = set(given)  # set by the caller or the environment: SLURM leaves them alone

    def call(*args: Any, **kwargs: Any) -> dict[int, Any]:
        run_dir = Path(tempfile.mkdtemp(prefix="rally_launch_", dir=chosen.log_dir))
        (run_dir / RESULTS).mkdir()
        with open(run_dir / PAYLOAD, "wb") as f:
            pickle.dump({"fn": fn, "args": args, "kwargs": kwargs}, f)
        (run_dir / "sys_path.json").write_text(json.dumps([os.path.abspath(p or ".") for p in sys.path]))
        job = dataclasses.replace(chosen, log_dir=str(run_dir / "logs"), module=True)
        script = "rally.launcher.callable_worker"
        try:
            result = in_this_process(lambda: launch_and_run(job, script, [str(run_dir)], named))
        except ConfigError as exc:
            console.plain_error(str(exc))
            raise LaunchError(f"rally.launch: {name}: {exc}", EXIT_BAD_INPUT) from None
        if result.code != 0:
            cause = result.root_cause or f"the job did not run (see the error above; logs in {run_dir})"
            raise LaunchError(f"rally.launch: {name} failed: {cause}", result.code)
        results = {}
        for path in sorted((run_dir / RESULTS).glob("rank_*.pkl")):
            with open(path, "rb") as f:
                results[int(path.stem.split("_")[1])] = pickle.load(f)
        return results

    return call
