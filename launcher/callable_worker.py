"""A worker of `rally.launch`: call the pickled function, pickle its result for the caller.

Run as `python -m rally.launcher.callable_worker RUN_DIR` (through rally's bootstrap, like any
entry point). The caller's sys.path (RUN_DIR/sys_path.json) is appended to the worker's first,
so that pickle finds the function's module; a function of the caller's own script (`__main__`)
is found by importing that script first, as multiprocessing's spawn does (`prepare_main`). An
exception propagates, so the worker fails as a script would and rally reports it as the root
cause (traceback in stderr and the report).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path


def main(run_dir: Path) -> None:
    for entry in json.loads((run_dir / "sys_path.json").read_text()):
        if entry and entry not in sys.path:
            sys.path.append(entry)
    with open(run_dir / "payload.pkl", "rb") as f:
        wrapped = pickle.load(f)
    if wrapped["main"]:
        prepare_main(wrapped["main"])
    payload = pickle.loads(wrapped["call"])
    result = payload["fn"](*payload["args"], **payload["kwargs"])
    target = run_dir / "results" / f"rank_{os.environ['RANK']}.pkl"
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, target)


def prepare_main(data: dict) -> None:
    """Re-create the caller's `__main__` (its script, imported as `__mp_main__`), as a
    multiprocessing spawn child does, so that a function defined there unpickles."""
    import multiprocessing.spawn

    from rally.launcher import api

    api.IMPORTING_CALLERS_MAIN = True  # an unguarded rally.launch in that script says so
    try:
        multiprocessing.spawn.prepare(data)
    finally:
        api.IMPORTING_CALLERS_MAIN = False


if __name__ == "__main__":
    main(Path(sys.argv[1]))
