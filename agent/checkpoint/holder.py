"""The memory tier's holder: a helper process of the agent that owns a node's checkpoint copies.

Why a process of its own: the copies must outlive the worker that made them (a restarted worker
reloads them in milliseconds), must never be owned by a worker (a dying worker cannot take them
along, and a stale one cannot keep writing), and persisting them must not cost the agent's main
loop anything. The holder imports no torch: slots hold torch.save's bytes (agent/checkpoint/core/shm.py),
persisting is a byte copy with a MAC (agent/checkpoint/persist.py), and its rules are agent/checkpoint/slots.py.

It talks JSON lines on two channels:

- **stdin/stdout, with the agent** (agent/checkpoint/node_checkpoints.py): `round` (open a round: its agreed
  resume step and the fence's lease), `renew`, `over`, `holdings`, `flush`; and it tells
  the agent `saved`, `durable` and one-line `warn`\\ ings. End of stdin means the agent is
  gone, however it died: the holder gives up any persist under way, deletes its shared memory
  and exits. It starts in a session of its own and ignores the terminal's signals, so a signal to
  the agent's process group (Ctrl-C, `kill -- -PGID`) cannot take the copies away before the
  agent has made the newest one durable.
- **an abstract Unix socket, with the workers** (agent/checkpoint/core/client.py; SOCK_SEQPACKET, one
  request or answer per packet): `reserve` a slot, `commit` or `abort` it (`copied`: an
  overlapped save's copy is done, its commit decided later), `resume`
  (which step, and from where), `next_slots` (the memfds the next saves will write, for the worker
  to map before it saves). A slot's memfd travels with the answer. The agent creates and
  binds the socket under a random name before this process starts and hands it over as an
  inherited descriptor (no name on any command line, and nobody can bind it first); the holder
  listens on it, so the workers' SO_PEERCRED names this process. A connection is served only
  if its peer has this user's uid and its first packet is `hello` with the job's secret
  (RALLY_CKPT_SECRET, read from the environment and dropped from it): another user, or another
  job of the same user, is turned away. A `reserve` larger than the node's whole memory is
  refused as a bad request; one that does not fit now goes to disk for that save only (nothing latches).

The copies are memfds (agent/checkpoint/core/shm.py): when the holder ends, however, the kernel frees them
as soon as no worker maps them any more. Nothing of the tier is a file.

Run by file path, like the orphan guard: `python <rally>/agent/checkpoint/holder.py SOCKET_FD TAG CKPT_DIR [LIMIT]`
(TAG names the memfds; not a secret). It says `{"ev": "ready"}` once it listens.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from rally.agent.checkpoint.core.held_dir import shown
from rally.agent.checkpoint.persist import DiskFull, PersistCancelled, default_name, persist, valid_name
from rally.agent.checkpoint.slots import NewestBusy, Refused, ShmTooSmall, SlotTable

PERSIST_NICENESS = 10
"""The persister thread's nice value (the holder's answers to workers keep the normal priority)."""
MAX_PAUSE_SECONDS = 5.0
"""The longest the persister waits for a worker's copy to finish before it goes on anyway."""
MAX_LINE = 64 * 1024
"""A request longer than this is not one of ours: the connection is closed."""
IDLE_SLICE_SECONDS = 1.0
"""The idle persister's wait for work, one slice at a time (a commit or a stop wakes it at once)."""
PERSIST_SHARE_ENV = "RALLY_CKPT_PERSIST_SHARE"
DEFAULT_PERSIST_SHARE = 0.01
"""The share of one core's time the disk copy may take (RALLY_CKPT_PERSIST_SHARE, in (0, 1]): after
a copy that took c seconds of the holder's CPU the persister rests c x (1 / share - 1) before the
next. The memory tier already covers a worker's failure; the disk copy is for the loss of the node
or of the job, and on a node whose cores all compute it takes its CPU from the steps (a read, a
digest and a write of the whole state), so writing every save would cost the training far more
than it protects. CPU time, not wall time: waiting for the disk (an fsync) costs the steps
nothing. A small state (a few ms of CPU) is still written nearly every save; a 400 MB one (about
half a second) about once a minute. The job's end, however it ends, still makes the newest copy
durable at once (`flush`)."""


SECRET_ENV = "RALLY_CKPT_SECRET"
"""The job's connection secret (agent/checkpoint/core/client.py's SECRET_ENV; not imported: the holder stays small)."""
HELLO_TIMEOUT = 10.0
"""Seconds a new connection has to say `hello` before it is closed."""


