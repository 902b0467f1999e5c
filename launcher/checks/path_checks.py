"""At launch, every path the job will write through or read a secret from, judged by one rule.

The rule is ssh's StrictModes, kept in rendezvous/base/path_trust.py: a path with a directory or link
on the way that another user (not root) owns, or that everyone can write without the sticky
bit, is refused here (one line, exit 2) before anything is made; a directory its group can write
is one warning line. Judged: --log-dir (or, without it, the temporary directory the run
directory is made in, where this user's run index lives too), --checkpoint-dir (its parents as
well as itself: a parent another user owns lets them rename the checkpoints away), and the
directories of the `token_file` and `password_file` secrets, with the files themselves.

With --checkpoint-dir-shared the user consented to a checkpoint directory other users can
write, so its problems are warnings there (signed checkpoints only are loaded from it).
"""

from __future__ import annotations

import tempfile
from typing import Any

from rally.agent.base.spec import JobSpec
from rally.launcher.checks.validate import ConfigError
from rally.rendezvous.base.path_trust import UnsafePath, check_directory, check_secret_file


def check_job_paths(spec: JobSpec, conf: dict[str, Any]) -> list[str]:
    """Raise ConfigError (one line) for a path another user could change; the warning lines otherwise."""
    warnings: list[str] = []
    try:
        if spec.log_dir:
            check_directory(spec.log_dir, f"--log-dir {spec.log_dir}", warnings)
        else:
            where = tempfile.gettempdir()
            check_directory(where, f"the temporary directory {where} (TMPDIR; the run directory goes there)", warnings)
        if spec.checkpoint_dir:
            _check_checkpoint_dir(spec.checkpoint_dir, spec.checkpoint_dir_shared, warnings)
        for key in ("token_file", "password_file"):
            if conf.get(key):
                check_secret_file(conf[key], f"--rdzv-conf {key}={conf[key]}", warnings)
    except UnsafePath as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot check a path of the job: {exc}") from None
    return warnings


def _check_checkpoint_dir(directory: str, shared: bool, warnings: list[str]) -> None:
    what = f"--checkpoint-dir {directory}"
    try:
        check_directory(directory, what, warnings)
    except UnsafePath as exc:
        if not shared:
            raise UnsafePath(f"{exc} (or pass --checkpoint-dir-shared to accept it)") from None
        warnings.append(f"{exc}; accepted (--checkpoint-dir-shared: only checkpoints signed with your key load)")
