"""Who may have written a checkpoint: an HMAC under a key only the job's user holds, and where it may lie.

Why: a checkpoint is unpickled (DCP's `.metadata`) or becomes the job's weights (`torch.load`
with `weights_only` stops code, not chosen tensors). A CRC is recomputed by anyone, so it says
"whole", never "ours". Every manifest and footer rally writes therefore carries an HMAC-SHA256
under the **checkpoint key**, and nothing is loaded whose MAC does not verify:

- the key is derived from the job token the user gave: `--rdzv-conf token=` / `token_file=`
  (the launcher, launcher/cli.py, puts the derived key, never the token, in RALLY_CKPT_KEY for the
  agent, its holder and its workers), else RALLY_JOB_TOKEN, else the per-user secret
  `~/.rally/secret` (rendezvous/base/token.py, 0600 in a 0700 directory). Each is the same on every
  launch, so a requeued or resubmitted job verifies what the earlier one wrote, and nodes that
  share a token file but no home directory verify each other's checkpoints (--standalone's random
  token and SLURM's per-job one never key checkpoints). A file signed under any of these keys is
  accepted (a token set on one launch and not on the next still finds its checkpoints).
- the MAC covers the step (a genuine older file renamed to a newer step does not verify) and the
  data itself (whole-state files: the digest of every byte, agent/checkpoint/core/digest.py; sharded:
  the manifest, which lists every file's digest).

Checkpoints written before this (footer `END1`, manifest `rally-dcp-1`) carry no MAC: they
load only from a directory only the job's user can write (`directory_problem`), with one
line saying they are unauthenticated. A directory another user can write, or that another user
owns, is refused unless the user consented (`--checkpoint-dir-shared`, RALLY_CHECKPOINT_DIR_SHARED=1):
then signed checkpoints still load, legacy ones never.

Standard library only: the agent, the holder and the flush helper use it without torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from rally.agent.checkpoint.core.held_dir import shown

KEY_ENV = "RALLY_CKPT_KEY"
"""The checkpoint key (hex), set by the agent for its workers and its holder."""
SHARED_ENV = "RALLY_CHECKPOINT_DIR_SHARED"
"""1: the user consented to a checkpoint directory other users can write (--checkpoint-dir-shared)."""
_DERIVE = b"rally checkpoint key v1"


class NoKey(Exception):
    """No checkpoint key can be had (no token, and no per-user secret); the message says how to fix it."""


class UnsafeDirectory(Exception):
    """The checkpoint directory may be written by another user and the user did not consent."""


def derive(secret: str) -> bytes:
    return hmac.new(secret.encode(), _DERIVE, hashlib.sha256).digest()


def job_keys(environ: dict[str, str] | None = None) -> list[bytes]:
    """The keys a checkpoint of this job may be signed with, the signing key first.

    RALLY_CKPT_KEY when the agent set it (then also the per-user secret's key, if readable),
    else the key of RALLY_JOB_TOKEN, then the per-user secret's. NoKey when there is none."""
    from rally.rendezvous.base.token import TokenError, user_secret

    env = os.environ if environ is None else environ
    keys: list[bytes] = []
    given = env.get(KEY_ENV, "")
    if given:
        try:
            keys.append(bytes.fromhex(given))
        except ValueError:
            raise NoKey(f"{KEY_ENV} is not a hex key; unset it (rally sets it for its workers)") from None
    token = env.get("RALLY_JOB_TOKEN", "").strip()
    if token:
        keys.append(derive(token))
    try:
        keys.append(derive(user_secret()))
    except TokenError as exc:
        if not keys:
            raise NoKey(f"rally: checkpoints cannot be signed: {exc}") from None
    unique: list[bytes] = []
    for key in keys:
        if key not in unique:
            unique.append(key)
    return unique


_cached: tuple[tuple[str, str], list[bytes]] | None = None


def keys() -> list[bytes]:
    """`job_keys` of this process's environment, read once per environment."""
    global _cached
    stamp = (os.environ.get(KEY_ENV, ""), os.environ.get("RALLY_JOB_TOKEN", ""))
    if _cached is None or _cached[0] != stamp:
        _cached = (stamp, job_keys())
    return _cached[1]


def signing_key() -> bytes:
    return keys()[0]


def new_mac(key: bytes, kind: str, step: int) -> hmac.HMAC:
    """A streaming HMAC-SHA256 bound to what is signed (`kind`) and its step."""
    return hmac.new(key, f"rally/{kind}/{step}\0".encode(), hashlib.sha256)


def sign(kind: str, step: int, payload: bytes, key: bytes | None = None) -> str:
    mac = new_mac(key if key is not None else signing_key(), kind, step)
    mac.update(payload)
    return mac.hexdigest()


def verify(kind: str, step: int, payload: bytes, mac_hex: str) -> bool:
    """Whether `mac_hex` is the MAC of `payload` under one of this job's keys."""
    return any(hmac.compare_digest(sign(kind, step, payload, key), mac_hex) for key in keys())


def seal(key: bytes, kind: str, step: int, root: bytes) -> bytes:
    """The MAC of a checkpoint whose bytes have the digest `root` (agent/checkpoint/core/digest.py)."""
    mac = new_mac(key, kind, step)
    mac.update(root)
    return mac.digest()


def sealed(key: bytes, kind: str, step: int, root: bytes, mac: bytes) -> bool:
    """Whether `mac` is `seal` of `root` under `key` (compared in constant time)."""
    return hmac.compare_digest(seal(key, kind, step, root), mac)


# ---------------------------------------------------------------------------------------------
# Where checkpoints may lie


def directory_problem(directory: Path) -> str | None:
    """Why `directory` may be written by another user (one clause), or None: only we can write it.
    A directory that does not exist yet is ours to create (0700). Symlinks are judged by their target."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be checked ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        who = "every user" if info.st_mode & 0o002 else "its group"
        return f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def shared_consent(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(SHARED_ENV, "") == "1"


def refusal_line(directory: Path, problem: str) -> str:
    return (
        f"rally: checkpoint directory {shown(directory)} {problem}: another user could plant a checkpoint the job "
        "would load; use a directory only you can write (chmod go-w), or pass --checkpoint-dir-shared to "
        "accept it (only checkpoints signed with your key are loaded then)"
    )


def check_directory(directory: Path) -> bool:
    """Raise UnsafeDirectory unless `directory` is private or the user consented; True: private."""
    problem = directory_problem(directory)
    if problem is None:
        return True
    if shared_consent():
        return False
    raise UnsafeDirectory(refusal_line(directory, problem))


def make_private_dir(path: Path) -> None:
    """Create `path` if needed, the directory itself 0700 (its missing parents as umask says);
    an existing one must be a directory (the user's own link to one is followed: it is their choice)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not path.is_dir():
        raise NotADirectoryError(f"rally: {shown(path)} exists and is not a directory")


def private_subdir(path: Path) -> None:
    """Create `path` 0700 exclusively, or accept an existing one (another rank was first) only if
    it is a real directory (not a link) of our uid that nobody else may write; it is made 0700.
    Raises PermissionError naming the problem."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # ELOOP/ENOTDIR: a link, or not a directory
        raise PermissionError(
            f"rally: refusing {shown(path)}: it is not a directory of rally's ({exc.strerror})"
        ) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise PermissionError(
                f"rally: refusing {shown(path)}: it is not a private directory of this user's (another user's, or "
                "writable by others); something else made it"
            )
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