class Holder:
    def __init__(
        self, listener: socket.socket, secret: str, tag: str, checkpoint_dir: Path | None, memory_limit: int | None,
        out: BinaryIO, persist_share: float = DEFAULT_PERSIST_SHARE,
    ) -> None:  # fmt: skip
        self.secret = secret.encode()
        self.table = SlotTable(tag, memory_limit)
        self.checkpoint_dir = checkpoint_dir
        self.out = out
        self.out_lock = threading.Lock()
        self.stopping = False
        self.told_disk_only = False
        self.persist_share = persist_share
        self.persist_after = 0.0  # monotonic time before which the persister rests (see DEFAULT_PERSIST_SHARE)
        self.flushing = 0  # flushes waiting: the persister does not rest while the job's end waits for it
        self.listener = listener
        self.listener.listen(64)  # here, not in the agent: the workers' SO_PEERCRED then names this process

    # ------------------------------------------------------------------ to the agent
    def emit(self, **message: object) -> None:
        with self.out_lock:
            try:
                self.out.write((json.dumps(message) + "\n").encode())
                self.out.flush()
            except (OSError, ValueError):
                pass  # the agent is gone; stdin's end of file stops us

    def control(self, msg: dict[str, Any]) -> None:
        op, table = msg.get("op"), self.table
        reply: dict[str, Any] = {}
        if op == "round":
            table.open_round(int(msg["round"]), msg.get("resume"), float(msg["lease"]))
        elif op == "renew":
            table.renew(int(msg["round"]), float(msg["lease"]))
        elif op == "over":
            table.close_round(int(msg["round"]))
        elif op == "holdings":
            reply = {"memory": table.memory_steps(), "disk_only": table.disk_only is not None}
        elif op == "flush":
            reply = self.flush(float(msg["timeout"]))
        if "id" in msg:
            self.emit(reply=msg["id"], **reply)

    def flush(self, timeout: float) -> dict[str, Any]:
        """Wait (bounded) until the newest copy of every key is durable or failed to be."""
        deadline = time.monotonic() + timeout
        with self.table.cond:
            self.flushing += 1
            self.table.cond.notify_all()  # a resting persister starts now
            try:
                while self.table.pending() and (left := deadline - time.monotonic()) > 0:
                    # wait: bounded, said by agent/checkpoint/node_checkpoints.py HolderProcess._ask: the agent's
                    # flush at the job's end: up to --shutdown-timeout for the newest copy to be durable; the
                    # agent, which waits for the answer, says so
                    self.table.cond.wait(left)
            finally:
                self.flushing -= 1
            return {"pending": self.table.pending(), "durable": dict(self.table.durable)}

    # ------------------------------------------------------------------ the workers
    def serve(self) -> None:
        conn_id = 0
        while True:
            try:
                # wait: background: the holder's accept loop: it waits for workers while the job runs
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn_id += 1
            threading.Thread(target=self.worker, args=(conn, conn_id), daemon=True).start()

    def worker(self, conn: socket.socket, conn_id: int) -> None:
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.geteuid() or not self.greeted(conn):
                return
            conn.settimeout(None)
            # wait: background: one thread per worker connection, waiting for its next request; ends when the worker
            # closes it or dies
            while packet := conn.recv(MAX_LINE):
                answer, fds = self.answer(packet, conn_id)
                news = answer.pop("news", None)
                socket.send_fds(conn, [json.dumps(answer).encode()], fds)
                if news:  # the agent hears of a commit after the worker does: off the training step's stall
                    self.emit(ev="saved", key=news[0], step=news[1], memory=self.table.memory_steps())
        except OSError:
            pass
        finally:
            self.table.writer_gone(conn_id)
            conn.close()

    def greeted(self, conn: socket.socket) -> bool:
        """Whether the connection's first packet is `hello` with the job's secret (answered ok)."""
        conn.settimeout(HELLO_TIMEOUT)
        try:
            # wait: background: a connection's own thread waits for its hello with the job's secret: HELLO_TIMEOUT
            # (10 s) on the socket, then it is closed
            hello = json.loads(conn.recv(MAX_LINE))
            secret = hello.get("secret") if hello.get("op") == "hello" else None
        except (ValueError, AttributeError):
            return False
        if not isinstance(secret, str) or not hmac.compare_digest(secret.encode(), self.secret):
            return False
        conn.sendall(json.dumps({"ok": True}).encode())
        return True

    def answer(self, packet: bytes, conn_id: int) -> tuple[dict[str, Any], list[int]]:
        """The answer to one request, and the memfds that go with it."""
        table = self.table
        try:
            msg = json.loads(packet)
            op = msg["op"]
            if op == "reserve":
                name = self.persist_name(msg.get("persist"), int(msg["step"]))
                index, fd = table.reserve(
                    conn_id,
                    str(msg["key"]),
                    int(msg["step"]),
                    int(msg["size"]),
                    int(msg["round"]),
                    name,
                    int(msg.get("keep", 3)),
                    bool(msg.get("spare_newest", False)),
                )
                return {"ok": True, "slot": index}, [fd]
            if op == "commit":
                slot = table.commit(conn_id, str(msg["key"]), int(msg["step"]), int(msg["length"]), int(msg["round"]))
                return {"ok": True, "news": (str(msg["key"]), slot.step)}, []
            if op == "abort":
                table.abort(conn_id, str(msg["key"]), int(msg["step"]), ended=msg.get("ended") is True)
                return {"ok": True}, []
            if op == "copied":
                table.copied(conn_id, str(msg["key"]), int(msg["step"]))
                return {"ok": True}, []
            if op == "held":
                return {"ok": True, "held": table.held(str(msg["prefix"]))}, []
            if op == "slot":
                found = table.committed_slot(str(msg["key"]), int(msg["step"]))
                return {"ok": True, "length": found[1] if found else 0}, [found[0]] if found else []
            if op == "next_slots":
                nexts = table.next_slots(str(msg["key"]))
                return {"ok": True, "slots": [index for index, _ in nexts]}, [fd for _, fd in nexts]
            if op == "resume":
                newest, newest_index, newest_fd = table.resume(str(msg["key"]))
                return {"ok": True, "step": newest, "slot": newest_index}, [] if newest_fd is None else [newest_fd]
            return {"ok": False, "error": f"rally: unknown memory-tier request {op!r}"}, []
        except NewestBusy as exc:
            return {"ok": False, "busy": True, "error": str(exc)}, []
        except ShmTooSmall as exc:
            if not self.told_disk_only:  # one line, at the first save that did not fit
                self.told_disk_only = True
                self.emit(ev="warn", line=str(exc))
            return {"ok": False, "disk_only": True, "error": str(exc)}, []
        except Refused as exc:
            return {"ok": False, "error": str(exc)}, []
        except (ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "error": f"rally: malformed memory-tier request ({exc})"}, []
        except OSError as exc:
            return {"ok": False, "error": f"rally: memory tier: {exc.strerror or exc}"}, []

    def persist_name(self, persist: Any, step: int) -> str | None:
        """`persist` of a reserve: false (memory only), true (`step_<step>.pt`, keep-K) or a
        relative file name in the checkpoint directory (e.g. a rank's shard). A job without a
        checkpoint directory keeps its copies in memory only: a request to persist is refused."""
        if persist and self.checkpoint_dir is None:
            raise Refused("rally: this job has no --checkpoint-dir: its checkpoints are kept in memory only")
        if persist is True:
            return default_name(step)
        if not persist:
            return None
        if not isinstance(persist, str) or not valid_name(persist):
            raise ValueError(f"persist={persist!r} is not a relative file name")
        return persist

    # ------------------------------------------------------------------ to the disk
    def persister(self) -> None:
        """Copy the newest committed slot to disk, one at a time, at a low CPU priority, resting
        between copies in proportion to them (DEFAULT_PERSIST_SHARE): on a busy node the training
        step (whose stall is a copy) comes first, the disk write second."""
        table = self.table
        job: tuple[str, int, Any] | None = None
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERSIST_NICENESS)  # this thread only
        except OSError:
            pass
        while True:
            with table.cond:
                while not self.stopping:
                    now = time.monotonic()
                    if (now >= self.persist_after or self.flushing) and (job := table.next_to_persist()) is not None:
                        break
                    resting = self.persist_after - now
                    # wait: background: the idle or resting persister, in IDLE_SLICE_SECONDS (1 s) slices at most
                    # (a commit, a flush or a stop wakes it at once; the slice only re-checks)
                    table.cond.wait(min(IDLE_SLICE_SECONDS, resting) if resting > 0 else IDLE_SLICE_SECONDS)
                if self.stopping:
                    return
            assert job is not None  # the wait above ends with a job or with stopping
            cpu_before = time.process_time()  # every thread of the holder: the digest's too
            key, index, slot = job
            assert slot.fd is not None  # a committed slot keeps its memfd until it is freed
            assert self.checkpoint_dir is not None  # persist_name refuses a slot to persist without one
            ok = False
            try:
                path = persist(
                    slot.fd,
                    slot.length,
                    self.checkpoint_dir,
                    slot.step,
                    slot.keep,
                    self.between_chunks,
                    slot.persist_name,
                )
                ok = True
            except DiskFull as exc:
                self.emit(ev="warn", line=str(exc))
            except PersistCancelled:
                pass
            except OSError as exc:
                self.emit(
                    ev="warn",
                    line=(
                        f"checkpoint step {slot.step} could not be written to {shown(self.checkpoint_dir)}: "
                        f"{exc.strerror or exc}"
                    ),
                )
            except Exception as exc:  # a bug must not stop the persister: say it, keep the copies
                self.emit(
                    ev="warn",
                    line=f"checkpoint step {slot.step} could not be written to {shown(self.checkpoint_dir)}: {exc!r}",
                )
            with table.cond:
                table.persisted(key, index, ok)
                cpu = time.process_time() - cpu_before
                rest = cpu * (1 / self.persist_share - 1)  # DEFAULT_PERSIST_SHARE
                self.persist_after = time.monotonic() + rest
            if ok:
                self.emit(ev="durable", key=key, step=slot.step, path=str(path), cpu=round(cpu, 4), rest=round(rest, 3))

    def between_chunks(self) -> bool:
        """Pause the disk copy while a worker copies into a slot or reloads from one (bounded):
        the training step's stall, or the restart, is that copy, and on a small node both would
        share the same cores and memory bandwidth. True when the holder is stopping (the persist
        is given up)."""
        deadline = time.monotonic() + MAX_PAUSE_SECONDS
        with self.table.cond:
            while self.table.copying() and not self.stopping and (left := deadline - time.monotonic()) > 0:
                # wait: short: 50 ms slices, MAX_PAUSE_SECONDS (5 s) in all
                self.table.cond.wait(min(left, 0.05))  # a reload's pause ends by time, not by a notify
            return self.stopping

    def stop(self) -> None:
        with self.table.cond:
            self.stopping = True
            self.table.cond.notify_all()
        try:
            self.listener.close()
        except OSError:
            pass


