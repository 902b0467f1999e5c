"""What the agent and a worker inside `rally.job.run` say to each other, and where.

One Unix socket (abstract namespace, SOCK_SEQPACKET: one message per packet, no framing) that
the agent listens on; its name reaches the workers in RALLY_REENTRY_SOCKET, which is the same for
every worker of the node, so the worker template forks workers with it unchanged. A worker
connects when its script calls `rally.job.run`; the agent knows it by the kernel's peer
credentials (its pid), never by what it says. Each message is one JSON object with an `op`:

    worker -> agent   failed   an exception escaped the training function (rank, type, text, traceback)
                      parked   torch.distributed is torn down; waiting for the next round (ok, why)
                      returned the training function returned for good: `run` returns, the process
                               should end (agent/observe/exit_watch.py ends one that lingers)
    agent  -> worker  abort    leave the function now (the round is over)
                      enter    enter it again with this environment (the next round's)

Both ends import this module only; neither imports the other's room.
"""

from __future__ import annotations

import json
import signal
from typing import Any

SOCKET_ENV = "RALLY_REENTRY_SOCKET"
AGENT_PID_ENV = "RALLY_REENTRY_AGENT_PID"
SIGNAL_ENV = "RALLY_REENTRY_SIGNAL"
SPARE_ENV = "RALLY_REENTRY_SPARE"  # "1": a warm spare; its script's init_process_group waits for its rank

# The signal the worker's own control thread sends its main thread to leave the training
# function: its handler raises at the next bytecode, which also cuts a sleep or a select short
# (the handler's exception ends PEP 475's retry). Two above the stack-dump signal (spec.py).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 4

MAX_MESSAGE = 1 << 20  # a traceback of a deep recursion fits; anything longer is cut by the sender


def encode(op: str, **fields: object) -> bytes:
    data = json.dumps({"op": op, **fields}).encode()
    if len(data) > MAX_MESSAGE and "traceback" in fields:  # keep the end of a traceback: the raise is there
        fields["traceback"] = "...\n" + str(fields["traceback"])[-(MAX_MESSAGE // 2) :]
        data = json.dumps({"op": op, **fields}).encode()
    return data


def decode(data: bytes) -> dict[str, Any] | None:
    """The message, or None for one that is not ours (not JSON, not an object with a string `op`)."""
    try:
        message = json.loads(data)
    except ValueError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        return None
    return message


def address(name: str) -> bytes:
    """The abstract-namespace address of the socket called `name` (no file, gone with its owner)."""
    return b"\0" + name.encode()
