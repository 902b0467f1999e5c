"""How to reach an etcd cluster, from --rdzv-endpoint and --rdzv-conf: endpoints, TLS and etcd users.

Sites run etcd with TLS (`https://` client URLs, a CA, client certificates) and with etcd's own
users. rally takes the same --rdzv-conf keys as torchrun's etcd rendezvous:

* `protocol=https` (or `https://` endpoints), `cacert=CA.pem`, `cert=CLIENT.pem`, `key=CLIENT.key`
  (torch's `etcd` backend names them so; its `etcd-v2` backend's `ca_cert`, `ssl_cert` and
  `ssl_cert_key` are accepted as the same);
* `username=NAME` with `password=SECRET` or, kept out of the process list, `password_file=PATH`
  (its first line); the names python-etcd, which torch's etcd rendezvous uses, gives them.

Every problem is one line saying which key is wrong and how to fix it (EndpointError).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rally.rendezvous.base.kv import EndpointError
from rally.rendezvous.base.path_trust import UnsafePath, check_secret_file
from rally.rendezvous.etcd.http import EtcdAccess

# --rdzv-conf keys for the etcd backends (all text); aliases map torch's etcd-v2 names.
ETCD_CONF_KEYS = (
    "protocol",
    "cacert",
    "cert",
    "key",
    "ca_cert",
    "ssl_cert",
    "ssl_cert_key",
    "username",
    "password",
    "password_file",
)
ALIASES = {"ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key"}


def etcd_access(conf: Mapping[str, Any], endpoint_scheme: str | None) -> EtcdAccess:
    """The checked TLS and user settings (files readable, certificates loadable)."""
    given = {ALIASES.get(k, k): v for k, v in conf.items() if k in ETCD_CONF_KEYS and v is not None}
    for alias, name in ALIASES.items():
        if conf.get(alias) is not None and conf.get(name) is not None and conf[alias] != conf[name]:
            raise EndpointError(f"--rdzv-conf: {alias} and {name} name the same file; give one of them")
    protocol = str(given.get("protocol") or endpoint_scheme or "http").lower()
    if protocol not in ("http", "https"):
        raise EndpointError(f"--rdzv-conf protocol={given['protocol']}: use http or https")
    if endpoint_scheme and protocol != endpoint_scheme:
        raise EndpointError(
            f"--rdzv-conf protocol={protocol} contradicts the {endpoint_scheme}:// endpoints in "
            "--rdzv-endpoint; give one"
        )
    tls_files = {k: str(Path(given[k]).expanduser()) if given.get(k) else None for k in ("cacert", "cert", "key")}
    if protocol == "http" and any(tls_files.values()):
        first = next(k for k, v in tls_files.items() if v)
        raise EndpointError(f"--rdzv-conf {first}=... needs TLS: add protocol=https (or give https:// endpoints)")
    for name, path in tls_files.items():
        if path and not _readable(path):
            raise EndpointError(f"--rdzv-conf {name}={path}: no such readable file; give the PEM file's path")
    if tls_files["key"] and not tls_files["cert"]:
        raise EndpointError("--rdzv-conf key=... without cert=...: give the client certificate too")
    password = given.get("password")
    if given.get("password_file"):
        if password:
            raise EndpointError("--rdzv-conf: password and password_file both given; give one of them")
        password = _first_line(given["password_file"])
    username = given.get("username")
    if (password is not None) != bool(username):
        missing = "username=NAME" if username is None else "password=SECRET or password_file=PATH"
        raise EndpointError(f"--rdzv-conf: an etcd user needs both a name and a password; add {missing}")
    access = EtcdAccess(protocol, tls_files["cacert"], tls_files["cert"], tls_files["key"], username, password)
    if access.tls:
        try:
            access.ssl_context()
        except (ssl.SSLError, OSError, ValueError) as exc:
            which = "cacert" if "verify" in str(exc).lower() or not tls_files["cert"] else "cert/key"
            raise EndpointError(
                f"--rdzv-conf {which}: cannot load the certificates ({exc}); give PEM files that match"
            ) from None
    return access


def _readable(path: str) -> bool:
    candidate = Path(path).expanduser()
    return candidate.is_file() and candidate.stat().st_size > 0 and _can_open(candidate)


def _can_open(path: Path) -> bool:
    try:
        with open(path, "rb"):
            return True
    except OSError:
        return False


def _first_line(path: str) -> str:
    candidate = Path(path).expanduser()
    if not candidate.is_file():
        raise EndpointError(
            f"--rdzv-conf password_file={path}: no such file; give a file with the password on its first line"
        )
    try:
        check_secret_file(candidate, f"--rdzv-conf password_file={path}", [])  # whoever owns it chooses it
        text = candidate.read_text(encoding="utf-8")
    except UnsafePath as exc:
        raise EndpointError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EndpointError(f"--rdzv-conf password_file={path}: cannot read it ({exc})") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise EndpointError(f"--rdzv-conf password_file={path} is empty; put the password on its first line")
    return lines[0].rstrip("\r\n")
