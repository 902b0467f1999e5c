"""Rendezvous backends: one interface, one registry. The launcher, `rally status` and the agent
ask `BACKENDS` instead of branching on a backend's name.

Each backend does two things:

* `plan(request) -> StoreEndpoint`: from the options (`StoreRequest`), where this node finds
  the store and whether it hosts it; a bad endpoint is `EndpointError`, one line that says what
  to fix (the launcher shows it and exits 2);
* `open(endpoint, prefix, ...) -> OpenedStore`: a `KeyValueStore` (rendezvous/base/kv.py) the round
  protocol runs on, the server this process hosts (or None) and the endpoint as bound (a store
  hosted on port 0 reports the port it got; the planned endpoint is never changed).

A backend is a class with these methods, given to `register()`: rally's own at the bottom of this
file, another package's through the entry-point group `rally.rendezvous_backends` (an entry point
names the class; it is registered when a backend is first looked up), so an out-of-tree backend is
a package, not a patch (docs/architecture.md, "Adding a rendezvous backend").
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from rally.rendezvous.base.kv import EndpointError, KeyValueStore
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import StoreEndpoint, is_local_host, open_file_store, open_tcp_store
from rally.rendezvous.etcd.client import DEFAULT_ETCD_PORT, Member
from rally.rendezvous.etcd.conf import etcd_access

DEFAULT_C10D_PORT = 29400
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class HostPort:
    """A host and a port already known apart (from SLURM, say): nothing to parse."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class StoreRequest:
    """What the options say about the store (flags, YAML, environment, SLURM, already merged)."""

    endpoint: str | HostPort = ""  # --rdzv-endpoint as typed ("" when not given), or from SLURM
    min_nodes: int = 1
    max_nodes: int = 1
    run_id: str = "none"
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    is_host: bool | None = None  # --rdzv-conf is_host
    store_type: str = "tcp"  # --rdzv-conf store_type
    conf: Mapping[str, Any] | None = None  # the whole --rdzv-conf (dict): the etcd backends read TLS and users from it


@dataclass(frozen=True)
class OpenedStore:
    """An open rendezvous store: the client, the server this process hosts, where it is bound."""

    store: KeyValueStore
    server: Any  # keep it referenced for as long as the store should exist; None when not hosted here
    endpoint: StoreEndpoint  # as bound: the real port of a store hosted on port 0

    @property
    def port(self) -> int:
        return self.endpoint.port


class Backend(Protocol):
    """What the registry holds for every backend name."""

    name: ClassVar[str]
    # Chosen with --rdzv-backend (the file store is chosen with --rdzv-conf store_type=file).
    selectable: ClassVar[bool]
    # The store itself is the workers' MASTER_ADDR/PORT and --node-rank fixes ranks (static).
    static_ranks: ClassVar[bool]
    # Under SLURM, the store is put on the job's first host unless the user said where.
    takes_slurm_store: ClassVar[bool]
    # Opening it needs torch.distributed (c10d stores).
    imports_torch: ClassVar[bool]

    def plan(self, request: StoreRequest) -> StoreEndpoint:
        """Where this node finds the store, or EndpointError."""

    def locate(self, endpoint: str | HostPort, conf: Mapping[str, Any] | None = None) -> StoreEndpoint:
        """Where a client elsewhere (`rally status`) finds a running job's store."""

    def open(
        self, endpoint: StoreEndpoint, prefix: str, connect_timeout: float, op_timeout: float, signer: Signer
    ) -> OpenedStore:
        """Connect (hosting the store when `endpoint.host_here`); StoreUnavailable when it cannot."""

    def lost_line(self, exc: BaseException, endpoint: StoreEndpoint) -> str:
        """One line when the store is lost while the job runs: why this node stops, what to do."""


