"""The records the rendezvous keeps in the store, and the checks every one passes when read.

Store contents are untrusted: anyone who can reach the store can write any key (the job token,
rendezvous/base/token.py, rejects values this job did not sign, but a job without a token has only
these checks). Every record is parsed by `load`, which accepts exactly the fields of its class,
with the right types and in range; anything else is `UntrustedValue`, one line that names the
key. Nothing read from the store reaches a worker's environment unchecked: a wrong world size
or a worker pointed at another store is impossible by construction.
"""

from __future__ import annotations

import json
from collections.abc import Set as AbstractSet
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import TypeVar

from rally.rendezvous.base.kv import StoreTampered, UntrustedValue

T = TypeVar("T", bound="StoredRecord")


class EndKind(str, Enum):
    """Why a round ended. Its value is what the store holds (`<r>/end`, `job/closed`)."""

    WORKER_FAILED = "worker_failed"  # a worker exited non-zero (or was killed)
    WORKER_HUNG = "worker_hung"  # a worker stopped beating, printing or progressing
    NODE_LOST = "node_lost"  # a node's keep-alives stopped (died, cut off)
    NODE_LEFT = "node_left"  # a node was stopped by a signal and went away on purpose
    NODE_JOINED = "node_joined"  # a late node asked a round below MAX to re-form with it
    SUCCEEDED = "succeeded"  # every worker of every node exited 0
    ABORTED = "aborted"  # no restarts left, or a crash loop: the job is over
    PREEMPTED = "preempted"  # the scheduler's warning signal: checkpoint, stop, maybe requeue

    def __str__(self) -> str:  # messages and JSON show the stored value, never `EndKind.X`
        return self.value

    def __format__(self, spec: str) -> str:  # f"{kind}" and format specs apply to the value, as str's own
        return format(self.value, spec)


# Failures spend the restart budget; membership changes do not; final kinds end the job.
FAILURE_KINDS = frozenset({EndKind.WORKER_FAILED, EndKind.WORKER_HUNG})
MEMBERSHIP_KINDS = frozenset({EndKind.NODE_LOST, EndKind.NODE_LEFT, EndKind.NODE_JOINED})
FINAL_KINDS = frozenset({EndKind.SUCCEEDED, EndKind.ABORTED, EndKind.PREEMPTED})

# Sanity bounds for numbers read from the store (far above any real job).
MAX_NPROC = 4096
MAX_COUNT = 1 << 40
MAX_TEXT = 4096


def _bad(key: str, what: str, why: str) -> UntrustedValue:
    return UntrustedValue(
        f"store key '{key}' holds an invalid {what}: {why}; something other than this job's agents "
        "wrote to the rendezvous store (use a job token: RALLY_JOB_TOKEN)"
    )


def tampered(key: str, why: str) -> StoreTampered:
    """A record that must exist is gone: one line naming the key (never read as a zero)."""
    return StoreTampered(
        f"store key '{key}' is missing, but {why}: something deleted it from the rendezvous store "
        "(tampering); use a job token and a store only this job can reach"
    )


SHOWN_NAMES = 3
"""Field names a message shows at most: the line stays one bounded line, whatever the store held."""


