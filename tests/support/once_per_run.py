"""A session fixture's value made once per test run, also when pytest-xdist runs the suite in
several worker processes (.ci/run's main pass: `-n 3`).

Each xdist worker is a pytest session of its own, so a plain session fixture would be made once
per worker: the uninterrupted reference runs (tests/support/ddp_reference.py, tests/support/fsdp_reference.py)
are two-worker torch jobs of tens of seconds, which the run should pay once. The first worker
to ask makes the value under an exclusive lock on a file in the directory that all workers'
temporary directories share, and writes it as JSON; the others wait on the lock and read it.
Without xdist it is simply made.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import Any

import pytest


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], Any]) -> Any:
    """`make()` in the first session (xdist worker) that asks; the same value, read back from
    JSON, in every other. A failure of `make` is not stored: each worker then fails on its own."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    shared = tmp_path_factory.getbasetemp().parent  # the workers' base directories are its children
    stored = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if stored.exists():
            return json.loads(stored.read_text())
        value = make()
        temporary = stored.with_suffix(".tmp")
        temporary.write_text(json.dumps(value))
        temporary.replace(stored)
        return value
