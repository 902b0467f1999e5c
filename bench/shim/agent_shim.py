"""Runs a launcher's console script and records when the launcher finished `import torch`.

    python agent_shim.py /path/to/rally ARGS...

Writes time.time() to $BENCH_IMPORT_MARK/<pid> when the first top-level import of torch (or
a torch submodule) returns, then removes its import hook. The variable is taken out of the
environment before the launcher runs, so workers never see it. Used by the multi-agent
benchmark to know when the last agent is ready to join, the same way for both launchers.
"""

import builtins
import os
import runpy
import sys
import time

mark_dir = os.environ.pop("BENCH_IMPORT_MARK", "")
_original_import = builtins.__import__
_depth = 0


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    global _depth
    if level != 0 or not (name == "torch" or name.startswith("torch.")):
        return _original_import(name, globals, locals, fromlist, level)
    _depth += 1
    try:
        return _original_import(name, globals, locals, fromlist, level)
    finally:
        _depth -= 1
        if _depth == 0 and builtins.__import__ is _import:
            builtins.__import__ = _original_import
            if mark_dir:
                with open(os.path.join(mark_dir, str(os.getpid())), "w") as f:
                    f.write(repr(time.time()))


builtins.__import__ = _import
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
