"""The agent's end of in-process restarts: the socket that workers inside `rally.job.run` connect
to (agent/base/reentry_wire.py), and the rule for when a failure may be recovered in-process,
wired into the agent as one collaborator (`InProcessRestarts`, agent/base/collaborator.py).

A thread accepts the workers' connections and posts what they say to the agent's inbox as
`WorkerSaid` news, with the pid the kernel gives for the peer (what a worker claims about
itself is never trusted for who it is). The main thread sends through `send`.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rally.agent.base import reentry_wire as wire
from rally.agent.base.collaborator import Collaborator, StartedWorker, WorkerReentry
from rally.agent.base.event_loop import News, WorkerSaid
from rally.agent.rounds.parking import ParkingContext, WorkerParking
from rally.agent.rounds.warm_spares import WarmSpares
from rally.rendezvous.base.records import EndKind, RoundEnd
from rally.rendezvous.protocol import Round

# BURST_LIMIT in-process restarts in a row, each this soon after the previous one with no newer
# checkpoint step between them, are a loop the function cannot get out of: the next one restarts
# the processes. (One alone proves nothing: the holder's news of a save may lag the failure.)
BURST_SECONDS = 10.0
BURST_LIMIT = 3
SEND_SECONDS = 2.0
# A soft failure that says a peer's connection was lost waits this long for a local rank's exit
# (a killed rank's sockets close before it becomes a zombie): then that death is the root cause.
DEATH_WAIT_SECONDS = 1.0
LOST_PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "remote process exited", "Broken pipe")


class ReentryHub:
    """The listening socket, one connection per worker in `job.run`, and the thread reading them."""

    def __init__(self, post: Callable[[News], None]) -> None:
        self.post = post
        self.name = f"rally-reentry-{os.getpid()}-{os.urandom(8).hex()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(wire.address(self.name))
        self.listener.listen(256)
        self.links: dict[int, socket.socket] = {}  # worker pid -> its connection
        self.lock = threading.Lock()
        self.stop_r, self.stop_w = os.pipe()
        self.thread = threading.Thread(target=self._serve, name="rally-reentry-hub", daemon=True)
        self.thread.start()

    def env(self) -> dict[str, str]:
        return {wire.SOCKET_ENV: self.name, wire.AGENT_PID_ENV: str(os.getpid())}

    def linked(self, pid: int) -> bool:
        with self.lock:
            return pid in self.links

    def send(self, pid: int, op: str, **fields: object) -> bool:
        with self.lock:
            sock = self.links.get(pid)
        if sock is None:
            return False
        try:
            sock.settimeout(SEND_SECONDS)  # one packet into a local socket's buffer
            sock.send(wire.encode(op, **fields))
            return True
        except OSError:
            return False

    def forget(self, pid: int) -> None:
        with self.lock:
            sock = self.links.pop(pid, None)
        if sock is not None:
            sock.close()

    def stop(self) -> None:
        os.write(self.stop_w, b"x")
        # wait: short: 2 s, the thread returns at its next select
        self.thread.join(2.0)
        with self.lock:
            for sock in self.links.values():
                sock.close()
            self.links.clear()
        self.listener.close()
        os.close(self.stop_r)
        os.close(self.stop_w)

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, None)
        selector.register(self.stop_r, selectors.EVENT_READ, "stop")
        while True:
            # wait: not_a_wait: the hub's whole life; stop() wakes it through its pipe
            for key, _ in selector.select():
                if key.data == "stop":
                    selector.close()
                    return
                if key.fileobj is self.listener:
                    try:
                        # wait: not_a_wait: the selector said a connection is waiting
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    pid, uid, _ = struct.unpack(
                        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                    )
                    if uid != os.geteuid():  # another user's process: not one of ours
                        conn.close()
                        continue
                    with self.lock:
                        self.links[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                    continue
                link, pid = key.fileobj, key.data
                if not isinstance(link, socket.socket):
                    continue
                conn = link
                try:
                    # wait: not_a_wait: the selector said it is readable
                    data = conn.recv(wire.MAX_MESSAGE)
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(conn)
                    with self.lock:
                        if self.links.get(pid) is conn:
                            del self.links[pid]
                    conn.close()
                    continue
                message = wire.decode(data)
                if message is not None:
                    self.post(WorkerSaid(pid, message))


class InProcessRestarts(Collaborator):
    """In-process restarts as a feature of the agent: it owns the hub (its socket's name reaches the
    workers through `worker_env`, it stops at `exit`), the budget and the warm spares (refilled once
    a round's workers run, stopped at `exit`), and offers the agent the parking and re-entry of its
    workers (agent/rounds/parking.py) through `worker_reentry`."""

    def __init__(self, ctx: ParkingContext) -> None:
        self.hub = ReentryHub(ctx.loop.inbox.post)
        self.budget = ReentryBudget()
        self.spares = WarmSpares(ctx, self.hub.linked)
        self.parking = WorkerParking(ctx, self, self.spares)
        self.master: tuple[str, int] | None = None  # this round's workers' store, where spares start too

    def worker_env(self) -> dict[str, str]:
        return self.hub.env()

    def workers_starting(self, rnd: Round, master: tuple[str, int]) -> RoundEnd | None:
        self.master = master
        return None

    def workers_started(self, rnd: Round, workers: Sequence[StartedWorker]) -> None:
        """Registered last, so every other feature saw the workers first: the spares start behind them."""
        assert self.master is not None  # workers_starting came first
        self.spares.refill(rnd.assignment, self.master)

    def exit(self) -> str | None:
        self.spares.stop()  # the agent's workers are stopped; its spares go before the other features' exit
        self.hub.stop()  # the workers are stopped: nothing is linked any more
        return None

    def worker_reentry(self) -> WorkerReentry:
        return self.parking

    def linked(self, pid: int) -> bool:
        return self.hub.linked(pid)

    def send(self, pid: int, op: str, **fields: object) -> bool:
        return self.hub.send(pid, op, **fields)

    def refusal(self, checkpoint_step: int | None) -> str | None:
        return self.budget.refusal(checkpoint_step)

    def spent(self, checkpoint_step: int | None) -> None:
        self.budget.spent(checkpoint_step)


@dataclass
class ReentryBudget:
    """When a failure may be recovered in-process: not after BURST_LIMIT in-process restarts in a
    row that each came within BURST_SECONDS of the one before with no newer checkpoint step."""

    last: tuple[float, int | None] | None = None  # (time, checkpoint step) of the last in-process restart
    count: int = 0
    stalled: int = 0  # in-process restarts in a row that came fast and without progress

    def _fast_and_stalled(self, checkpoint_step: int | None, now: float) -> bool:
        if self.last is None:
            return False
        at, step = self.last
        return now - at < BURST_SECONDS and (checkpoint_step is None or step == checkpoint_step)

    def refusal(self, checkpoint_step: int | None, now: float | None = None) -> str | None:
        """Why the next restart must restart the processes, or None when it may be in-process."""
        now = time.monotonic() if now is None else now
        if self._fast_and_stalled(checkpoint_step, now) and self.stalled + 1 >= BURST_LIMIT:
            return (
                f"{BURST_LIMIT} in-process restarts in a row, each within {BURST_SECONDS:g} s of the last, "
                "saved no newer checkpoint"
            )
        return None

    def spent(self, checkpoint_step: int | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.stalled = self.stalled + 1 if self._fast_and_stalled(checkpoint_step, now) else 0
        self.last = (now, checkpoint_step)
        self.count += 1


def soft_failure_end(host: str, rank: int, local_rank: int, pid: int, message: dict) -> RoundEnd:
    """The round's end for an exception that escaped a worker's training function: the process
    lives on (no exit code), the exception and its traceback are the root cause."""
    kind = str(message.get("type") or "an exception")
    text = str(message.get("message") or "")
    what = f"{kind}: {text}" if text else kind
    detail = f"rank {rank} (local rank {local_rank}, pid {pid}) on {host} raised {what}"
    info = {
        "rank": rank,
        "local_rank": local_rank,
        "pid": pid,
        "host": host,
        "exit": f"raised {kind}",
        "exit_status": 1,
        "traceback": str(message.get("traceback") or "")[-20000:],
        "soft": True,  # in rally.job.run: the process is alive and may be re-entered
    }
    return RoundEnd(EndKind.WORKER_FAILED, detail, host, info)


def lost_peer(message: dict) -> bool:
    """Whether a worker's exception says a peer's connection was lost (gloo's, NCCL's words): a
    consequence of another rank's death rather than a fault of its own."""
    text = f"{message.get('message') or ''} {message.get('traceback') or ''}"
    return any(sign in text for sign in LOST_PEER_SIGNS)
