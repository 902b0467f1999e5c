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


STORE_PROXY = r'''
import socket, sys, threading

def _pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def proxy(target_port, listen_port=0):
    """Listen on 127.0.0.1 (first: the port is then this user's) and relay every connection to the
    store at `target_port`: a stranger in the middle, who sees every record and could drop any."""
    server = socket.socket()
    server.bind(("127.0.0.1", listen_port))
    server.listen(64)
    print("listening", server.getsockname()[1], flush=True)
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", target_port), timeout=10)
        upstream.settimeout(None)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()
'''
"""A stranger's c10d store, standard library only: `proxy(port)` relays to a real store (the test's
torch TCPStore) from a socket the stranger listens on; it prints `listening PORT` first."""


_LISTENER = r'''
import socket, threading


def serve(handle, *args):
    """Listen on a port of the OS's choosing, print `listening PORT`, then give every connection
    to `handle(conn, *args)` in a thread of its own, forever (the test ends the process)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    print("listening", server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn, *args), daemon=True).start()
'''
"""The listening half the hostile servers below share: each adds what it says to a connection."""


HOSTILE_C10D = (
    _LISTENER
    + r'''
import struct, sys

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET = range(12)
CANCEL_WAIT, PING = 12, 13


def _exactly(conn, size):
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _blob(conn):
    (size,) = struct.unpack("<Q", _exactly(conn, 8))
    return _exactly(conn, size)


def _client(conn, mode, values):
    """Speak c10d as torch's server does, but `mode`: "silent-wait" never answers a WAIT or its
    CANCEL_WAIT; "huge-value" answers every read with a value it says is 1 TiB long."""
    try:
        while True:
            query = _exactly(conn, 1)[0]
            if query == VALIDATE or query == PING:
                nonce = _exactly(conn, 4)
                if query == PING:
                    conn.sendall(nonce)
            elif query == GETNUMKEYS:
                conn.sendall(struct.pack("<q", len(values)))
            elif query == SET:
                key = _blob(conn)
                values[key] = _blob(conn)
            elif query == APPEND:
                key = _blob(conn)
                values[key] = values.get(key, b"") + _blob(conn)
            elif query == MULTI_SET:
                (count,) = struct.unpack("<Q", _exactly(conn, 8))
                for _ in range(count):
                    key = _blob(conn)
                    values[key] = _blob(conn)
            elif query == DELETE_KEY:
                conn.sendall(struct.pack("<q", int(values.pop(_blob(conn), None) is not None)))
            elif query == COMPARE_SET:
                key, expected, desired = _blob(conn), _blob(conn), _blob(conn)
                current = values.get(key)
                if current is None and expected == b"" or current == expected:
                    values[key] = current = desired
                answer = current if current is not None else expected
                conn.sendall(struct.pack("<Q", len(answer)) + answer)
            elif query == ADD:
                key = _blob(conn)
                (amount,) = struct.unpack("<q", _exactly(conn, 8))
                total = int(values.get(key, b"0")) + amount
                values[key] = str(total).encode()
                conn.sendall(struct.pack("<q", total))
            elif query == CHECK:
                (count,) = struct.unpack("<Q", _exactly(conn, 8))
                keys = [_blob(conn) for _ in range(count)]
                conn.sendall(bytes([0 if all(k in values for k in keys) else 1]))
            elif query == WAIT:
                (count,) = struct.unpack("<Q", _exactly(conn, 8))
                for _ in range(count):
                    _blob(conn)
                if mode != "silent-wait":
                    conn.sendall(bytes([0]))  # STOP_WAITING: every key is there
            elif query == CANCEL_WAIT:
                pass  # never answered: the client waits for WAIT_CANCELED
            elif query in (GET, MULTI_GET):
                count = struct.unpack("<Q", _exactly(conn, 8))[0] if query == MULTI_GET else 1
                keys = [_blob(conn) for _ in range(count)]
                for key in keys:
                    if mode == "huge-value":
                        conn.sendall(struct.pack("<Q", 1 << 40) + b"x" * 1024)
                    else:
                        value = values.get(key, b"")
                        conn.sendall(struct.pack("<Q", len(value)) + value)
            else:
                print("a query this store does not speak:", query, file=sys.stderr, flush=True)
                return
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


def hostile_store(mode):
    serve(_client, mode, {})
'''
)
"""A hostile c10d store, standard library only: `hostile_store(mode)` answers torch's client as a
store does, until the query its `mode` is about (see `_client`); it prints `listening PORT` first."""


HOSTILE_ETCD = (
    _LISTENER
    + r'''
import json, sys

NESTED = b"[" * 100000 + b"]" * 100000
SHAPES = {
    "nested": NESTED,
    "nested-object": b'{"header": {"revision": "1"}, "kvs": ' + NESTED + b"}",
    "list": b"[1, 2, 3]",
    "string": b'"a string"',
    "wrong-types": json.dumps({"header": {"revision": "x"}, "kvs": [{"key": 5, "value": ["v"]}], "count": {}}).encode(),
}


def _answer(conn, shape):
    reader = conn.makefile("rb")
    try:
        while True:
            length = 0
            line = reader.readline(65536)
            if not line:
                return
            while line not in (b"\r\n", b"\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                line = reader.readline(65536)
            reader.read(length)
            if shape == "huge-length":
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                conn.sendall(head + b"Content-Length: 1099511627776\r\n\r\n{")
                threading.Event().wait()  # and nothing more
            elif shape == "endless-chunked":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
                while True:
                    conn.sendall(chunk)
            else:
                body = SHAPES[shape]
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                conn.sendall(head + body)
    except OSError:
        pass
    finally:
        conn.close()


def hostile_etcd(shape):
    """An etcd gateway's port that answers every request with the reply `shape` names."""
    serve(_answer, shape)
'''
)
"""A hostile etcd gateway, standard library only: `hostile_etcd(shape)` answers every POST with one
reply shape (nested past any parser, a list, a string, fields of the wrong types, a 1 TiB
Content-Length, a chunked reply that never ends); it prints `listening PORT` first."""
