"""rendezvous/c10d/wire.py against a real TCPStore: what `rally status` reads without torch is what
torch's client reads, and a peer that is no rally store never makes it hang, blow up or trust.

One TCPStore server on loopback for the module (torch's own, as an agent hosts it); rally's torch
client (rendezvous/c10d/store.py) writes, the wire reader reads back.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from rally.rendezvous.base.kv import StoreUnavailable, UntrustedValue
from rally.rendezvous.base.records import NodeInfo
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d import wire as wire_store
from rally.rendezvous.c10d.store import Store, connect_tcp_store, host_tcp_store
from rally.rendezvous.c10d.wire import WireStore
from rally.rendezvous.status.board import StatusBoard
from rally.rendezvous.status.reader import read_job_status

TOKEN = "the job's secret"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = host_tcp_store(0, 30, loopback_only=True)
    yield server.port
    del server


def writer(port: int, prefix: str, token: str = TOKEN) -> Store:
    """An agent's connection: torch's client, values signed with `token`."""

    def connect():
        return connect_tcp_store("127.0.0.1", port, 10, 10)

    return Store(connect(), prefix, f"the store at 127.0.0.1:{port}", connect, Signer(token))


def reader(port: int, prefix: str, token: str = TOKEN, timeout: float = 10) -> WireStore:
    return WireStore("127.0.0.1", port, prefix, timeout, Signer(token, verify=bool(token)))


# Same under load: what a key holds decides, not timing.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_the_wire_reader_reads_what_torch_s_client_wrote_under_the_same_keys(port):
    agent, status = writer(port, "rally/same/"), reader(port, "rally/same/")
    agent.set("record", '{"round": 3}')
    agent.append("list", "one\n")
    agent.append("list", "two\n")
    agent.add("counter", 5)
    assert status.check("record") and status.check("list") and not status.check("absent")
    assert status.get("record") == b'{"round": 3}' and status.get_str("record") == '{"round": 3}'
    assert status.get_unsigned("list") == b"one\ntwo\n"
    assert status.counter("counter", limit=10) == 5
    assert status.counter("new counter") == 0 and agent.counter("new counter") == 0  # made, as torch's add makes it
    with pytest.raises(UntrustedValue, match="out of range"):
        status.counter("counter", limit=4)
    assert not reader(port, "rally/other/").check("record")  # another job's prefix sees none of it


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_the_job_s_status_read_without_torch_equals_the_one_read_with_it(port):
    """rendezvous/status/reader.py through either client: the same nodes, round and end."""
    agent = writer(port, "rally/board/")
    board = StatusBoard(agent, NodeInfo(node_id="n1", host="node-a", addr="127.0.0.1", nproc=2))
    board.register()
    board.publish({"host": "node-a", "node_id": "n1", "round": 2, "workers": [{"rank": 0, "pid": 4242}]})
    with_torch = read_job_status(writer(port, "rally/board/"))
    without = read_job_status(reader(port, "rally/board/"))
    assert without == with_torch and without is not None
    assert [n["host"] for n in without["nodes"]] == ["node-a"] and without["round"] == 2
    assert read_job_status(reader(port, "rally/nobody/")) is None  # no agent registered there


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_record_the_job_s_key_does_not_verify_is_untrusted_and_not_shown_as_the_job_s(port):
    stranger = writer(port, "rally/forged/", token="")  # anyone can sign with the empty token
    stranger.set("status/node/n1", json.dumps({"host": "evil", "workers": []}))
    with pytest.raises(UntrustedValue, match="signed with a different job token"):
        reader(port, "rally/forged/").get("status/node/n1")
    # Without the token `rally status` shows records unverified, as it always did (docs/security.md).
    assert b"evil" in reader(port, "rally/forged/", token="").get("status/node/n1")
    board = StatusBoard(stranger, NodeInfo(node_id="n1", host="evil", addr="127.0.0.1", nproc=1))
    board.register()  # a node-list line sealed with the empty token: the job's key does not verify it
    status = read_job_status(reader(port, "rally/forged/"))
    assert status is not None and status["nodes"] == [], status


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_counter_holding_a_stranger_s_text_is_untrusted_and_the_reader_goes_on(port):
    agent, status = writer(port, "rally/garbage/"), reader(port, "rally/garbage/")
    agent.raw.set(agent.key("counter"), b"not a number")  # the server drops a client that adds to it
    agent.set("record", "fine")
    with pytest.raises(UntrustedValue, match="not a counter"):
        status.counter("counter")
    assert status.get("record") == b"fine"  # a new connection, the same answers


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_value_longer_than_the_cap_is_cut_not_read_into_memory(port, monkeypatch):
    monkeypatch.setattr(wire_store, "MAX_VALUE_BYTES", 1024)
    agent, status = writer(port, "rally/long/"), reader(port, "rally/long/")
    agent.append("list", "x" * 5000)
    agent.set("record", "y" * 5000)
    assert status.get_unsigned("list") == b"x" * 1024  # an append-list is read from its start
    with pytest.raises(UntrustedValue, match="more than 1024 bytes"):
        status.get("record")
    assert status.check("record")  # the rest of that answer is dropped with its connection


@pytest.mark.timeout(60)
def test_a_peer_that_accepts_and_never_answers_is_store_unavailable_within_the_timeout():
    """A frozen store (SIGSTOP: the kernel still accepts) or a program that reads and says nothing."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        status = WireStore("127.0.0.1", silent.getsockname()[1], "rally/x/", 0.5)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer within 0.5 s"):
            status.check("anything")
        assert time.monotonic() - started < 5


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_port_nothing_listens_at_is_store_unavailable_at_once():
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(StoreUnavailable, match="could not reach the rendezvous store"):
        WireStore("127.0.0.1", port, "rally/x/", 5).check("anything")