def _some_names(names: AbstractSet[str]) -> str:
    shown = ", ".join(repr(n[:40]) for n in sorted(names)[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def _field_problem(unknown: AbstractSet[str], missing: AbstractSet[str]) -> str:
    """The unknown and the missing fields, a few names each: never every name a forger sent."""
    parts = [f"unknown field{'s' if len(unknown) > 1 else ''} {_some_names(unknown)}"] if unknown else []
    parts += [f"missing field{'s' if len(missing) > 1 else ''} {_some_names(missing)}"] if missing else []
    return "; ".join(parts)


def _shown(value: object) -> str:
    """A value for a message, bounded: a container by its kind (its repr may be huge or too deep)."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    return repr(value)[:60]


def _check_value(key: str, what: str, name: str, value: object, kind: str) -> None:
    """`kind`: "int", "int?", "str", "dict" — int means a non-negative int (never a bool)."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None and optional:
        return
    if base == "int":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
            raise _bad(key, what, f"{name} is {_shown(value)}, not a count in 0..{MAX_COUNT}")
    elif base == "str":
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise _bad(key, what, f"{name} is {_shown(value)}, not a string")
    elif base == "dict":
        if not isinstance(value, dict):
            raise _bad(key, what, f"{name} is {_shown(value)}, not an object")


_FIELD_NAMES: dict[type, tuple[frozenset[str], frozenset[str]]] = {}
_FIELD_KINDS: dict[type, dict[str, str]] = {}
# A field's annotation (as written: this module postpones annotations) -> the check its value gets.
# EndKind travels as its string value and is checked as a member by RoundEnd.check.
KIND_OF_ANNOTATION = {"int": "int", "int | None": "int?", "str": "str", "EndKind": "str", "dict": "dict"}


def _names(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """A record class's field names and the required ones, worked out once per class (the closer
    of 4,096 nodes loads and writes 8,192 records on the rendezvous' critical path)."""
    known = _FIELD_NAMES.get(cls)
    if known is None:
        every = fields(cls)
        required = frozenset(f.name for f in every if f.default is MISSING and f.default_factory is MISSING)
        known = _FIELD_NAMES[cls] = (frozenset(f.name for f in every), required)
    return known


def _kinds(cls: type) -> dict[str, str]:
    """Each field's check, read from its annotation once per class (no second list to keep)."""
    known = _FIELD_KINDS.get(cls)
    if known is None:
        known = _FIELD_KINDS[cls] = {f.name: KIND_OF_ANNOTATION[str(f.type)] for f in fields(cls)}
    return known


class StoredRecord:
    """A dataclass that travels through the store as JSON, checked field by field on the way in."""

    WHAT = "record"

    def to_json(self) -> str:
        # Fields are flat (no nested records): asdict's deep copy cost the closer of 1024 nodes 0.1 s.
        return json.dumps({name: getattr(self, name) for name in _names(type(self))[0]}, sort_keys=True)

    @classmethod
    def load(cls: type[T], raw: bytes | str, key: str) -> T:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _bad(key, cls.WHAT, f"{str(raw)[:40]!r} is not JSON") from None
        except RecursionError:  # a value nested deeper than the parser goes (a forger's, never ours)
            raise _bad(key, cls.WHAT, "nested too deeply to be one of rally's records") from None
        if not isinstance(data, dict):
            raise _bad(key, cls.WHAT, "not a JSON object")
        names, required = _names(cls)
        if set(data) - names or required - set(data):
            raise _bad(key, cls.WHAT, _field_problem(set(data) - names, required - set(data)))
        kinds = _kinds(cls)
        for name, value in data.items():
            _check_value(key, cls.WHAT, name, value, kinds[name])
        record = cls(**data)
        record.check(key)
        return record

    def check(self, key: str) -> None:
        """Cross-field checks (ranges that depend on other fields)."""


@dataclass(frozen=True)
class NodeInfo(StoredRecord):
    """What a node tells the round about itself."""

    WHAT = "node descriptor"

    node_id: str
    host: str
    addr: str
    nproc: int
    prev_rank: int | None = None
    preferred_rank: int | None = None
    checkpoint_step: int | None = None  # the newest step this node saved, memory or disk (crash loops)
    memory_steps: str = ""  # the steps its memory tier holds, "20,30" (agent/checkpoint/node_checkpoints.py)
    durable_step: int | None = None  # the newest intact checkpoint it sees on disk

    def held_in_memory(self) -> set[int]:
        return {int(s) for s in self.memory_steps.split(",") if s}

    def check(self, key: str) -> None:
        if self.memory_steps and not all(s.isascii() and s.isdigit() for s in self.memory_steps.split(",")):
            raise _bad(key, self.WHAT, f"memory_steps {self.memory_steps[:40]!r} is not a list of steps")
        if not 1 <= self.nproc <= MAX_NPROC:
            raise _bad(key, self.WHAT, f"nproc {self.nproc} is not in 1..{MAX_NPROC}")
        if not self.node_id or not self.addr:
            raise _bad(key, self.WHAT, "node_id and addr must not be empty")


@dataclass(frozen=True)
class Assignment(StoredRecord):
    """One node's place in a formed round: all it needs to start its workers."""

    WHAT = "assignment"

    round: int
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int
    restart_count: int
    membership_changes: int
    watch_rank: int | None
    watch_host: str
    master_host: str
    stalled_restarts: int = 0  # failures in a row after which no newer checkpoint appeared
    checkpoint_step: int | None = None
    node_id: str = ""  # the node it was made for: checked on read, so no node runs another's ranks
    resume_step: int | None = None  # the newest step every member can load, memory or disk

    def check(self, key: str) -> None:
        if not self.group_rank < self.group_world_size:
            raise _bad(
                key, self.WHAT, f"group_rank {self.group_rank} is not below group_world_size {self.group_world_size}"
            )
        if self.watch_rank is not None and not self.watch_rank < self.group_world_size:
            raise _bad(
                key, self.WHAT, f"watch_rank {self.watch_rank} is not below group_world_size {self.group_world_size}"
            )
        if not self.master_host:
            raise _bad(key, self.WHAT, "master_host is empty")

    def check_for(self, key: str, round_no: int, me: NodeInfo, max_nodes: int, members: int) -> Assignment:
        """Checks against what this node knows: its id, the round, its own size, the round's record."""
        if self.node_id != me.node_id:
            raise _bad(key, self.WHAT, f"it was made for node {self.node_id[:80]!r}, not this node ({me.node_id})")
        if self.round != round_no:
            raise _bad(key, self.WHAT, f"round {self.round} is not {round_no}")
        if not 1 <= self.group_world_size <= max_nodes or self.group_world_size != members:
            raise _bad(
                key,
                self.WHAT,
                f"group_world_size {self.group_world_size} is not the round's {members} nodes (at most {max_nodes})",
            )
        if self.rank_offset + me.nproc > self.world_size or self.world_size > self.group_world_size * MAX_NPROC:
            raise _bad(
                key,
                self.WHAT,
                f"ranks {self.rank_offset}..{self.rank_offset + me.nproc - 1} do not fit world_size {self.world_size}",
            )
        return self


@dataclass(frozen=True)
class RoundEnd(StoredRecord):
    """Why a round ended. `kind` decides what happens next; `detail` is for people."""

    WHAT = "round end"

    kind: EndKind
    detail: str
    node: str = ""
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EndKind) and self.kind in EndKind._value2member_map_:
            object.__setattr__(self, "kind", EndKind(self.kind))  # as read from the store

    def check(self, key: str) -> None:
        if not isinstance(self.kind, EndKind):
            raise _bad(key, self.WHAT, f"kind {self.kind!r} is not one of {sorted(k.value for k in EndKind)}")
        status = self.info.get("exit_status")
        if status is not None and (not isinstance(status, int) or isinstance(status, bool) or not 0 <= status <= 255):
            raise _bad(key, self.WHAT, f"exit_status {status!r} is not an exit code 0..255")

    @property
    def is_failure(self) -> bool:
        return self.kind in FAILURE_KINDS

    @property
    def is_membership_change(self) -> bool:
        return self.kind in MEMBERSHIP_KINDS


@dataclass(frozen=True)
class RoundRecord(StoredRecord):
    """The `<r>/closed` record: who is in round r and the job-wide counts entering it."""

    WHAT = "round record"

    members: int
    restart_count: int
    membership_changes: int
    stalled_restarts: int
    checkpoint_step: int | None
    attempt: int = 0  # which closer attempt wrote it: assignments live under assign/<attempt>/
    resume_step: int | None = None  # the newest step every member can load (membership.resume_step)

    def check_members(self, key: str, max_nodes: int) -> RoundRecord:
        if not 1 <= self.members <= max_nodes:
            raise _bad(key, self.WHAT, f"members {self.members} is not in 1..{max_nodes}")
        return self


@dataclass(frozen=True)
class SuccessRecord(StoredRecord):
    """`<r>/succeeded/<group_rank>`: that member's workers all exited 0. The round succeeds when
    every member has one (a counter would let anyone who reaches the store fake the job's end)."""

    WHAT = "success record"

    node_id: str
    group_rank: int

    def check_for(self, key: str, group_rank: int) -> SuccessRecord:
        if self.group_rank != group_rank:
            raise _bad(key, self.WHAT, f"group_rank {self.group_rank} is not {group_rank}")
        return self


@dataclass(frozen=True)
class BarrierMark(StoredRecord):
    """`<r>/preempt_done/<g>`, `<r>/acked/<g>`: member g did its part before a barrier opens (its
    workers checkpointed after a preemption signal; it read the job's end). A signed record per
    member, like success: a counter or a flag, which anyone who reaches the store can bump or set
    without the token, once opened the barrier for them (node 0 requeued while others still saved)."""

    WHAT = "barrier record"

    node_id: str
    group_rank: int

    def check_for(self, key: str, group_rank: int) -> BarrierMark:
        if self.group_rank != group_rank:
            raise _bad(key, self.WHAT, f"group_rank {self.group_rank} is not {group_rank}")
        return self


def parse_master(text: str, key: str, master_host: str) -> tuple[str, int]:
    """The workers' store address, which must be on the host the assignment named."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise _bad(key, "master address", f"{text[:60]!r} is not HOST:PORT")
    if host != master_host:
        raise _bad(key, "master address", f"host {host!r} is not node rank 0's address {master_host!r}")
    return host, int(port_text)
