"""Fault matrix: reaching the store is bounded and never silent.

    a store frozen before an agent connects     -> one line within read_timeout (+ start-up), exit 2
    a store frozen while agents start            -> noticed within read_timeout, the agent stops
    `rally status` against a frozen store        -> one line within --timeout, exit 2
    --master-port held by an HTTP server         -> one line within 5 s of trying, exit 2
    the stores of a loopback job                 -> listen on that loopback address only (127.0.0.2 too),
                                                    the per-round workers' store (MASTER_PORT) included
    a refused store connection                   -> "waiting for the rendezvous store ..." every 5 s
                                                    with the time it gives up, then one line

Run beside a CPU hog too (RALLY_TEST_CPU_HOG=1, see conftest.py).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from support.helpers import (
    ProcessTracker,
    clean_env,
    free_port,
    procs,  # noqa: F401 - a fixture
    run_rally,
    wait_for,
    write_probe,
)
from support.live_rally import LiveRally

ONE_LINE_WORKER = "print('worker ran', flush=True)\n"


@pytest.fixture
def frozen_store(tmp_path: Path, procs: ProcessTracker) -> Iterator[tuple[int, subprocess.Popen]]:
    """A `rally store` on a free port (its own session), returned running; the test freezes it."""
    port = free_port()
    store = LiveRally(["store", "--port", str(port)], tmp_path, clean_env(), procs)
    store.wait_line("listening on port", 60)
    try:
        yield port, store.proc
    finally:
        try:
            store.proc.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            pass


def _agent_args(port: int, nnodes: str, read_timeout: float) -> list[str]:
    conf = f"read_timeout={read_timeout:g},join_timeout=60,keep_alive_interval=0.5,keep_alive_timeout=3,is_host=false"
    return ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "reach",
            "--local-addr", "127.0.0.1", "--rdzv-conf", conf, "--nproc-per-node", "1", "probe.py"]  # fmt: skip


# Same under load: the store is frozen before the agent starts; its answer never comes, and
# read_timeout, a clock's deadline, ends the wait.
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
def test_an_agent_started_against_a_frozen_store_stops_within_read_timeout(
    tmp_path: Path, frozen_store: tuple[int, subprocess.Popen]
) -> None:
    port, store = frozen_store
    write_probe(tmp_path / "probe.py", ONE_LINE_WORKER)
    store.send_signal(signal.SIGSTOP)
    result = run_rally(_agent_args(port, "1", 3), cwd=tmp_path, env=clean_env(), timeout=60)
    assert result.returncode == 2, result.describe()
    assert "did not answer within 3 s" in result.stderr, result.describe()
    assert "Traceback" not in result.stderr and "worker ran" not in result.stdout, result.describe()
    assert result.elapsed < 3 + 30, result.describe()  # read_timeout, plus start-up on a loaded machine
    print(
        "MEASURED agent against a store frozen before it connects (read_timeout 3 s): exit after "
        f"{result.elapsed:.1f} s"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.3, 1.5])
def test_a_store_frozen_while_an_agent_starts_is_noticed(
    tmp_path: Path, procs: ProcessTracker, frozen_store: tuple[int, subprocess.Popen], delay: float
) -> None:
    port, store = frozen_store
    write_probe(tmp_path / "probe.py", ONE_LINE_WORKER)
    agent = LiveRally(_agent_args(port, "2", 3), tmp_path, clean_env(), procs)  # waits for a second node
    time.sleep(delay)
    store.send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    code, ended = agent.wait_exit(60)
    assert code in (1, 2), agent.text()
    assert "frozen" in agent.text() or "has not answered" in agent.text(), agent.text()
    assert "Traceback" not in agent.text(), agent.text()
    assert ended - frozen < 3 + 20, f"stopped {ended - frozen:.1f} s after the freeze\n{agent.text()}"


# Same under load: the store is frozen before `rally status` starts; its answer never comes, and
# --timeout, a clock's deadline, ends the wait.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_rally_status_against_a_frozen_store_fails_within_its_timeout(
    tmp_path: Path, frozen_store: tuple[int, subprocess.Popen]
) -> None:
    port, store = frozen_store
    store.send_signal(signal.SIGSTOP)
    result = run_rally(
        ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "reach", "--timeout", "2"],
        cwd=tmp_path,
        env=clean_env(),
        timeout=40,
    )
    assert result.returncode == 2, result.describe()
    # one line naming the timeout: the socket's own ("did not answer") or the call's bound ("did not
    # finish"), whichever of the two 2 s clocks runs out first on a loaded machine
    line = result.stderr.strip()
    assert "\n" not in line and re.search(r"did not (answer|finish) within 2 s", line), result.describe()
    assert result.elapsed < 2 + 25, result.describe()  # --timeout, plus start-up on a loaded machine


# Same under load: the HTTP server never answers the store's handshake (it waits for a request
# line, and the handshake has no newline); the first answer's 5 s deadline, a clock's, decides.
@pytest.mark.same_under_load
@pytest.mark.timeout(90)
def test_a_master_port_held_by_an_http_server_fails_fast_with_one_line(tmp_path: Path, procs: ProcessTracker) -> None:
    port = free_port()
    http = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    procs.track_group(http.pid)
    wait_for(lambda: _accepts(port), 30, what="the HTTP server")
    write_probe(tmp_path / "probe.py", ONE_LINE_WORKER)
    result = run_rally(
        ["--nproc-per-node", "1", "--master-port", str(port), "probe.py"], cwd=tmp_path, env=clean_env(), timeout=60
    )
    assert result.returncode == 2, result.describe()
    assert "is already taken" in result.stderr and "not a c10d store" in result.stderr, result.describe()
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1, result.describe()
    assert result.elapsed < 5 + 30, result.describe()  # plus start-up on a loaded machine
    print(f"MEASURED --master-port held by an HTTP server: one line, exit 2 after {result.elapsed:.1f} s")


# Same under load: nothing ever listens; the lines' interval and join_timeout are clock deadlines.
@pytest.mark.same_under_load
@pytest.mark.timeout(90)
def test_a_refused_store_connection_says_what_it_waits_for_every_few_seconds(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    write_probe(tmp_path / "probe.py", ONE_LINE_WORKER)
    args = _agent_args(port, "1", 5)
    args[args.index("--rdzv-conf") + 1] = args[args.index("--rdzv-conf") + 1].replace(
        "join_timeout=60", "join_timeout=12"
    )
    result = run_rally(args, cwd=tmp_path, env=clean_env(), timeout=60)
    assert result.returncode == 2, result.describe()
    waiting = [
        line for line in result.stderr.splitlines() if f"waiting for the rendezvous store at 127.0.0.1:{port}" in line
    ]
    assert len(waiting) >= 2 and all("connection refused" in line and "giving up at" in line for line in waiting), (
        result.describe()
    )
    assert f"could not reach the rendezvous store at 127.0.0.1:{port} within 12 s" in result.stderr, result.describe()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ stores listen where their endpoint says

SLEEPER = """
import os, time
print("MASTER", os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], flush=True)
time.sleep(120)
"""


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


# Same under load: which addresses the stores bind.
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["standalone", "127.0.0.1", "localhost", "127.0.0.2"])
def test_the_stores_listen_where_their_endpoint_says(tmp_path: Path, procs: ProcessTracker, where: str) -> None:
    """The rendezvous store and the per-round workers' store (MASTER_PORT): loopback stays
    loopback, 127.0.0.2 is 127.0.0.2."""
    write_probe(tmp_path / "probe.py", SLEEPER)
    if where == "standalone":
        args, name = ["--standalone"], "localhost"  # MASTER_ADDR as torchrun gives it
    else:
        args, name = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{where}:{free_port()}"], where
    expected = socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0] if name == "localhost" else name
    rally = LiveRally(
        [*args, "--nproc-per-node", "1", "--shutdown-timeout", "1", "probe.py"], tmp_path, clean_env(), procs
    )
    rally.wait_line("MASTER", 60)
    master = next(line for _, line in rally.lines if "MASTER" in line).split()
    assert master[-2] == name, rally.text()
    listening = _listening(rally.proc.pid)
    assert (expected, int(master[-1])) in listening, listening  # the workers' store
    assert len(listening) >= 2 and {ip for ip, _ in listening} == {expected}, listening  # and the rendezvous store
    rally.proc.send_signal(signal.SIGTERM)
    rally.wait_exit(30)


def _hosted_store() -> tuple[object, object]:
    from rally.rendezvous.c10d.store import StoreEndpoint, open_tcp_store

    return open_tcp_store(StoreEndpoint("127.0.0.1", 0, True), "rally/reach/", 10.0, 10.0)


# Same under load: in-process, it counts the threads the store's calls start, which no
# scheduling changes (each call answers long before its 10 s bound).
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_the_calls_that_wait_on_the_store_reuse_one_thread_not_one_each() -> None:
    """get, multi_get and wait are bounded by running in another thread (a hostile store can hang
    them for ever); that thread is the connection's long-lived one, not one started per call
    (0.15-0.4 ms each, 10-50 calls per node at every job's start)."""
    store, _server = _hosted_store()
    store.set("k", "v")  # type: ignore[attr-defined]
    seen: set[threading.Thread] = set()  # the Thread objects themselves: a finished thread's id is reused

    def note_thread(*_args: object) -> None:
        seen.add(threading.current_thread())

    threading.settrace(note_thread)  # called once in every thread the threading module starts
    try:
        for _ in range(50):
            assert store.get("k") == b"v"  # type: ignore[attr-defined]
            assert store.multi_get(["k"]) == [b"v"]  # type: ignore[attr-defined]
            store.wait(["k"], 5.0)  # type: ignore[attr-defined]
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert len(seen) <= 1, f"{len(seen)} threads started for 150 store calls"