def persist_share(raw: str) -> tuple[float, str | None]:
    """RALLY_CKPT_PERSIST_SHARE's value, and the line to say when it is not one."""
    if not raw:
        return DEFAULT_PERSIST_SHARE, None
    try:
        share = float(raw)
    except ValueError:
        share = 0.0
    if 0 < share <= 1:
        return share, None
    return DEFAULT_PERSIST_SHARE, (
        f"{PERSIST_SHARE_ENV}={raw!r} is not a share of the time in (0, 1] (1: write every save to disk at "
        f"once); using {DEFAULT_PERSIST_SHARE}"
    )


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    listener = socket.socket(fileno=int(argv[0]))
    tag, checkpoint_dir = argv[1], (Path(argv[2]) if argv[2] else None)  # "": memory only
    limit = int(argv[3]) if len(argv) > 3 and argv[3] else None
    secret = os.environ.pop(SECRET_ENV, "")
    if not secret:
        print(json.dumps({"ev": "warn", "line": f"the checkpoint holder was started without {SECRET_ENV}"}), flush=True)
        return 2
    share, bad_share = persist_share(os.environ.get(PERSIST_SHARE_ENV, ""))
    holder = Holder(listener, secret, tag, checkpoint_dir, limit, sys.stdout.buffer, share)
    persister = threading.Thread(target=holder.persister, daemon=True)
    try:
        threading.Thread(target=holder.serve, daemon=True).start()
        persister.start()
        holder.emit(ev="ready")
        if bad_share:  # after `ready`: a warning before it means the holder could not start
            holder.emit(ev="warn", line=bad_share)
        for line in sys.stdin.buffer:  # returns at end of file: the agent stopped us or died
            try:
                msg = json.loads(line)
                if msg.get("op") == "stop":
                    break
                holder.control(msg)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not from our agent; ignore
    finally:
        holder.stop()
        # wait: short: timeout=5 as the holder stops
        persister.join(timeout=5)
        holder.table.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