# ------------------------------------------------------------------ endpoints as typed
def parse_endpoint(text: str, default_port: int | None) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]:port`; the port is `default_port` when none is written."""
    text = str(text).strip()
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?", text) or re.fullmatch(r"([^:\[\]\s]+)(?::(\d+))?", text)
    if not match or not match.group(1):
        raise EndpointError(f"--rdzv-endpoint '{text}' is malformed; write HOST or HOST:PORT, e.g. node1:29400")
    port = int(match.group(2)) if match.group(2) else default_port
    if port is not None and not 0 <= port <= 65535:
        raise EndpointError(f"--rdzv-endpoint '{text}': port {port} is out of range (0-65535)")
    return match.group(1), port


def _host_port(endpoint: str | HostPort, default_port: int) -> tuple[str, int]:
    if isinstance(endpoint, HostPort):
        return endpoint.host, endpoint.port
    host, port = parse_endpoint(endpoint, default_port)
    return host, default_port if port is None else port


def parse_etcd_endpoints(text: str) -> tuple[tuple[Member, ...], str | None]:
    """`[SCHEME://]HOST[:PORT][,...]`, default port 2379; also the scheme the endpoints name
    (None when none does). Mixing http:// and https:// is an error."""
    members, schemes = [], set()
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        scheme, sep, rest = item.partition("://")
        if sep:
            if scheme.lower() not in ("http", "https"):
                raise EndpointError(
                    f"--rdzv-endpoint '{item}': etcd endpoints are http:// or https://, not {scheme}://"
                )
            schemes.add(scheme.lower())
            item = rest
        host, port = _host_port(item.rstrip("/"), DEFAULT_ETCD_PORT)
        if port == 0:
            raise EndpointError(
                f"--rdzv-endpoint '{item}': port 0 is not an etcd endpoint; etcd listens on 2379 by default"
            )
        members.append(Member(host, port))
    if not members:
        raise EndpointError(
            "--rdzv-backend etcd needs --rdzv-endpoint HOST[:PORT][,HOST[:PORT]...]: the etcd cluster's client "
            "endpoints (default port 2379)"
        )
    if len(schemes) > 1:
        raise EndpointError(
            f"--rdzv-endpoint {text}: mixes http:// and https:// endpoints; a cluster's members all speak one"
        )
    return tuple(dict.fromkeys(members)), schemes.pop() if schemes else None


def resolvable(host: str, option: str) -> None:
    """The store's host must resolve here; otherwise rally would wait out join_timeout for nothing."""
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise EndpointError(
            f"{option}: host '{host}' does not resolve ({reason}); check the name, or use an IP address"
        ) from None


def _lost_tcp_store(exc: BaseException, endpoint: StoreEndpoint) -> str:
    return (
        f"{exc}; the rendezvous store at {endpoint} is gone, so this node stops. Its host "
        "was probably lost. To survive the loss of any compute node next time, run "
        "`rally store --port PORT` on a machine that does not train and point "
        "--rdzv-endpoint at it"
    )


def _open_tcp(
    endpoint: StoreEndpoint, prefix: str, connect_timeout: float, op_timeout: float, signer: Signer
) -> OpenedStore:
    store, server = open_tcp_store(endpoint, prefix, connect_timeout, op_timeout, signer)
    bound = dataclasses.replace(endpoint, port=server.port) if server is not None else endpoint
    return OpenedStore(store, server, bound)


# ------------------------------------------------------------------ the backends
class C10dBackend(Backend):
    """torchrun's elastic default: a TCPStore that the endpoint's host serves (or `rally store`)."""

    name = "c10d"
    selectable = True
    static_ranks = False
    takes_slurm_store = True
    imports_torch = True

    def plan(self, request: StoreRequest) -> StoreEndpoint:
        endpoint = request.endpoint
        if not endpoint:
            if request.max_nodes > 1:
                raise EndpointError(
                    "--nnodes above 1 needs --rdzv-endpoint HOST[:PORT] (or run under SLURM, or use "
                    "--rdzv-backend static)"
                )
            endpoint = HostPort("localhost", 0)
        host, port = _host_port(endpoint, DEFAULT_C10D_PORT)
        resolvable(host, "--rdzv-endpoint")
        host_here = request.is_host if request.is_host is not None else is_local_host(host)
        if port == 0 and not host_here:
            raise EndpointError(f"--rdzv-endpoint {endpoint}: port 0 only works on the store's own host")
        return StoreEndpoint(host, port, host_here=host_here, backend=self.name)

    def locate(self, endpoint: str | HostPort, conf: Mapping[str, Any] | None = None) -> StoreEndpoint:
        host, port = _host_port(endpoint, DEFAULT_C10D_PORT)
        resolvable(host, "--rdzv-endpoint")
        return StoreEndpoint(host, port, host_here=False, backend=self.name)

    open = staticmethod(_open_tcp)
    lost_line = staticmethod(_lost_tcp_store)


class StaticBackend(C10dBackend):
    """torchrun's static rendezvous: node rank 0 serves the store at --master-addr/--master-port
    (or --rdzv-endpoint), which is also the workers' store."""

    name = "static"
    static_ranks = True
    takes_slurm_store = False

    def plan(self, request: StoreRequest) -> StoreEndpoint:
        if request.min_nodes != request.max_nodes:
            raise EndpointError("--rdzv-backend static needs a fixed --nnodes N (MIN:MAX needs c10d)")
        node_rank = 0 if request.node_rank is None else request.node_rank  # torchrun's default too
        # As torchrun: --rdzv-endpoint, when given, is the master address and port.
        host, port = (
            parse_endpoint(str(request.endpoint), None)
            if request.endpoint
            else (request.master_addr or "127.0.0.1", None)
        )
        if port is None:
            port = request.master_port if request.master_port is not None else DEFAULT_MASTER_PORT
        resolvable(host, "--rdzv-endpoint" if request.endpoint else "--master-addr")
        return StoreEndpoint(host, port, host_here=node_rank == 0, backend=self.name)

    def locate(self, endpoint: str | HostPort, conf: Mapping[str, Any] | None = None) -> StoreEndpoint:
        host, port = _host_port(endpoint, DEFAULT_MASTER_PORT)
        resolvable(host, "--rdzv-endpoint")
        return StoreEndpoint(host, port, host_here=False, backend=self.name)


class FileBackend(Backend):
    """A FileStore on a shared file system: c10d's rounds without a store host."""

    name = "file"
    selectable = False  # --rdzv-backend c10d --rdzv-conf store_type=file
    static_ranks = False
    takes_slurm_store = True
    imports_torch = True

    def plan(self, request: StoreRequest) -> StoreEndpoint:
        if not request.endpoint and request.max_nodes > 1:
            raise EndpointError(
                "--nnodes above 1 needs --rdzv-endpoint HOST[:PORT] (or run under SLURM, or use --rdzv-backend static)"
            )
        return self.locate(request.endpoint or "localhost:0")

    def locate(self, endpoint: str | HostPort, conf: Mapping[str, Any] | None = None) -> StoreEndpoint:
        from pathlib import Path

        text = str(endpoint)
        parent = Path(text).parent
        if not parent.is_dir():
            raise EndpointError(
                f"--rdzv-endpoint {text}: the file store's directory {parent} does not exist; create it on a "
                "shared file system"
            )
        return StoreEndpoint("", 0, host_here=False, file_path=text, backend=self.name)

    def open(
        self, endpoint: StoreEndpoint, prefix: str, connect_timeout: float, op_timeout: float, signer: Signer
    ) -> OpenedStore:
        assert endpoint.file_path is not None
        return OpenedStore(open_file_store(endpoint.file_path, prefix, op_timeout, signer), None, endpoint)

    lost_line = staticmethod(_lost_tcp_store)


class EtcdBackend(Backend):
    """torchrun's etcd backends, both over the etcd v3 API (rendezvous/etcd/store.py)."""

    name = "etcd"
    selectable = True
    static_ranks = False
    takes_slurm_store = False
    imports_torch = False

    def plan(self, request: StoreRequest) -> StoreEndpoint:
        if request.store_type != "tcp":
            raise EndpointError(
                f"--rdzv-conf store_type={request.store_type} does not apply to --rdzv-backend {self.name}; remove it"
            )
        endpoint = self.locate(request.endpoint, request.conf)
        if request.run_id == "none":
            raise EndpointError(
                f"--rdzv-backend {self.name} needs --rdzv-id ID, one per job: etcd keeps a job's keys after it ends"
            )
        return endpoint

    def locate(self, endpoint: str | HostPort, conf: Mapping[str, Any] | None = None) -> StoreEndpoint:
        members, scheme = parse_etcd_endpoints(str(endpoint))
        access = etcd_access(conf or {}, scheme)
        return StoreEndpoint("", 0, host_here=False, etcd=members, backend=self.name, etcd_access=access)

    def open(
        self, endpoint: StoreEndpoint, prefix: str, connect_timeout: float, op_timeout: float, signer: Signer
    ) -> OpenedStore:
        from rally.rendezvous.etcd.open import open_etcd_store  # values signed with the job token, as on c10d

        return OpenedStore(
            open_etcd_store(endpoint.etcd, prefix, op_timeout, signer=signer, access=endpoint.etcd_access),
            None,
            endpoint,
        )

    def lost_line(self, exc: BaseException, endpoint: StoreEndpoint) -> str:
        return (
            f"{exc}; the job cannot go on without its rendezvous, so this node stops. Check the cluster: "
            f"etcdctl --endpoints {','.join(map(str, endpoint.etcd))} endpoint health"
        )


class EtcdV2Backend(EtcdBackend):
    """torchrun's name for its older etcd backend; rally runs it on the v3 API as well."""

    name = "etcd-v2"


# ------------------------------------------------------------------ the registry
# Installed packages name their backends here (pyproject.toml: [project.entry-points."rally.rendezvous_backends"]
# NAME = "package.module:BackendClass"), as torchrun's out-of-tree handlers use `torchrun.handlers`.
ENTRY_POINT_GROUP = "rally.rendezvous_backends"
BACKENDS: dict[str, Backend] = {}  # by name: rally's own, then the installed packages' once looked up
BUILT_IN = ("c10d", "static", "file", "etcd", "etcd-v2")
_installed: dict[str, str] | None = None  # entry point -> why it could not be registered ("" when it was)


def register(backend: Backend) -> Backend:
    """Add `backend` to the registry under its `name` (lower case); a name already taken by another
    backend is a ValueError, so a package cannot replace rally's own."""
    name = backend.name.lower()
    if BACKENDS.get(name, backend) is not backend:
        raise ValueError(f"rendezvous backend '{name}' is already registered ({type(BACKENDS[name]).__name__})")
    BACKENDS[name] = backend
    return backend


for _backend in (C10dBackend(), StaticBackend(), FileBackend(), EtcdBackend(), EtcdV2Backend()):
    register(_backend)


def load_installed() -> dict[str, str]:
    """Register the backends installed packages declare in ENTRY_POINT_GROUP, once per process: an
    entry point names a backend class (or instance) whose `name` is the entry point's. One that fails
    to load is remembered with why, and named only when someone asks for it."""
    global _installed
    if _installed is None:
        from importlib.metadata import entry_points

        _installed = {}
        for point in entry_points(group=ENTRY_POINT_GROUP):
            try:
                made = point.load()
                backend = made() if isinstance(made, type) else made
                if str(backend.name).lower() != point.name.lower():
                    raise ValueError(f"it is named '{backend.name}', not '{point.name}'")
                register(backend)
                _installed[point.name.lower()] = ""
            except Exception as exc:  # a broken package must not break every other backend
                _installed[point.name.lower()] = f"{point.value}: {type(exc).__name__}: {exc}"
    return _installed


def selectable() -> tuple[str, ...]:
    """The names `--rdzv-backend` accepts: rally's own and the installed packages'."""
    load_installed()
    return tuple(name for name, b in BACKENDS.items() if b.selectable)


def registered(name: str) -> Backend | None:
    """The backend registered as `name` (installed packages' included), None when there is none.
    The installed packages are looked for only for a name rally does not know (the scan of every
    installed distribution's entry points costs tens of milliseconds at each start)."""
    key = str(name).lower()
    if key not in BACKENDS:
        load_installed()
    return BACKENDS.get(key)


def backend_named(name: str, store_type: str = "tcp") -> Backend:
    """The backend `--rdzv-backend NAME` (with `--rdzv-conf store_type`) means, or EndpointError."""
    key = str(name).lower()
    known = registered(key)
    if known is None or not known.selectable:
        choices = selectable()
        broken = (_installed or {}).get(key)
        if broken:
            raise EndpointError(f"--rdzv-backend '{key}': its package could not be loaded ({broken})")
        close = difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        others = [n for n in choices if n not in BUILT_IN]
        also = f", or an installed one: {', '.join(others)}" if others else ""
        raise EndpointError(f"--rdzv-backend '{key}' is not supported; use c10d, etcd (elastic) or static{also}{hint}")
    if store_type == "file" and key == "c10d":
        return BACKENDS["file"]
    return BACKENDS[key]


def backend_of(endpoint: StoreEndpoint) -> Backend:
    """The backend that planned `endpoint` (and so opens it)."""
    backend = registered(endpoint.backend)
    if backend is None:
        raise EndpointError(f"no rendezvous backend '{endpoint.backend}' is installed here")
    return backend


def open_endpoint(
    endpoint: StoreEndpoint, prefix: str, connect_timeout: float, op_timeout: float, signer: Signer | None = None
) -> OpenedStore:
    """Open the store at `endpoint` through the backend that planned it."""
    return backend_of(endpoint).open(endpoint, prefix, connect_timeout, op_timeout, signer or Signer())
