"""A worker of `rally.launch`: call the pickled function, pickle its result for the caller.

Run as `python -m rally.launcher.callable_worker RUN_DIR` (through rally's bootstrap, like any
entry point). The caller's sys.path (RUN_DIR/sys_path.json) is appended to the worker's first,
so that pickle finds the function's module. An exception propagates, so the worker fails as a
script would and rally reports it as the root cause (traceback in stderr and the report).
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
        payload = pickle.load(f)
    result = payload["fn"](*payload["args"], **payload["kwargs"])
    target = run_dir / "results" / f"rank_{os.environ['RANK']}.pkl"
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, target)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
