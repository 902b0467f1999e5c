"""This node's checkpoints as the agent sees them: one `NodeCheckpoints`, the agent's only
checkpoint object, and the handle of its memory tier's holder process (`HolderProcess`).

`NodeCheckpoints` is a collaborator of the agent (agent/base/collaborator.py), registered in
`Agent.collaborators`. agent/agent.py builds it, calls its hooks at the job's moments, and makes
three calls of its own; in the order of a job:

    ckpt = NodeCheckpoints.for_agent(agent)   # Agent.__init__: starts the holder (or none), waited for at its first use
    ckpt.helper_pids()            # hook, any time: the holder's pid, a helper of the agent (never killed as the job's)
    ckpt.round_holdings()         # hook, once the store is open: agent/checkpoint/holdings.py, which at every
    ckpt.memory_steps()           #   rendezvous reads the steps in this node's memory (with the disk's newest
                                  #   intact step: the resume step)
    ckpt.workers_starting(rnd, master)  # hook: the round's workers are about to start: saves of rnd's
                                  #   round are accepted from now on, fenced by a lease the agent renews
    ckpt.worker_env()             # hook, right after: the holder's address for every worker (none once it died)
    ckpt.watch(rnd)               # hook, each turn of the watch loop: renews the lease (a frozen agent's
                                  #   workers cannot checkpoint)
    ckpt.round_ending(rnd)        # hook, before the round's workers are stopped: a late save is refused
    ckpt.exit()                   # hook, the agent exits, its workers stopped: the newest in-memory step
                                  #   made durable (bounded by --shutdown-timeout), the memory freed; a line
                                  #   if the newest saved step died with the holder (the job then exits 1)
    ckpt.status_fields()          # hook, any time: the last saved and durable steps (rally status, /metrics)

Without a memory tier (`RALLY_MEMORY_TIER=0`, or a holder that could not start) there is no
holder (`NodeCheckpoints.holder` is None) and every call above does nothing: saves go to
disk. A holder that dies later is noticed at once (one line) and is then as good as none for every
later round: their workers get no holder in their environment, so `rally.job.save` writes to disk
(or, without a checkpoint directory, says once that checkpoints are off), and the rounds agree on
a resume step from the disk alone. The job's end does not count the dead holder's in-memory steps
as durable: a job whose newest step died with it does not exit 0.

At the job's end the newest in-memory step is made durable first, within the grace period: a whole
state by the holder's persister, a sharded (DCP) one by a helper process that writes the ranks'
parts the stopped workers could not write any more and publishes the step
(agent/checkpoint/sharded/flush.py): "saving at the breakpoint".

The holder (`HolderProcess`): a thread reads its news: `saved` and `durable` steps go
to events.jsonl (`checkpoint_saved`, `checkpoint_durable`) and to the status fields; a `warn`
is one line on the console (shared memory too small, disk full). Its socket is the agent's:
created and bound here under a random name before the holder starts, handed to it as an inherited
descriptor (no name on its command line, no moment when another user could bind the name first),
with the job's connection secret in its environment. The agent waits (bounded) for the holder to
say it listens where it first uses it (`StartingHolder`: its start overlaps the agent's); a holder
that cannot start leaves the node without a memory tier with one line (saves go to disk), never
half on.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rally.agent.base.collaborator import AgentContext, Collaborator
from rally.agent.base.event_log import EventLog
from rally.agent.base.helper_process import HelperProcess, state_of
from rally.agent.checkpoint import holder as ckpt_holder
from rally.agent.checkpoint.checkpoint_dir import newest_checkpoint_step
from rally.agent.checkpoint.core import auth
from rally.agent.checkpoint.core import client as ckpt_client
from rally.agent.checkpoint.core.client import HOLDER_LOST_ENV, SECRET_ENV, CheckpointRefused, HolderAddress, MemoryTier
from rally.agent.checkpoint.core.held_dir import moved_line, shown
from rally.agent.checkpoint.core.shm import socket_address
from rally.agent.checkpoint.holdings import RoundHoldings
from rally.agent.checkpoint.memory_limit import MEMORY_LIMIT_ENV, memory_limit_bytes  # noqa: F401 - part of this module's API
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.checkpoint.sharded import flush as dcp_flush
from rally.agent.display import console
from rally.rendezvous.protocol import Round
from rally.rendezvous.status.long_wait import LongWait

MEMORY_TIER_ENV = "RALLY_MEMORY_TIER"
"""Set to 0 to turn the memory tier off: every save then goes straight to disk."""
REPLY_TIMEOUT = 10.0
"""Seconds the agent waits for an answer of the holder outside a flush."""
RENEW_INTERVAL = 1.0
"""How often the agent renews the round's lease at most (seconds)."""
READY_TIMEOUT = 15.0
"""Seconds the agent waits for a starting holder to say it listens before it turns the tier off."""


