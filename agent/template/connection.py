"""The agent's end of the control socket to its worker template (agent/template/client.py).

One `Connection` per template process: it starts the template, waits for it to be ready,
asks it to fork workers (passing their stdio fds), and hears each worker's exit status.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from rally.agent.base import linux
from rally.agent.template import wire as template_wire
from rally.rendezvous.status.long_wait import LongWait

READY_TIMEOUT = 300.0  # importing torch on a loaded node
REPLY_TIMEOUT = 30.0


class TemplateGone(Exception):
    """The template process died or stopped answering."""


class TemplateRefused(Exception):
    """The template is not safe to fork from (threads, CUDA)."""


class TemplateStuck(TemplateGone):
    """The template is alive but did not answer in time (a preload that hangs, say)."""


def status_to_returncode(status: int) -> int:
    # wait: not_a_wait: arithmetic
    return os.waitstatus_to_exitcode(status)


MESSAGE_TIMEOUT = 10.0
"""Seconds one read or write of a message on the template's socket may take (it is readable when read)."""


class Connection:
    """One template process and the agent's end of its socket."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        init: dict[str, Any],
        announce: Callable[[str], None] = lambda _line: None,
    ) -> None:
        """`announce` hears, every few seconds, what a long wait for the template waits for."""
        import subprocess

        from rally.agent.guard import processes

        parent = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.popen = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                close_fds=True,
                preexec_fn=lambda: processes._die_with_parent(parent),
            )
        finally:
            theirs.close()
        self.sock = ours
        # A message the template began and never finished (stopped, stuck mid-write) fails a read
        # after this long instead of blocking the agent for ever: the template is then gone.
        self.sock.settimeout(MESSAGE_TIMEOUT)
        self.announce = announce
        self.preload = ", ".join(init.get("preload") or []) or "nothing"
        self.exits: dict[int, tuple[int, float]] = {}
        self.ready: dict[str, Any] | None = None
        self.closed = False
        self.lock = threading.RLock()
        self.started_at = time.monotonic()
        try:
            template_wire.send_message(self.sock, init)
        except OSError:
            self.closed = True

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        # wait: not_a_wait: Popen.poll
        return not self.closed and self.popen.poll() is None

    # ------------------------------------------------------------ reading
    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """Read one message within `timeout`; exit reports are filed, others returned."""
        if self.closed:
            raise TemplateGone(self.describe_death())
        if not linux.readable(self.sock.fileno(), timeout):
            return None
        try:
            received = template_wire.recv_message(self.sock)
        except (OSError, ValueError) as exc:
            self.closed = True
            raise TemplateGone(f"the connection to the template broke: {exc}") from exc
        if received is None:
            self.closed = True
            raise TemplateGone(self.describe_death())
        message, fds = received
        if message.get("op") == "exit":
            self.exits[int(message["pid"])] = (int(message["status"]), float(message["time"]))
            return {"op": "filed"}
        message["fds"] = fds
        return message

    def _await(self, ops: tuple[str, ...], timeout: float, what: str) -> dict[str, Any]:
        """The next message of one of `ops`, within `timeout`; every few seconds meanwhile,
        `announce` hears `what` is awaited and for how long at most (rendezvous/status/long_wait.py)."""
        wait = LongWait(what, timeout, self.announce)
        while True:
            message = self._read(wait.slice())
            if message is not None and message["op"] != "filed":
                if message["op"] == "ready":
                    self.ready = message
                if message["op"] in ops:
                    return message
                for fd in message.get("fds", []):
                    os.close(fd)
            if not wait.tick():
                raise TemplateStuck(f"the worker template did not answer within {timeout:g} s")

    def drain(self) -> None:
        """File every exit report already waiting (never blocks)."""
        with self.lock:
            while not self.closed:
                try:
                    if self._read(0) is None:
                        return
                except TemplateGone:
                    return

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        with self.lock:
            if self.ready is None:
                what = (
                    f"waiting for the worker template (pid {self.pid}) to import {self.preload} before it starts "
                    "workers"
                )
                # wait: bounded, said by Connection._await: READY_TIMEOUT
                self._await(("ready",), READY_TIMEOUT if timeout is None else timeout, what)
            assert self.ready is not None
            return self.ready

    def fork(self, request: dict[str, Any], fds: list[int]) -> tuple[int, int]:
        """Ask for a worker; returns (pid, pidfd)."""
        with self.lock:
            try:
                template_wire.send_message(self.sock, request, fds)
            except OSError as exc:
                self.closed = True
                raise TemplateGone(self.describe_death()) from exc
            # wait: bounded, said by Connection._await: REPLY_TIMEOUT (30 s) for a fork
            reply = self._await(
                ("spawned", "refused"),
                REPLY_TIMEOUT,
                f"waiting for the worker template (pid {self.pid}) to fork a worker",
            )
            if reply["op"] == "refused":
                raise TemplateRefused(reply["reason"])
            pidfds = reply["fds"]
            for extra in pidfds[1:]:
                os.close(extra)
            if not pidfds:
                raise TemplateGone("the template sent no pidfd for its worker")
            return int(reply["pid"]), pidfds[0]

    def exit_status(self, pid: int, timeout: float) -> tuple[int, float] | None:
        """The (wait status, time) the template reported for `pid`, waiting up to `timeout`."""
        with self.lock:
            deadline = time.monotonic() + timeout
            while pid not in self.exits:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    break
                try:
                    self._read(left)
                except TemplateGone:
                    break
            return self.exits.pop(pid, None)

    def describe_death(self) -> str:
        try:
            # wait: short: timeout=1
            code = self.popen.wait(timeout=1.0)
        except Exception:  # still running, or not ours to wait for
            return "the template stopped answering"
        from rally.agent.guard.processes import describe_exit

        return f"the template process exited ({describe_exit(code)})"

    # ------------------------------------------------------------ stopping
    def close(self, timeout: float = 5.0) -> None:
        """Close the socket (the template exits at end of file), then make sure it is gone."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            # wait: short: timeout=5, then SIGKILL
            self.popen.wait(timeout=timeout)
        except Exception:  # subprocess.TimeoutExpired
            self.popen.kill()
            # wait: short: timeout=5, then SIGKILL
            self.popen.wait()
