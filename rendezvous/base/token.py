"""The job token: a secret shared by a job's nodes, so that strangers cannot steer the job.

A c10d store has no access control: anyone who can reach its port can read and write any key.
rally therefore signs every value it writes to the rendezvous store with an HMAC over the key
and the value (`Signer`), and checks it on every read. A node or client without the job's
token can still read keys and bump counters, but it cannot write an assignment, a round end, a
node descriptor or a master address that any agent of the job would accept: such a value is
rejected with one line naming the key. (Integrity, not confidentiality: values stay readable.)
The envelope also names the key a value was signed for, so a genuine value copied to another key
(a record replayed from an earlier round) is told apart from a foreign one and named as such.

Where the token comes from, first match wins (`resolve_token`):
  1. `--rdzv-conf token=SECRET` or `--rdzv-conf token_file=PATH` (the file's first line);
  2. the RALLY_JOB_TOKEN environment variable;
  3. `--standalone`: a fresh random token (the store is private to this one agent); the same for
     a job that can only ever have one node on a c10d store of this machine that its agent hosts
     itself (rendezvous/plan.py `own_token_when_hosted`), so that a local user cannot forge its end;
  4. inside a SLURM job: HMAC(per-user secret, SLURM_JOB_ID). The per-user secret is
     `~/.rally/secret`, created on first use with mode 0600 in a 0700 directory, so only the
     user's own processes can read it; a job's nodes share it through the (usually shared)
     home directory. Where home is not shared, set RALLY_JOB_TOKEN on every node.
  5. otherwise no token: values are still signed with the empty key, which catches garbage and
     foreign writes by programs that are not rally, but not a deliberate forger.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from rally.rendezvous.base.path_trust import UnsafePath, check_directory, check_secret_file

ENV_TOKEN = "RALLY_JOB_TOKEN"
# Every value rally writes is: this tag, the hex HMAC, ".", the key it was signed for, NUL, the
# payload. The HMAC covers key + NUL + payload (keys never hold a NUL).
ENVELOPE_TAG = b"rally2."
_MAC_HEX_LENGTH = 64


class TokenError(Exception):
    """The token cannot be read (missing or unreadable file); the message says how to fix it."""


class BadRecord(Exception):
    """A store value is not one this job wrote, or it is malformed. The message names the key."""


class Signer:
    """Signs values for the store and checks them on the way back (HMAC-SHA256 over key + value)."""

    def __init__(self, token: str = "", verify: bool = True):
        """`verify=False` only strips the envelope (for `rally status` without the token)."""
        self._key = token.encode()
        self.verify = verify

    def adopt(self, token: str) -> None:
        """Sign and verify with `token` from now on (rendezvous/plan.py: a one-node job's own store)."""
        self._key = token.encode()

    @property
    def has_token(self) -> bool:
        """Whether values are signed with a job token (without one, anyone can sign as the job:
        a taken store port proves nothing, rendezvous/c10d/store.py)."""
        return bool(self._key)

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, payload: str | bytes) -> bytes:
        data = payload.encode() if isinstance(payload, str) else payload
        return ENVELOPE_TAG + self._mac(key, data) + b"." + key.encode() + b"\0" + data

    def open(self, key: str, sealed: bytes) -> bytes:
        """The payload of a sealed value, or BadRecord naming the key."""
        head = len(ENVELOPE_TAG)
        body = sealed[head + _MAC_HEX_LENGTH + 1 :]
        signed_for, nul, payload = body.partition(b"\0")
        if (
            not sealed.startswith(ENVELOPE_TAG)
            or sealed[head + _MAC_HEX_LENGTH : head + _MAC_HEX_LENGTH + 1] != b"."
            or not nul
        ):
            raise BadRecord(
                f"store key '{key}' holds {_preview(sealed)}, which no rally agent wrote (garbage, or a "
                "stranger writing to the rendezvous store); use a store only this job can reach"
            )
        mac = sealed[head : head + _MAC_HEX_LENGTH]
        genuine = hmac.compare_digest(mac, self._mac(signed_for.decode(errors="replace"), payload))
        if self.verify and not genuine:
            raise BadRecord(
                f"store key '{key}' holds a value signed with a different job token (a node or client "
                f"without this job's secret wrote it); give every node the same token ({ENV_TOKEN} or "
                "--rdzv-conf token_file=PATH)"
            )
        if signed_for != key.encode():
            raise BadRecord(
                f"store key '{key}' holds a stale or replayed record: a value this job signed for "
                f"'{signed_for.decode(errors='replace')[:200]}' was copied here (a stranger replaying an "
                "earlier round's record); use a store only this job can reach"
            )
        return payload