def fence_lease(keep_alive_timeout: float) -> float:
    """How long a round's saves are accepted without the agent renewing: twice the keep-alive
    timeout, at least 10 s (a frozen agent's workers stop checkpointing within it)."""
    return max(10.0, 2 * keep_alive_timeout)


def _limit_argument(text: str) -> str:
    """The holder's memory limit argument: bytes, or "" for its default. The launcher refuses a bad
    value (exit 2); one that reaches here anyway is passed on, and the holder cannot start (one line)."""
    try:
        return str(memory_limit_bytes(text) or "")
    except ValueError:
        return text


class NodeCheckpoints(Collaborator):
    """This node's checkpoints as the agent sees them: its memory tier's holder (or none: `holder`
    is None) and what the disk holds. The module docstring gives the order in which the agent calls it."""

    def __init__(
        self, checkpoint_dir: str | None, events: EventLog, run_id: str = "", keep_alive_timeout: float = 5.0,
        shutdown_timeout: float = 30.0, warn: Callable[[str], None] = console.warn,
        say: Callable[[str], None] = console.say,
    ) -> None:  # fmt: skip
        self.checkpoint_dir = checkpoint_dir
        self.events, self.warn, self.say = events, warn, say
        self.run_id = run_id
        self.lease = fence_lease(keep_alive_timeout)
        self.shutdown_timeout = shutdown_timeout  # the job's end: how long the newest step may take to be durable
        self.round: int | None = None  # the last round opened: names a sharded step's temporary directory
        self._starting = HolderProcess.spawn(checkpoint_dir, events, warn)  # None: no memory tier on this node
        self._holder: HolderProcess | None = None
        self._ready_lock = threading.Lock()
        self.single_node = False  # a job of one node at most: the disk's files no newer than the memory are not read
        # --checkpoint-dir as named, when `checkpoint_dir` is the directory held open (core/held_dir.py)
        self.given_dir: str | None = None

    @property
    def holder(self) -> HolderProcess | None:
        """The holder, waited for at its first use (`StartingHolder`); None: no memory tier on this node."""
        if self._starting is not None:
            with self._ready_lock:  # the status thread may ask while the main thread waits
                if self._starting is not None:
                    self._holder, self._starting = self._starting.ready(), None
        return self._holder

    @classmethod
    def for_agent(cls, ctx: AgentContext) -> NodeCheckpoints:
        """Built from what a collaborator sees of its agent."""
        spec = ctx.spec
        keep_alive = ctx.plan.settings.keep_alive_timeout
        made = cls(spec.checkpoint_dir, ctx.events, spec.run_id, keep_alive, spec.shutdown_timeout)
        made.single_node = ctx.plan.settings.max_nodes == 1
        made.given_dir = spec.checkpoint_dir_given
        return made

    # ------------------------------------------------------------------ the agent's other hooks
    def worker_env(self) -> dict[str, str]:
        return self.env()  # not a plain hook: it adds to the workers' environment

    def helper_pids(self) -> frozenset[int]:
        pid = self.pid
        return frozenset() if pid is None else frozenset({pid})

    def round_holdings(self) -> RoundHoldings:
        """The memory tier's steps and the disk's, read cheaply for the restart (agent/checkpoint/holdings.py)."""
        return RoundHoldings(self, self.single_node)

    @property
    def pid(self) -> int | None:
        """The holder's pid (a helper of the agent's: never killed as the job's), None without one."""
        starting = self._starting  # its pid is known before it is ready: no wait here
        if starting is not None:
            return starting.pid
        return self._holder.pid if self._holder is not None else None

    def env(self) -> dict[str, str]:
        """The holder's address for the next round's workers; nothing without one, a marker once it died."""
        return self.holder.env() if self.holder is not None else {}

    def memory_steps(self) -> list[int]:
        """The steps this node's memory tier holds (none without a holder, or once it died)."""
        return self.holder.memory_steps() if self.holder is not None else []

    def workers_starting(self, rnd: Round, master: tuple[str, int]) -> None:
        """Saves of round `rnd` are accepted from now on, while the agent renews its lease; its
        workers resume from the round's agreed step."""
        a = rnd.assignment
        self.round = a.round
        self._say_what_was_passed_over()
        if self.holder is not None:
            self.holder.open_round(a.round, a.resume_step, self.lease)

    def _say_what_was_passed_over(self) -> None:
        """One line, once, when --checkpoint-dir's name no longer leads to the directory the job writes through;
        and one per checkpoint the round's resume step passed over because this job must not load it."""
        for refused in auth.take_refusals():
            self.warn(refused)
        if self.given_dir is not None and self.checkpoint_dir is not None:
            line = moved_line(self.checkpoint_dir, self.given_dir)
            if line is not None:
                self.warn(line)
                self.given_dir = None

    def watch(self, rnd: Round) -> None:
        """Renew the round's lease (at most every RENEW_INTERVAL): a frozen agent's workers cannot checkpoint."""
        if self.holder is not None:
            self.holder.renew()

    def round_ending(self, rnd: Round) -> None:
        """From now on a save of this round's workers is refused."""
        if self.holder is not None:
            self.holder.close_round(rnd.assignment.round)

    def status_fields(self) -> dict[str, object]:
        """The last saved and durable steps, for `rally status`, the live view and /metrics."""
        return self.holder.status_fields() if self.holder is not None else {}

    def exit(self) -> str | None:
        """The job is over: make the newest in-memory step durable (bounded: --shutdown-timeout), then
        free the memory. One line when the newest saved step never reached disk because the holder
        died (the agent then does not report success), else None."""
        holder = self.holder
        if holder is None:
            self._say_what_was_passed_over()
            return None
        deadline = time.monotonic() + self.shutdown_timeout
        if not holder.flush(self.shutdown_timeout):
            holder.unflushed = True  # lost() says which step did not reach the disk
            if holder.last_saved is None and holder.checkpoint_dir is not None and not holder.died:
                self.warn(  # it never told of a save: one it took in its last moments may not be on disk
                    f"the checkpoint holder (pid {holder.pid}) did not make its copies durable at the job's end "
                    f"({holder.unanswered or 'the flush ran out of time'}); a step saved just before may be missing "
                    f"from {shown(holder.checkpoint_dir)}"
                )
        try:
            self._flush_sharded(holder, max(0.0, deadline - time.monotonic()))
        finally:
            holder.stop()
        self._say_what_was_passed_over()
        return holder.lost()

    def _flush_sharded(self, holder: HolderProcess, seconds: float) -> None:
        """Sharded steps in this node's memory newer than the newest on disk are written by
        agent/checkpoint/sharded/flush.py (a helper: publishing needs torch), at most `seconds`."""
        if holder.died or holder.unanswered is not None or self.checkpoint_dir is None or seconds <= 0:
            return
        address = holder.address
        directory = Path(self.checkpoint_dir)
        durable = dcp_files.newest_intact_step(directory)
        client = MemoryTier(address, -1)
        try:
            held = client.held("dcp")
        except CheckpointRefused:
            return
        finally:
            client.close()
        if not any(s > (durable if durable is not None else -1) for steps in held.values() for s in steps):
            return
        env = {
            **os.environ,
            **address.env(),  # the holder's address and the job's secret: in the environment, never in argv
            "RALLY_ROUND": str(self.round or 0),
            "TORCHELASTIC_RUN_ID": self.run_id or os.environ.get("TORCHELASTIC_RUN_ID", "local"),
        }
        command = [sys.executable, str(Path(dcp_flush.__file__).resolve()), str(directory), f"{seconds:.3f}"]
        self.say(
            f"writing the newest sharded checkpoint held only in memory to {shown(directory)} (up to {seconds:.0f} s)"
        )
        try:
            # wait: bounded, said by NodeCheckpoints._flush_sharded: the job's end: what is left of
            # --shutdown-timeout, + 5 s
            done = subprocess.run(
                command, env=env, stdout=subprocess.PIPE, timeout=seconds + 5.0, check=False, start_new_session=True
            )
            result = json.loads(done.stdout.decode().strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as exc:
            result = {
                "warn": (
                    f"the newest sharded checkpoint in memory was not made durable in {seconds:.0f} s "
                    f"({type(exc).__name__})"
                )
            }
        if "step" in result:
            holder.last_durable = max(holder.last_durable or -1, int(result["step"]))
            self.events.emit("checkpoint_durable", step=result["step"], path=result["path"], where="breakpoint")
            self.say(
                f"sharded checkpoint step {result['step']} was only in memory: written to {result['path']} before exit"
            )
        elif "warn" in result:
            self.warn(str(result["warn"]))
            self.events.emit("checkpoint_warning", line=result["warn"])


def socket_name() -> str:
    """A fresh random name for the holder's socket (128 bits: nobody guesses it before it is bound)."""
    return secrets.token_hex(16)


class HolderProcess:
    """The handle of this node's checkpoint holder (agent/checkpoint/holder.py): starts it, talks to it,
    hears its news, stops it. Its calls do nothing once the holder died (`off`)."""

    def __init__(
        self, helper: HelperProcess, address: HolderAddress, checkpoint_dir: Path | None, events: EventLog,
        warn: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.helper = helper
        self.process = helper.process
        self.checkpoint_dir = checkpoint_dir
        self.address = address
        self.stopping = False
        self.died = False
        self.unanswered: str | None = None  # the question the holder left unanswered (stopped, stuck)
        self.unflushed = False  # the job-end flush did not finish: the newest step may not be durable
        self.events = events
        self.warn = warn
        self.last_saved: int | None = None
        self.last_durable: int | None = None
        self.memory: list[int] = []
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._next_id = 0
        self._lock = threading.Lock()
        self._renewed = 0.0
        self._round: int | None = None
        self._lease = 10.0
        threading.Thread(target=self._read, daemon=True, name="rally-ckpt-tier").start()

    @classmethod
    def start(cls, checkpoint_dir: str | None, events: EventLog, warn: Callable[[str], None]) -> HolderProcess | None:
        """Start the holder and wait until it listens (`spawn`, then `StartingHolder.ready`)."""
        starting = cls.spawn(checkpoint_dir, events, warn)
        return starting.ready() if starting is not None else None

    @staticmethod
    def spawn(checkpoint_dir: str | None, events: EventLog, warn: Callable[[str], None]) -> StartingHolder | None:
        """Start the holder without waiting for it (`StartingHolder.ready` does); None (no memory
        tier: saves go to disk) when the tier is turned off, or (with one line) when its socket
        cannot be set up. Without a checkpoint directory the holder runs
        too: a script's checkpoints then live in memory only (rally.job saves them with
        `persist=False`, and the holder refuses to persist), so restarts within the job resume
        from them and a script written for rally needs no flag."""
        if os.environ.get(MEMORY_TIER_ENV, "1") == "0":
            return None
        name, secret = socket_name(), secrets.token_hex(32)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(socket_address(name))
            limit = _limit_argument(os.environ.get(MEMORY_LIMIT_ENV, ""))
            helper = HelperProcess(
                ckpt_holder.__file__, str(listener.fileno()), secrets.token_hex(4), checkpoint_dir or "", limit,
                stdout=subprocess.PIPE, pass_fds=(listener.fileno(),), env={**os.environ, SECRET_ENV: secret},
                name="the checkpoint holder", warn=warn,
            )  # fmt: skip
        except OSError as exc:
            warn(f"the in-memory checkpoint tier is off: its socket could not be set up ({exc}); saves go to disk")
            return None
        finally:
            listener.close()  # the holder has its own descriptor of it
        return StartingHolder(helper, HolderAddress(name, helper.pid, secret), checkpoint_dir, events, warn)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def off(self) -> bool:
        """The holder died (its stdout ended, or it exited and the reader has not seen it yet): the
        tier is off for good, and every call below does what it would without a holder."""
        # wait: not_a_wait: Popen.poll returns at once
        if not self.died and not self.stopping and self.process.poll() is not None:
            self.died = True  # lost() must count it even if the reader has not seen the end yet
        return self.died

    def env(self) -> dict[str, str]:
        """The holder's address for the next round's workers; nothing once it died (they save to disk)."""
        if self.off:
            return {HOLDER_LOST_ENV: "1"}
        memory_only = {ckpt_client.MEMORY_ONLY_ENV: "1"} if self.checkpoint_dir is None else {}
        return {**self.address.env(), **memory_only}

    def lost(self) -> str | None:
        """Why the newest saved step is not durable because the holder died, stopped answering or
        did not finish its flush in time (one line), or None."""
        if not (self.died or self.unflushed) or self.checkpoint_dir is None:  # memory only: nothing to reach a disk
            return None
        on_disk = [s for s in (self.last_durable, newest_checkpoint_step(self.checkpoint_dir)) if s is not None]
        saved, durable = self.last_saved, max(on_disk, default=None)  # another node's holder may have written it
        if saved is None or (durable is not None and durable >= saved):
            return None
        why = "died" if self.died else f"did not make it durable ({self.unanswered or 'the flush ran out of time'})"
        return (
            f"checkpoint step {saved} never reached {shown(self.checkpoint_dir)}: the checkpoint holder "
            f"(pid {self.pid}) "
            f"{why}; the newest step on disk is {durable if durable is not None else 'none'}"
        )

    # ------------------------------------------------------------------ talking to the holder
    def _send(self, message: dict[str, Any]) -> bool:
        return self.helper.send(json.dumps(message))

    def _ask(self, wait: float, **message: object) -> dict[str, Any] | None:
        """The holder's answer to `message` within `wait` s, else None. A holder that left a question
        unanswered (stopped, stuck) is not asked again: every later question is None at once, and
        the job's end does not wait for its flush (a finished job must never wait on it)."""
        if self.unanswered is not None:
            return None
        state = state_of(self.pid)
        if state.startswith("stopped"):  # it cannot answer before someone continues it
            self._no_answer(str(message.get("op")), f"it is {state}")
            return None
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            if not self._send({**message, "id": ident}):
                return None
            what = (  # the job-end flush can take --shutdown-timeout; the others answer at once
                f"waiting for the newest in-memory checkpoint to be written to {shown(self.checkpoint_dir)}"
                if message.get("op") == "flush"
                else f"waiting for the checkpoint holder (pid {self.pid}) to answer '{message.get('op')}'"
            )
            long_wait = LongWait(what, wait, console.say)  # in slices, with a line every few seconds
            while True:
                try:
                    # wait: slice, said by HolderProcess._ask: slices of one answer of the holder: REPLY_TIMEOUT (10
                    # s), the job-end flush --shutdown-timeout + 1 s
                    reply = self._replies.get(timeout=long_wait.slice())
                except queue.Empty:
                    if long_wait.tick():
                        continue
                    self._no_answer(str(message.get("op")), f"no answer within {wait:g} s")
                    return None
                if reply.get("reply") == ident:
                    return reply
                if long_wait.left() <= 0:
                    self._no_answer(str(message.get("op")), f"no answer within {wait:g} s")
                    return None

    def _no_answer(self, op: str, why: str) -> None:
        """Say once that the holder did not answer; from now on nobody waits for it."""
        if self.unanswered is None and not self.off:
            self.unanswered = f"it did not answer '{op}': {why}"
            line = (
                f"the checkpoint holder (pid {self.pid}) did not answer '{op}' ({why}); the agent no longer waits "
                "for it"
            )
            self.warn(line)
            self.events.emit("checkpoint_warning", line=line)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._hear(line)
        if not self.stopping:  # end of file while the agent still needs it: the holder died
            self.died = True
            after = "saves go to disk" if self.checkpoint_dir is not None else "checkpoints are off"
            said = (
                f"the checkpoint holder of this node (pid {self.pid}) died: its in-memory checkpoints are lost "
                f"(newest step on disk: {self.last_durable}); the memory tier is off from the next round on, "
                f"{after}"
            )
            self.warn(said)
            self.events.emit("checkpoint_warning", line=said)

    def _hear(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if "reply" in msg:
            self._replies.put(msg)
        elif msg.get("ev") == "saved":
            self.last_saved, self.memory = msg["step"], msg.get("memory", self.memory)
            self.events.emit("checkpoint_saved", step=msg["step"], key=msg.get("key"), where="memory")
        elif msg.get("ev") == "durable":
            self.last_durable = max(self.last_durable or -1, msg["step"])
            self.events.emit(  # cpu: the holder's CPU seconds for the copy; rest: seconds until it writes again
                "checkpoint_durable", step=msg["step"], path=msg.get("path"), cpu=msg.get("cpu"), rest=msg.get("rest")
            )
        elif msg.get("ev") == "warn":
            self.warn(str(msg.get("line", "")))
            self.events.emit("checkpoint_warning", line=msg.get("line"))

    # ------------------------------------------------------------------ the agent's calls
    def memory_steps(self) -> list[int]:
        if self.off:  # its copies went with it: no round may agree on one of them
            self.memory = []
            return []
        reply = self._ask(REPLY_TIMEOUT, op="holdings")
        if reply is not None:
            self.memory = list(reply.get("memory", []))
        return self.memory

    def open_round(self, round_no: int, resume_step: int | None, lease: float) -> None:
        if self.last_durable is None and self.checkpoint_dir is not None:  # what earlier runs left (cached)
            self.last_durable = newest_checkpoint_step(self.checkpoint_dir)
        if self.off:
            return
        self._round, self._lease, self._renewed = round_no, lease, time.monotonic()
        self._ask(REPLY_TIMEOUT, op="round", round=round_no, resume=resume_step, lease=lease)

    def renew(self) -> None:
        now = time.monotonic()
        if self._round is not None and now - self._renewed >= RENEW_INTERVAL:
            self._renewed = now
            self._send({"op": "renew", "round": self._round, "lease": self._lease})

    def close_round(self, round_no: int) -> None:
        self._round = None
        if not self.off:
            self._ask(REPLY_TIMEOUT, op="over", round=round_no)

    def flush(self, timeout: float) -> bool:
        """Wait until the newest copy is durable (or its write failed), at most `timeout`; True if done."""
        if self.off or self.checkpoint_dir is None:  # nothing left to write, or nowhere: memory only
            return True
        reply = self._ask(timeout + 1.0, op="flush", timeout=timeout)
        return reply is not None and not reply.get("pending", True)

    def status_fields(self) -> dict[str, Any]:
        return {"checkpoint_saved_step": self.last_saved, "checkpoint_durable_step": self.last_durable}

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the holder (its memory goes with it); killed if it does not stop in time."""
        self.stopping = True
        self._send({"op": "stop"})
        self.helper.stop(timeout)


class StartingHolder:
    """A holder started but not yet waited for: the agent starts it first thing and waits for its
    'ready' line only where it first needs it (the first rendezvous asks for its steps), so the
    holder's start-up (~0.1 s) overlaps the agent's own (torch's import, the store) instead of
    adding to the job's start."""

    def __init__(
        self, helper: HelperProcess, address: HolderAddress, checkpoint_dir: str | None, events: EventLog,
        warn: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.helper, self.address, self.checkpoint_dir = helper, address, checkpoint_dir
        self.events, self.warn = events, warn

    @property
    def pid(self) -> int:
        return self.helper.pid

    def ready(self) -> HolderProcess | None:
        """The holder once it says it listens; None (one line: the tier is off, saves go to disk)
        when it exits or says nothing within READY_TIMEOUT."""
        # wait: bounded, said by StartingHolder.ready: the starting holder's 'ready' line: READY_TIMEOUT in all,
        # then the tier is off with one line
        trouble = _wait_ready(self.helper)
        if trouble:
            self.helper.stop(1.0)
            self.warn(f"the in-memory checkpoint tier is off: the checkpoint holder {trouble}; saves go to disk")
            return None
        directory = Path(self.checkpoint_dir) if self.checkpoint_dir else None
        return HolderProcess(self.helper, self.address, directory, self.events, self.warn)


def _wait_ready(helper: HelperProcess) -> str | None:
    """None once the starting holder says it listens; else what went wrong, as a clause."""
    stdout = helper.process.stdout
    assert stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT
    while (left := deadline - time.monotonic()) > 0:
        # wait: slice, said by StartingHolder.ready: the rest of READY_TIMEOUT (15 s) for the holder's next line;
        # start says why the tier is off if it ends so
        if not select.select([stdout], [], [], left)[0]:
            break
        line = stdout.readline()
        if not line:
            # wait: not_a_wait: the holder's stdout ended: it has exited, the wait only reads its exit code
            return f"(pid {helper.pid}) exited as it started (exit code {helper.process.wait()})"
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("ev") == "ready":
            return None
        if msg.get("ev") == "warn":
            return f"(pid {helper.pid}) could not start: {msg.get('line')}"
    return f"(pid {helper.pid}) did not start within {READY_TIMEOUT:g} s"
