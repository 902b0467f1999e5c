"""The shape of a node's status record (agent/observe/status_record.py writes it), checked on read.

Anyone who reaches a store without a job token can write `status/node/<id>`, and `rally status`
shows what it reads there: so every field is checked against the type its writer gives it
before anything formats it. A field of the wrong type (a string where a number goes, a list
where a record goes, a number too large for a float) reads as absent and is shown as `-`; a
worker entry that is not a record is left out; fields no writer makes are dropped; text is cut
at MAX_TEXT characters and lists at MAX_ITEMS entries. What comes out is made of dicts, lists,
bounded text and finite numbers only, so no formatting of it can raise. (Text still needs
`agent/display/untrusted_text.printable` before it reaches a terminal.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A record larger than this is not parsed (a real one of 72 workers is ~30 KB).
MAX_RECORD_BYTES = 1 << 20
MAX_TEXT = 1000
MAX_ITEMS = 1024
# The largest magnitude a number may have: past 2**63 it is no counter, step or byte count of a
# real job, and int / float formatting of it may overflow.
MAX_MAGNITUDE = float(1 << 63)


class Text:
    """A string, cut at MAX_TEXT characters."""


class Whole:
    """An int (not a bool) of at most MAX_MAGNITUDE."""


class Number:
    """An int or a finite float (not a bool) of at most MAX_MAGNITUDE."""


@dataclass(frozen=True)
class ListOf:
    """A list of `item`s (each checked; those that fail are left out), at most MAX_ITEMS."""

    item: Shape


# What a value must look like: one of the kinds above, a ListOf, or a nested Schema.
Shape = type[Text] | type[Whole] | type[Number] | ListOf | dict[str, "Shape"]
Schema = dict[str, Shape]  # field name -> its Shape

STRAGGLER: Schema = {"step_time": Number, "median": Number, "scope": Text}
WORKER: Schema = {
    "rank": Whole,
    "local_rank": Whole,
    "pid": Whole,
    "state": Text,
    "cpu": Number,
    "cpu_seconds": Number,
    "rss": Number,
    "gpu_memory": Number,
    "heartbeat_age": Number,
    "step": Whole,
    "step_time": Number,
    "straggler": STRAGGLER,
    "section": Text,
    "gpu_utilization": Number,
}
LAST_RESTART: Schema = {"round": Whole, "kind": Text, "detail": Text, "recovery": Text}
NODE_PREFLIGHT: Schema = {  # agent/checks/preflight.py: this node's numbers of the last check
    "round": Whole,
    "seconds": Number,
    "compute": Number,
    "link": Number,
    "allreduce": Number,
    "bad": Text,
    "left_out": ListOf(Text),
}
NODE: Schema = {
    "host": Text,
    "node_id": Text,
    "group_rank": Whole,
    "round": Whole,
    "restart_count": Whole,
    "in_process_restarts": Whole,  # of restart_count, those this node made by re-entering (rally.job.run)
    "world_size": Whole,
    "group_world_size": Whole,
    "updated": Number,
    "workers": ListOf(WORKER),
    "gpu_problems": ListOf(Text),
    "gpu_problems_total": Whole,
    "last_restart": LAST_RESTART,
    "preflight": NODE_PREFLIGHT,
    "checkpoint_saved_step": Whole,
    "checkpoint_durable_step": Whole,
    "waiting": Text,
    "hang": {"rank": Whole, "host": Text, "detail": Text, "time": Number},  # agent/observe/hang_watch.py
}
# The job's last pre-flight verdict (rendezvous/status/job_notes.py), as far as `rally status` shows it.
VERDICT: Schema = {"round": Whole, "summary": Text, "nodes": ListOf({"host": Text, "line": Text})}


def checked(value: object, kind: Shape) -> Any:
    """`value` if it has the shape `kind` (cleaned: see the module docstring), else None."""
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return None
        fields = {name: checked(value[name], field) for name, field in kind.items() if name in value}
        # A null stays null (writers write them); a value of the wrong type is dropped (absent).
        return {name: v for name, v in fields.items() if v is not None or value[name] is None}
    if isinstance(kind, ListOf):
        if not isinstance(value, list):
            return None
        items = (checked(item, kind.item) for item in value[:MAX_ITEMS])
        return [item for item in items if item is not None]
    if kind is Text:
        return value[:MAX_TEXT] if isinstance(value, str) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or kind not in (Whole, Number):
        return None
    if kind is Whole and not isinstance(value, int):
        return None
    return value if abs(value) <= MAX_MAGNITUDE else None  # NaN and infinities compare False


def checked_node(record: object) -> dict | None:
    """A node's status record as `rally status` may show it, or None when it is none (not an
    object, or without a list of workers)."""
    if not isinstance(record, dict) or not isinstance(record.get("workers"), list):
        return None
    return checked(record, NODE)
