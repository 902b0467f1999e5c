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
JOB_ENV = "RALLY_CKPT_JOB"
"""The job's checkpoint tag (hex, `JOB_TAG_SIZE` bytes): set by the launcher for the agent, holder and workers."""
JOB_TAG_SIZE = 16
UNBOUND = bytes(JOB_TAG_SIZE)
"""The tag of a save made outside rally (torchrun, plain python): bound to no job."""
JOB_ID_FILE = ".rally-job-id"
"""In the checkpoint directory: the random job identity of a job given no --rdzv-id (0600, made at its first run)."""
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


def new_mac(key: bytes, kind: str, step: int, job: bytes | None = None) -> hmac.HMAC:
    """A streaming HMAC-SHA256 bound to what is signed (`kind`), its step and, from format 4 on,
    the job that wrote it (`job`, its tag; None: a format-3 file, bound to no job)."""
    bound = "" if job is None else f"/{job.hex()}"
    return hmac.new(key, f"rally/{kind}/{step}{bound}\0".encode(), hashlib.sha256)


def sign(kind: str, step: int, payload: bytes, key: bytes | None = None) -> str:
    mac = new_mac(key if key is not None else signing_key(), kind, step)
    mac.update(payload)
    return mac.hexdigest()


def verify(kind: str, step: int, payload: bytes, mac_hex: str) -> bool:
    """Whether `mac_hex` is the MAC of `payload` under one of this job's keys."""
    return any(hmac.compare_digest(sign(kind, step, payload, key), mac_hex) for key in keys())


def seal(key: bytes, kind: str, step: int, root: bytes, job: bytes | None = None) -> bytes:
    """The MAC of a checkpoint whose bytes have the digest `root` (agent/checkpoint/core/digest.py),
    written by the job tagged `job`."""
    mac = new_mac(key, kind, step, job)
    mac.update(root)
    return mac.digest()


def sealed(key: bytes, kind: str, step: int, root: bytes, mac: bytes, job: bytes | None = None) -> bool:
    """Whether `mac` is `seal` of `root` under `key` (compared in constant time)."""
    return hmac.compare_digest(seal(key, kind, step, root, job), mac)


# ---------------------------------------------------------------------------------------------
# Which job wrote a checkpoint
#
# Why: in a directory other users may write (--checkpoint-dir-shared) they cannot read the job's
# 0600 files, but they can rename them. A MAC under the user's key alone lets them move a genuine
# checkpoint of another of the user's jobs into this job's directory under a newer step's name:
# the job would resume from the other job's weights. So each save carries its job's tag in the
# signed part, and a job refuses, in a shared directory, a checkpoint another job signed. In a
# directory only the user can write nothing else can bring one there: any tag of the user loads
# (a job resubmitted under another --rdzv-id still finds its own checkpoints).


def job_tag_of(identity: str) -> bytes:
    """The tag of a job identity (the --rdzv-id the user gave, or the directory's random id)."""
    return hashlib.sha256(f"rally checkpoint job\0{identity}".encode()).digest()[:JOB_TAG_SIZE]


def job_tag(environ: dict[str, str] | None = None) -> bytes:
    """This process's job tag (RALLY_CKPT_JOB), `UNBOUND` outside rally or when it is malformed."""
    text = (os.environ if environ is None else environ).get(JOB_ENV, "")
    try:
        tag = bytes.fromhex(text)
    except ValueError:
        return UNBOUND
    return tag if len(tag) == JOB_TAG_SIZE else UNBOUND


def job_identity(dir_fd: int, given: str | None) -> str:
    """The job's identity for its checkpoints: the --rdzv-id the user gave (the same on every
    launch of the job, and on every node), else the random id kept in the checkpoint directory
    (`JOB_ID_FILE`, read through the open directory `dir_fd`; made at the job's first run, 0600,
    atomically: written under a temporary name, then linked to its name, which fails if another
    node or launch was first, whose id is then read)."""
    if given:
        return f"rdzv:{given}"
    for _ in range(3):
        try:
            return "dir:" + _read_id(dir_fd)
        except FileNotFoundError:
            pass
        temp = f".{JOB_ID_FILE}.{os.urandom(8).hex()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, os.urandom(16).hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, JOB_ID_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            pass  # another node or launch made it first: read theirs
        finally:
            os.unlink(temp, dir_fd=dir_fd)
    return "dir:" + _read_id(dir_fd)


def _read_id(dir_fd: int) -> str:
    fd = os.open(JOB_ID_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{JOB_ID_FILE} is not a regular file")
        return os.read(fd, 256).decode(errors="replace").strip()
    finally:
        os.close(fd)


def other_job(job: bytes | None, directory: Path) -> str | None:
    """Why a checkpoint signed for the job tagged `job` must not load in `directory`, or None:
    only in a directory others may write, and only when another job signed it."""
    if job is None or job == job_tag() or directory_problem(directory) is None:
        return None
    return (
        "signed by another job of yours (another --rdzv-id, or another checkpoint directory's job id), moved "
        "here by someone who may write this shared directory"
    )


_refusals: list[str] = []
_said: set[str] = set()


def note_refusal(path: object, reason: str) -> None:
    """Remember, once per file and reason, that a checkpoint was skipped for `reason`: the agent
    computes the round's resume step from what verifies, so the workers never reach the newer
    file it skipped, and without this nobody would say why (`take_refusals`)."""
    line = f"checkpoint {shown(path)} is not loaded ({reason})"  # type: ignore[arg-type]
    if line not in _said and len(_said) < 1024:
        _said.add(line)
        _refusals.append(line)


def take_refusals() -> list[str]:
    """The lines of `note_refusal` not yet taken."""
    taken = _refusals[:]
    _refusals.clear()
    return taken


def old_format_line(path: object) -> str:
    """The one line for a signed checkpoint written before checkpoints were bound to their job."""
    return (
        f"checkpoint {shown(path)} was signed before checkpoints were bound to their job: loaded, but "  # type: ignore[arg-type]
        "any job of yours could have written it"
    )


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
