"""The rendezvous backend registry (rendezvous/backends.py): each entry plans a store endpoint
from the options and opens a store that reports the port it is bound to."""

from __future__ import annotations

import dataclasses

import pytest

from rally.rendezvous.backends import (
    BACKENDS,
    EndpointError,
    HostPort,
    StoreRequest,
    backend_named,
    open_endpoint,
    selectable,
)
from rally.rendezvous.base.keys import job_prefix
from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import quiet_torch_logs


@pytest.mark.timeout(10)
def test_the_registry_holds_torchruns_backends_and_the_file_store() -> None:
    assert set(BACKENDS) == {"c10d", "static", "file", "etcd", "etcd-v2"}
    assert set(selectable()) == {"c10d", "static", "etcd", "etcd-v2"}  # no backend package installed here
    assert backend_named("C10D").name == "c10d"
    assert backend_named("c10d", store_type="file").name == "file"
    with pytest.raises(EndpointError, match=r"--rdzv-backend 'etdc' is not supported.*did you mean 'etcd'\?"):
        backend_named("etdc")


@pytest.mark.timeout(10)
def test_each_backend_plans_from_the_options() -> None:
    c10d = backend_named("c10d").plan(StoreRequest(endpoint="127.0.0.1:29411", max_nodes=2))
    assert (c10d.host, c10d.port, c10d.host_here, c10d.backend) == ("127.0.0.1", 29411, True, "c10d")
    from_slurm = backend_named("c10d").plan(
        StoreRequest(endpoint=HostPort("127.0.0.1", 17234), max_nodes=2, is_host=False)
    )
    assert (from_slurm.host, from_slurm.port, from_slurm.host_here) == ("127.0.0.1", 17234, False)
    static = backend_named("static").plan(StoreRequest(min_nodes=2, max_nodes=2, node_rank=1, master_addr="127.0.0.1"))
    assert (static.port, static.host_here, static.backend) == (29500, False, "static")
    etcd = backend_named("etcd").plan(StoreRequest(endpoint="127.0.0.1,127.0.0.2:2380", run_id="job1"))
    assert [str(m) for m in etcd.etcd] == ["127.0.0.1:2379", "127.0.0.2:2380"]
    with pytest.raises(EndpointError, match="needs --rdzv-id"):
        backend_named("etcd").plan(StoreRequest(endpoint="127.0.0.1"))
    with pytest.raises(EndpointError, match="fixed --nnodes"):
        backend_named("static").plan(StoreRequest(min_nodes=1, max_nodes=2))
    with pytest.raises(EndpointError, match="port 0 only works on the store's own host"):
        backend_named("c10d").plan(StoreRequest(endpoint="127.0.0.1:0", is_host=False))


@pytest.mark.timeout(60)
def test_a_store_hosted_on_port_0_reports_its_port_and_leaves_the_plan_alone() -> None:
    quiet_torch_logs()
    planned = backend_named("c10d").plan(StoreRequest())  # one node, no endpoint: localhost, any port
    assert (planned.host, planned.port, planned.host_here) == ("localhost", 0, True)
    opened = open_endpoint(planned, job_prefix("job1"), 5, 5, Signer("t"))
    assert isinstance(opened.store, KeyValueStore)
    assert opened.port == opened.server.port > 0
    assert planned.port == 0, "the planned endpoint is not changed behind the caller's back"
    assert dataclasses.replace(planned, port=opened.port) == opened.endpoint
    opened.store.set("k", "v")
    client = open_endpoint(
        backend_named("c10d").locate(f"localhost:{opened.port}"), job_prefix("job1"), 5, 5, Signer("t")
    )
    assert client.server is None and client.store.get("k") == b"v" and client.port == opened.port
    assert client.store.try_wait(["k"], 1) and not client.store.try_wait(["never"], 0.2)