def _preview(value: bytes) -> str:
    text = repr(value[:40])
    return text + ("..." if len(value) > 40 else "")


def read_token_file(path: str, what: str = "", judged: bool = False) -> str:
    """The first line of a secret file, which must lie where only this user or root can change it
    (rendezvous/base/path_trust.py: its directories, and the file's owner, who would choose the token);
    `judged`: the caller checked it by its own rules (`user_secret`: ~/.rally's, as ssh's ~/.ssh)."""
    try:
        if not judged:
            check_secret_file(path, what or f"the job token file {path}", [])
        text = Path(path).expanduser().read_text(encoding="utf-8", errors="strict")
    except UnsafePath as exc:
        raise TokenError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(
            f"cannot read the job token file {path}: {exc}; give a readable file with the secret on its first line"
        ) from None
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not first:
        raise TokenError(f"the job token file {path} is empty; put the secret on its first line")
    return first


def user_secret(home: Path | None = None, warnings: list[str] | None = None) -> str:
    """This user's secret in ~/.rally/secret (0600), created atomically on first use.

    As ssh does with ~/.ssh: a home directory whose path another user could change
    (rendezvous/base/path_trust.py), a ~/.rally that is a symlink or another user's, or a secret that is
    a symlink or another user's, is refused (whoever controls it chooses or reads the token); a
    ~/.rally that group or others can write, or a secret they can read, is used with one line
    each in `warnings`."""
    directory = (home or Path.home()) / ".rally"
    path = directory / "secret"
    try:
        home_lines = warnings if warnings is not None else []
        check_directory(directory.parent, f"the per-user rally secret's home {directory.parent}", home_lines)
        directory.mkdir(mode=0o700, exist_ok=True)
        _check_own(directory, "directory", warnings, stat.S_IWGRP | stat.S_IWOTH, "written by")
        if not path.exists() and not path.is_symlink():
            tmp = directory / f".secret.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # atomic; another node of the job may have won the race
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        _check_own(path, "file", warnings, stat.S_IRGRP | stat.S_IROTH, "read by")
        return read_token_file(str(path), judged=True)
    except UnsafePath as exc:
        raise TokenError(f"{exc}; or set {ENV_TOKEN}") from None
    except OSError as exc:
        raise TokenError(
            f"cannot create the per-user rally secret in {directory}: {exc}; set {ENV_TOKEN} instead"
        ) from None


def _check_own(path: Path, what: str, warnings: list[str] | None, loose_bits: int, loose_verb: str) -> None:
    """Refuse `path` unless it is this user's own (not a symlink); warn when `loose_bits` are set."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid():
        why = "a symlink" if stat.S_ISLNK(info.st_mode) else f"owned by uid {info.st_uid}, not you"
        raise TokenError(
            f"the per-user rally secret {what} {path} is {why}: whoever controls it could choose or read the "
            f"job token, so it is not used; remove it (rally makes a new one) or set {ENV_TOKEN}"
        )
    if warnings is not None and info.st_mode & loose_bits:
        mode = stat.S_IMODE(info.st_mode)
        fix = "chmod 700" if what == "directory" else "chmod 600"
        warnings.append(
            f"the per-user rally secret {what} {path} can be {loose_verb} other users (mode {mode:04o}); {fix} it"
        )


def env_token() -> str:
    """RALLY_JOB_TOKEN; set but empty is a mistake (an unset shell variable), never "no token"."""
    value = os.environ.get(ENV_TOKEN, "")
    if ENV_TOKEN in os.environ and not value.strip():
        raise TokenError(
            f"{ENV_TOKEN} is set but empty, which would mean no job token; put the job's secret in it, "
            f"or unset it (unset {ENV_TOKEN}) to run without one"
        )
    return value


def resolve_token(
    conf_token: str | None,
    conf_token_file: str | None,
    standalone: bool,
    slurm_job_id: str | None,
    warnings: list[str] | None = None,
) -> str:
    """The job's token by the precedence in this module's docstring ("" = none); loose modes of
    the per-user secret go to `warnings` (one line each)."""
    if conf_token:
        return conf_token
    if conf_token_file:
        return read_token_file(conf_token_file)
    if ENV_TOKEN in os.environ:
        return env_token()
    if standalone:
        return secrets.token_hex(32)
    if slurm_job_id:
        return hmac.new(
            user_secret(warnings=warnings).encode(), f"slurm:{slurm_job_id}".encode(), hashlib.sha256
        ).hexdigest()
    return ""
