"""Who listens on a taken port (rendezvous/c10d/port_owner.py), read from the kernel's socket tables
without reading the connections after the listeners: a joining agent whose port is taken asks once,
and the whole of /proc/net/tcp and tcp6 cost it tens of milliseconds on a busy host."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from rally.rendezvous.c10d.port_owner import TCP_TABLES, Listener, listeners, listening_lines

CONNECTIONS = 200


def every_listener() -> set[tuple[int, int, int]]:
    """(port, uid, inode) of every listening socket of both tables, from the whole of each table:
    what the reader must agree with."""
    found = set()
    for path, _ in TCP_TABLES:
        try:
            with open(path) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for fields in (line.split() for line in lines):
            if fields[3] == "0A":
                found.add((int(fields[1].partition(":")[2], 16), int(fields[7]), int(fields[9])))
    return found


@contextmanager
def busy_listener() -> Iterator[socket.socket]:
    """A listener on 127.0.0.1 with CONNECTIONS connections made to it and accepted (2 table lines each)."""
    with ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=CONNECTIONS))
        for _ in range(CONNECTIONS):
            stack.enter_context(socket.create_connection(server.getsockname(), timeout=5))
            # wait: short: the connection above is in the backlog already
            stack.enter_context(server.accept()[0])
        yield server


@pytest.mark.same_under_load  # the kernel's tables as they are, no clock involved
@pytest.mark.timeout(60)
def test_a_listener_among_many_connections_is_found_and_the_connections_are_not_read() -> None:
    with busy_listener() as server, socket.create_server(("127.0.0.1", 0)) as later:
        port = server.getsockname()[1]
        inode = os.fstat(server.fileno()).st_ino
        assert listeners(port) == [Listener("127.0.0.1", port, os.geteuid(), inode)]
        # every listener of the host, as the whole tables have them (this kernel writes them first)
        whole = every_listener()
        assert any(port == later.getsockname()[1] for port, _, _ in whole)
        for each in {port for port, _, _ in whole}:
            assert {(x.port, x.uid, x.inode) for x in listeners(each)} == {x for x in whole if x[0] == each}, each
        with open("/proc/net/tcp", "rb") as table:
            listed = list(listening_lines(table))
            read = table.tell()
        with open("/proc/net/tcp", "rb") as table:
            size = len(table.read())
        assert len(listed) >= 2 and size > 2 * CONNECTIONS * 100  # a line is ~150 bytes
        assert read < size / 4, (read, size)  # the connections' lines were never made


@pytest.mark.same_under_load  # a fixed table
@pytest.mark.timeout(10)
def test_the_listening_lines_end_at_the_first_connection_but_not_at_a_pending_one() -> None:
    def line(n: int, port: int, state: str) -> str:
        return (
            f"{n:4}: 0100007F:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  1000 0 {n} 1\n"
        )

    table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    table += line(0, 80, "0A") + line(1, 80, "03") + line(2, 81, "0A") + line(3, 82, "01") + line(4, 83, "0A")
    listed = list(listening_lines(io.BytesIO(table.encode())))
    assert [int(fields[1].split(b":")[1], 16) for fields in listed] == [80, 81]
