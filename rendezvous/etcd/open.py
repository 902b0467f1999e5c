"""Reaching an etcd cluster at start: the first request, and one line saying why it failed.

A wrong CA, a client certificate etcd refuses, a user without rights and a cluster that is not
running fail differently; each gets the `--rdzv-conf` or `--rdzv-endpoint` setting to check,
before any round begins (rendezvous/backends.py opens the etcd store here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rally.rendezvous.base.kv import StoreUnavailable
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.connect import current_progress
from rally.rendezvous.etcd.client import EtcdClient, EtcdError, EtcdUnavailable, Member, b64
from rally.rendezvous.etcd.http import EtcdAccess
from rally.rendezvous.etcd.store import EtcdStore

# How long rally tries the endpoints at start before giving up with one clear line: etcd is
# infrastructure that must already be running, so an unreachable cluster is reported fast.
CONNECT_SECONDS = 5.0


def open_etcd_store(
    members: Sequence[Member],
    prefix: str,
    op_timeout: float,
    connect_timeout: float = CONNECT_SECONDS,
    signer: Signer | None = None,
    access: EtcdAccess | None = None,
    progress: Callable[[str], None] | None = None,
) -> EtcdStore:
    """Connect to the cluster (any member will do) and check that it serves reads. `progress`
    (default: the caller's `c10d.connect.reporting_progress`, the agent's console) hears what a
    long `get` waits for.

    Raises StoreUnavailable with one line naming every endpoint when none answers within
    `connect_timeout` seconds.
    """
    client = EtcdClient(list(members), access=access)
    store = EtcdStore(client, prefix, op_timeout, signer, progress or current_progress())
    try:
        client.call("/v3/kv/range", {"key": b64(prefix), "count_only": True}, connect_timeout)
    except EtcdError as exc:
        check = (
            "etcd's HTTP gateway, which rally uses, refuses a client certificate with a Common Name while "
            "authentication is on: give --rdzv-conf cert a certificate without a CN (the etcd user is "
            "username/password)"
            if "CommonName" in str(exc)
            else (
                "check --rdzv-conf username and password (or password_file) and that the user may read and write "
                f"{prefix}"
            )
        )
        raise StoreUnavailable(f"etcd at {client.describe()} refused rally: {exc}; {check}") from exc
    except EtcdUnavailable as exc:
        check = (
            "--rdzv-conf cacert (the CA that signed etcd's certificate), cert and key (a client certificate etcd "
            "trusts)"
            if "TLS" in str(exc)
            else "--rdzv-endpoint (etcd client endpoints HOST[:PORT],..., default port 2379) and that etcd is running"
        )
        raise StoreUnavailable(f"cannot reach etcd at {client.describe()}: {exc}; check {check}") from exc
    return store
