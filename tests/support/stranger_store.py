"""A stranger's hands on a c10d store: what any local user can write to a job's TCPStore.

The stranger of tests/support/stranger.py runs with the standard library only (no torch, no rally), so
this is c10d's wire protocol spoken over a plain socket, as a real attacker would speak it: a
query is one byte, a key or value a little-endian uint64 length and its bytes (the same from
torch 2.4 to 2.15, on both server back ends; rendezvous/c10d/connect.py speaks the first two
queries too), every key under torch's client prefix "/". Values are wrapped as rally wraps them
(rendezvous/base/token.py): without a job token a store's readers accept an envelope whose HMAC is
keyed with the empty token, which anyone can make.

    run_as_stranger(STORE_CLIENT + f"put({port}, 'rally/job/status/node/x', b'...')", timeout=10)
"""

from __future__ import annotations

STORE_CLIENT = r'''
import hashlib, hmac, json, socket, struct

VALIDATE, SET, GETNUMKEYS, APPEND = 0, 1, 7, 9
MAGIC = 0x3C85F7CE


def _text(data):
    return struct.pack("<Q", len(data)) + data


def sealed(key, payload, token=b""):
    """A value as an agent without a job token writes it (rendezvous/base/token.py Signer.seal)."""
    mac = hmac.new(token, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()
    return b"rally2." + mac + b"." + key.encode() + b"\0" + payload


def store(port):
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(struct.pack("<BI", VALIDATE, MAGIC))
    return conn


def done(conn):
    """A question with an answer: every write before it has been applied."""
    conn.sendall(bytes([GETNUMKEYS]))
    answer = b""
    while len(answer) < 8:
        chunk = conn.recv(8 - len(answer))
        if not chunk:
            raise SystemExit("the store dropped the connection")
        answer += chunk
    conn.close()


def put(port, key, payload):
    """SET `key` to `payload` in an envelope, as a record of the job."""
    conn = store(port)
    conn.sendall(bytes([SET]) + _text(b"/" + key.encode()) + _text(sealed(key, payload)))
    done(conn)


def append(port, key, data):
    conn = store(port)
    conn.sendall(bytes([APPEND]) + _text(b"/" + key.encode()) + _text(data))
    done(conn)
'''
