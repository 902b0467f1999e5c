"""rally as a library: `run(argv) -> int`, and `launch(...)` for a Python callable.

`launch` is rally's counterpart of torch's `elastic_launch`
(torch/distributed/launcher/api.py), for tools that drive a launcher from Python (accelerate,
notebooks, test harnesses):

    results = rally.launch({"nproc_per_node": 4, "max_restarts": 1}, train)(cfg)
    results[0]   # what train(cfg) returned on global rank 0

Its options are the fields of `launcher.options.Options` by name, the same as the command's
flags (an unknown name is one error line with the nearest valid one); PET_*/RALLY_* variables
and then SLURM fill in what they leave open, as for the command. The callable and its arguments
are pickled into a file in a fresh run directory; every worker runs
`python -m rally.launcher.callable_worker`, which loads them, calls the function and pickles its
return value to `<run dir>/results/rank_<RANK>.pkl`.
The job runs in this process with every behaviour of the command: restarts, hang detection,
the root cause, which a failed job's `LaunchError` names (from the agent, as a value). `fn` is
pickled by reference, so it must be importable by the workers (a module-level function of an
importable module); this process's sys.path is handed to them for that.

A function defined in the script being run (`__main__`) works as with torch's `elastic_launch`
and multiprocessing's spawn, by the same mechanism: each worker imports that script under the
name `__mp_main__` (its `if __name__ == "__main__":` block does not run) before it unpickles the
function. What no worker can import, a function of an interactive session or a lambda, is
refused before anything starts, with one line saying what to do.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing.spawn
import os
import pickle
import pickletools
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rally.agent.base.exit_codes import EXIT_BAD_INPUT
from rally.agent.display import console
from rally.launcher.cli import in_this_process, launch_and_run, run
from rally.launcher.config import ConfigError
from rally.launcher.options import Options, by_name, from_environment

__all__ = ["LaunchError", "launch", "run"]

PAYLOAD = "payload.pkl"
RESULTS = "results"
# Set in a worker while it imports the caller's script to find a `__main__` function: a
# `rally.launch` reached then is an unguarded call at the script's top level.
IMPORTING_CALLERS_MAIN = False


class LaunchError(RuntimeError):
    """A job started by `rally.launch` failed, or could not start.

    The message names the root cause as the `rally` command prints it: the rank, the exit, the
    exception's last line, and the report's path.

    Attributes:
        exit_code: What the `rally` command would have exited with: 2 for bad input (a misspelled
            option, a function the workers cannot import), else the failing worker's code.
    """

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def launch(
    config: Mapping[str, Any] | None, fn: Callable[..., Any], **options: object
) -> Callable[..., dict[int, Any]]:
    """Run a Python function on every worker of a rally job, like torch's `elastic_launch`.

    `launch(config, fn)` returns a function; calling it with `fn`'s arguments runs the job in this
    process (main thread: the agent handles signals, and the handlers are put back afterwards) and
    returns each rank's return value. `fn` and its arguments are pickled to the workers, which import
    `fn` by its module and name: a top-level function of a `.py` file, or of the script you run
    (keep the launch under `if __name__ == "__main__":`, as with multiprocessing).

    Args:
        config: rally's options by name, the same names as the flags (`nproc_per_node`,
            `max_restarts`, `rdzv_endpoint`, ...); None for the defaults. Without a rendezvous
            endpoint or master address the job is `--standalone`.
        fn: The function every worker runs.
        **options: More options by name; they win over `config`.

    Returns:
        A function that takes `fn`'s arguments, runs the job and returns {global rank: return
        value} for this node's workers.

    Raises:
        LaunchError: An unknown option (with the nearest name) or a bad value, a function no worker
            can import (all before anything starts), or a failed job, naming the root cause.

    Examples:
        >>> import rally
        >>> def train(scale):
        ...     from rally import job
        ...     return job.context().rank * scale
        >>> rally.launch({"nproc_per_node": 2}, train)(10)
        {0: 0, 1: 10}
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

    def call(*args: object, **kwargs: object) -> dict[int, Any]:
        payload = payload_bytes(fn, {"fn": fn, "args": args, "kwargs": kwargs})
        run_dir = Path(tempfile.mkdtemp(prefix="rally_launch_", dir=chosen.log_dir))
        (run_dir / RESULTS).mkdir()
        (run_dir / PAYLOAD).write_bytes(payload)
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


def payload_bytes(fn: Callable[..., Any], payload: dict[str, Any]) -> bytes:
    """The pickled call, plus how a worker re-creates the caller's `__main__` when the call
    refers to it (multiprocessing's own preparation data); LaunchError (exit 2) with one line
    for what no worker could load, before anything starts."""
    name = getattr(fn, "__qualname__", repr(fn))
    if IMPORTING_CALLERS_MAIN:
        raise LaunchError(
            f"rally.launch({name}) ran in a worker while it imported your script to find the function: "
            'put the launch under `if __name__ == "__main__":`',
            EXIT_BAD_INPUT,
        )
    try:
        data = pickle.dumps(payload)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise LaunchError(
            f"rally.launch: cannot hand {name} and its arguments to the workers ({exc}); "
            "define the function at the top level of a .py file",
            EXIT_BAD_INPUT,
        ) from None
    main = _main_preparation(data)
    if main is False:
        raise LaunchError(
            f"rally.launch: {name} is defined in __main__ of an interactive session or `python -c`, which "
            "the workers cannot import; define it in a .py file (a module, or the script you run)",
            EXIT_BAD_INPUT,
        )
    return pickle.dumps({"main": main, "call": data})


def _main_preparation(data: bytes) -> dict[str, Any] | None | bool:
    """None when the pickle needs nothing of `__main__`; else multiprocessing's data for
    re-creating it in a worker; False when there is no file or module to re-create it from."""
    refers = any(
        isinstance(arg, str) and (arg == "__main__" or op.name == "GLOBAL" and arg.startswith("__main__ "))
        for op, arg, _ in pickletools.genops(data)
    )  # protocol 4 pushes the module's name for STACK_GLOBAL; older ones spell "module name" in GLOBAL
    if not refers:
        return None
    prepared = multiprocessing.spawn.get_preparation_data("rally-launch")
    wanted: dict[str, Any] = {
        k: prepared[k] for k in ("sys_argv", "init_main_from_name", "init_main_from_path") if k in prepared
    }
    from_name = str(wanted.get("init_main_from_name", ""))
    if "init_main_from_path" not in wanted and (not from_name or from_name.split(".")[-1] == "__main__"):
        return False
    return wanted
