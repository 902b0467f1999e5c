"""Another local user, for real: code run as uid 65534 (nobody) through ``setpriv``.

rally's threat model counts every other user of a node as hostile (docs: security). A test of
what such a user can or cannot do runs the attacker as a real other uid, never as a simulation:
``setpriv --reuid 65534 --regid 65534 --clear-groups`` as root, standard library only (the
stranger cannot be assumed to have rally or torch). Where the tests do not run as root, or
``setpriv`` is missing, the test skips with that reason.

    def test_x(tmp_path):
        require_stranger()
        done = run_as_stranger("import socket; ...", timeout=10)
        assert done.returncode == 0, done.stderr

    with stranger_process("...long-running attacker...") as attacker:
        ...   # the attacker's whole process group is killed on the way out
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

STRANGER_UID = 65534
"""The other user: ``nobody`` on every Linux distribution."""


def require_stranger() -> None:
    """Skip the calling test unless it can run code as another user."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run an attacker as another user (setpriv --reuid 65534)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run an attacker as another user")


def stranger_command(code: str) -> list[str]:
    """The argv that runs `code` with this interpreter as uid/gid 65534 with no supplementary groups."""
    who = str(STRANGER_UID)
    return ["setpriv", "--reuid", who, "--regid", who, "--clear-groups", sys.executable, "-I", "-c", code]


def _stranger_env(env: dict[str, str] | None) -> dict[str, str]:
    """A minimal environment: nothing of the job's (tokens, RALLY_*) leaks to the attacker by accident."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1", "HOME": "/nonexistent"}
    base.update(env or {})
    return base


def run_as_stranger(code: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `code` as the other user to completion (text output captured)."""
    require_stranger()
    return subprocess.run(
        stranger_command(code), env=_stranger_env(env), capture_output=True, text=True, timeout=timeout, cwd="/"
    )


@contextlib.contextmanager
def stranger_process(code: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """Start `code` as the other user in a session of its own; kill its process group on exit."""
    require_stranger()
    proc = subprocess.Popen(
        stranger_command(code),
        env=_stranger_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


@contextlib.contextmanager
def reachable_dir(prefix: str, mode: int = 0o755) -> Iterator[Path]:
    """A fresh directory of ours under /tmp that the other user can reach (a test's tmp_path has
    0700 parents): `mode` 0o755 lets it look in, 0o1777 write there too (as in /tmp or a shared
    scratch log directory). Removed with everything in it on the way out."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
