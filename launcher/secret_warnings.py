"""One warning line per way the job's secrets or its store are left open to other users.

Read at launch, after the options are checked (launcher/config.py), and printed once at start:

* a secret on the command line (`--rdzv-conf token=` or etcd's `password=`): every local user
  reads /proc/*/cmdline;
* a `token_file` or `password_file` that group or others can read (as ssh warns of a key file);
* an etcd user's password sent over `http://`: in clear to anyone on the path;
* a multi-node job without a job token: what anyone who reaches its store can do, and how to
  set a token.

The per-user secret in ~/.rally is checked where it is read (rendezvous/base/token.py `user_secret`),
which refuses a directory that is a symlink or another user's and warns of loose modes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from rally.rendezvous.base.token import ENV_TOKEN
from rally.rendezvous.c10d.store import StoreEndpoint

ARGV_SECRET = (
    "--rdzv-conf {key}=... puts a secret on the command line, which every user of this machine can "
    "read (/proc/*/cmdline); use --rdzv-conf {instead}=PATH (a 0600 file){also}"
)


def secret_warnings(conf: dict[str, Any], endpoint: StoreEndpoint, token: str, max_nodes: int) -> list[str]:
    """Every warning for this launch (`endpoint`: rendezvous.c10d.store.StoreEndpoint), in order."""
    lines = []
    if conf.get("token"):
        lines.append(ARGV_SECRET.format(key="token", instead="token_file", also=f" or {ENV_TOKEN}"))
    if conf.get("password"):
        lines.append(ARGV_SECRET.format(key="password", instead="password_file", also=""))
    for key in ("token_file", "password_file"):
        if conf.get(key) and (line := loose_file_line(conf[key], f"--rdzv-conf {key}={conf[key]}")):
            lines.append(line)
    access = getattr(endpoint, "etcd_access", None)
    if endpoint.etcd and access is not None and access.username and not access.tls:
        lines.append(
            f"the etcd password of user '{access.username}' travels in clear over http:// to {endpoint}; "
            "use https:// endpoints (or --rdzv-conf protocol=https with cacert=...)"
        )
    if not token and max_nodes > 1:
        lines.append(no_token_line(endpoint))
    return lines


def loose_file_line(path: str, what: str) -> str | None:
    """A warning when the secret file at `path` can be read by group or others, else None."""
    try:
        mode = os.stat(Path(path).expanduser()).st_mode
    except OSError:
        return None  # the reader says what is wrong with a missing file
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        return f"{what} can be read by other users (mode {stat.S_IMODE(mode):04o}); chmod 600 it"
    return None


def no_token_line(endpoint: StoreEndpoint) -> str:
    """What anyone who reaches the store can do to a job without a token, and how to set one."""
    who = f"anyone who can write to {endpoint}" if endpoint.etcd else f"anyone who can reach {endpoint}"
    return (
        f"no job token: {who} can end this job (a forged 'succeeded' exits 0), join it as a node or "
        "restart it, and read its records; give every node the same secret in "
        f"{ENV_TOKEN} or --rdzv-conf token_file=PATH (a 0600 file)"
    )
