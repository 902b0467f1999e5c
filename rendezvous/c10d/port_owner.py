"""Who listens on a TCP port of this host: the kernel's socket tables, /proc/net/tcp and tcp6.

An agent that should host the job's store and finds the endpoint's port taken must decide
whether to join what listens there (rendezvous/c10d/store.py `open_tcp_store`). A c10d store has no
access control, so anyone who listens first and answers c10d (a proxy to a real store, say) would
read every record and could drop or delay any. The kernel knows who opened the listening socket:
each line of /proc/net/tcp and /proc/net/tcp6 holds a socket's local address, state, owner uid
and inode. Only a listener of the job's own user or root is joined on that ground alone
(`listener_owners` reads who that is); anyone else's must prove it is the job's store.

The tables are those of this process's network namespace, the one its connect goes through.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

TCP_TABLES = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))
TCP_LISTEN = b"0A"  # the kernel's TCP_LISTEN state, in hex as the tables write it
TCP_SYN_RECV = b"03"  # a connection being accepted
# The most of a table read: a host with a million sockets has ~150 MB of them; the listeners of
# a port are found long before (the kernel writes listening sockets first, bucket by bucket).
MAX_TABLE_BYTES = 64 << 20


@dataclass(frozen=True)
class Listener:
    """One listening socket: its local address, the uid that opened it, its inode."""

    address: str
    port: int
    uid: int
    inode: int

    def __str__(self) -> str:
        where = f"[{self.address}]" if ":" in self.address else self.address
        return f"{where}:{self.port} (uid {self.uid}, socket inode {self.inode})"


def _address(hex_text: str, family: int) -> str:
    """A table's address field (32-bit words in host byte order) as text."""
    words = [int(hex_text[i : i + 8], 16) for i in range(0, len(hex_text), 8)]
    packed = b"".join(struct.pack("=I", w) for w in words)
    text = socket.inet_ntop(family, packed)
    mapped = ipaddress.ip_address(text)
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)
    return text


def listeners(port: int) -> list[Listener]:
    """Every listening TCP socket of this network namespace on `port` (IPv4 and IPv6)."""
    found: list[Listener] = []
    for path, family in TCP_TABLES:
        try:
            with open(path, "rb") as table:
                lines = list(listening_lines(table))
        except OSError:  # no IPv6 here, or no /proc: nothing known from this table
            continue
        for fields in lines:
            address, _, port_hex = fields[1].partition(b":")
            try:
                if int(port_hex, 16) != port:
                    continue
                found.append(Listener(_address(address.decode("ascii"), family), port, int(fields[7]), int(fields[9])))
            except (ValueError, OSError, UnicodeError):
                continue
    return found


def listening_lines(table: BinaryIO) -> Iterator[list[bytes]]:
    """The fields of each listening socket's line of one table, read no further than those lines.

    The kernel writes a table's listening sockets first (its listening hash, then the established
    one) and makes the table a page at a time, as it is read: stopping at the first connection
    spares it the walk of the established hash, most of the cost (a whole table took 4 ms of system
    time with 500 connections, more with thousands). A SYN_RECV line does not end them (a kernel
    before 4.4 lists a listener's pending connections right after it)."""
    table.readline()  # the header
    read = 0
    for line in table:
        read += len(line)
        if read > MAX_TABLE_BYTES:
            return
        fields = line.split()
        if len(fields) < 10:
            continue
        if fields[3] == TCP_LISTEN:
            yield fields
        elif fields[3] != TCP_SYN_RECV:
            return


def _targets(host: str) -> set[str]:
    """The addresses a connect to `host` may reach."""
    try:
        return {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def listener_owners(host: str, port: int) -> list[Listener]:
    """The listening sockets a connect to `host:port` reaches: those bound to one of the addresses
    `host` resolves to (the kernel prefers them), else those bound to every address; if neither
    matches, every listener of the port. Empty when the tables say nothing (another namespace)."""
    every = listeners(port)
    targets = _targets(host)
    exact = [listener for listener in every if listener.address in targets]
    if exact:
        return exact
    wildcard = [listener for listener in every if listener.address in ("0.0.0.0", "::")]
    return wildcard or every
