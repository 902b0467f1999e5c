"""Saving at the breakpoint for sharded jobs: the newest in-memory DCP step made durable when the job ends.

When a job fails for good or is stopped, its workers are gone, and with them the threads that
write their shards to disk (agent/checkpoint/sharded/persist.py): the newest steps may exist only in
the holders' memory. Each node's agent then runs this helper, bounded by the grace period:

    python <rally>/agent/checkpoint/sharded/flush.py CKPT_DIR SECONDS
        (RALLY_CKPT_HOLDER, RALLY_CKPT_HOLDER_PID, RALLY_CKPT_SECRET, RALLY_ROUND, TORCHELASTIC_RUN_ID set)

It reads the sharded copies its node's holder keeps (own and replica, agent/checkpoint/sharded/memory.py)
of every step newer than the newest durable one, and writes each rank's part exactly as that rank's
persister thread would have: into the step's temporary directory of the job's last round, the
same name on every node. The node that holds rank 0's copy then waits for every rank's part
(written by the other nodes' helpers, or by the ranks themselves before they stopped) and
publishes the newest step that is complete, with DCP's merged metadata: the same directory a
synchronous save publishes. A step whose parts never all arrive stays unpublished; the previous
durable step is untouched.

Why a process of its own: publishing reads DCP's metadata, which needs torch; neither the
agent nor the holder imports torch. The helper imports it only to publish. It talks only to the
holder its agent started (agent/checkpoint/core/client.py checks the peer's pid and uid), and reads
the ranks' metadata with a restricted unpickler (agent/checkpoint/sharded/metadata.py): no class
outside DCP's metadata is ever built from those bytes.

Prints one JSON line: `{"step": N, "path": P}` when it published, `{"written": [...]}` when it
only wrote parts, `{"warn": line}` when it could not.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

from rally.agent.checkpoint.core.client import CheckpointRefused, HolderAddress, MemoryTier
from rally.agent.checkpoint.core.held_dir import shown
from rally.agent.checkpoint.sharded import files as dcp_files

WAIT_NEWEST_SHARE = 0.6
"""Of the time allowed, the share spent waiting for the newest step's parts before an older
complete step is published instead."""


def held_steps(tier: MemoryTier, durable: int | None) -> dict[tuple[int, int], dict[int, str]]:
    """{(step, world): {rank: the key of a copy on this node}} for steps newer than `durable`;
    a rank's own copy is preferred to a replica of it."""
    found: dict[tuple[int, int], dict[int, str]] = {}
    for key, steps in sorted(tier.held("dcp").items(), key=lambda kv: kv[0].startswith("dcpr")):
        match = dcp_files.KEY_RE.match(key)
        if not match:
            continue
        rank, world = int(match.group(2)), int(match.group(3))
        for step in steps:
            if durable is None or step > durable:
                found.setdefault((step, world), {}).setdefault(rank, key)
    return found


def write_parts(tier: MemoryTier, directory: Path, step: int, world: int, keys: dict[int, str]) -> list[int]:
    """Write this node's parts of `step` into its temporary directory; the ranks written."""
    from rally.agent.checkpoint.core import auth
    from rally.agent.checkpoint.sharded.persist import temp_name, write_file

    temp = directory / temp_name(step)
    auth.make_private_dir(directory)
    auth.private_subdir(temp)  # 0700, exclusively or ours already: never a link, never another user's
    written = []
    for rank, key in sorted(keys.items()):
        found = tier.slot(key, step)
        if found is None:
            continue
        fd, length = found
        try:
            with mmap.mmap(fd, length, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as blob:
                magic, meta_len, old_world, old_rank = dcp_files.SLOT_HEADER.unpack_from(blob, 0)
                if magic != dcp_files.SLOT_MAGIC or (old_world, old_rank) != (world, rank):
                    continue
                start = dcp_files.SLOT_HEADER.size
                with blob[start : start + meta_len] as meta, blob[start + meta_len :] as data:
                    files = {f"__{rank}_0.distcp": write_file(temp / f"__{rank}_0.distcp", data)}
                    files[f"__{rank}.metadata"] = write_file(temp / f"__{rank}.metadata", meta)
        finally:
            os.close(fd)
        write_file(temp / f"__{rank}.rally.json", json.dumps(files).encode())
        written.append(rank)
    return written


def complete(temp: Path, world: int) -> dict[int, dict[str, list[Any]]] | None:
    """Every rank's marker of a step's temporary directory, or None while one is missing."""
    parts = {}
    for rank in range(world):
        try:
            fd = os.open(temp / f"__{rank}.rally.json", os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as handle:
                parts[rank] = json.loads(handle.read())
        except (OSError, ValueError):
            return None
    return parts


def publish_newest(
    directory: Path, candidates: list[tuple[int, int]], keep: int, seconds: float
) -> tuple[int, Path] | None:
    """Publish the newest of `candidates` (step, world) whose parts are all there, waiting for
    the newest at most WAIT_NEWEST_SHARE of `seconds` and for any at most `seconds`."""
    from rally.agent.checkpoint.sharded.persist import POLL_INTERVAL, lock_dir, publish, temp_name

    start = time.monotonic()
    newest = max(step for step, _ in candidates)
    while True:
        waited = time.monotonic() - start
        for step, world in sorted(candidates, reverse=True):
            if (directory / dcp_files.step_name(step)).exists():
                return None  # published already (a worker, or the replica's node)
            temp = directory / temp_name(step)
            parts = complete(temp, world)
            if parts is None or (step != newest and waited < WAIT_NEWEST_SHARE * seconds):
                continue
            try:
                lock = lock_dir(temp)
            except FileNotFoundError:  # another node's helper published it meanwhile
                continue
            try:
                if lock is None or (directory / dcp_files.step_name(step)).exists() or not temp.exists():
                    return None
                publish(directory, temp, step, keep, world, parts)
            finally:
                if lock is not None:
                    os.close(lock)
            return step, directory / dcp_files.step_name(step)
        if waited > seconds:
            return None
        # wait: short: POLL_INTERVAL (20 ms) between looks, the time given in all
        time.sleep(POLL_INTERVAL)


def flush(holder: HolderAddress, directory: Path, seconds: float, keep: int) -> dict[str, Any]:
    tier = MemoryTier(holder, -1)  # reads only: no round needed
    try:
        held = held_steps(tier, dcp_files.newest_intact_step(directory))
        if not held:
            return {"written": []}
        written = {step: write_parts(tier, directory, step, world, keys) for (step, world), keys in held.items()}
    finally:
        tier.close()
    publishers = [(step, world) for (step, world), keys in held.items() if 0 in keys]
    if not publishers:
        return {"written": sorted(s for s, ranks in written.items() if ranks)}
    done = publish_newest(directory, publishers, keep, seconds)
    if done is not None:
        return {"step": done[0], "path": str(done[1])}
    newest = max(step for step, _ in publishers)
    if dcp_files.is_intact(directory / dcp_files.step_name(newest)):
        return {"written": sorted(written)}  # published by another node's helper
    return {
        "warn": f"sharded checkpoint step {newest} stays in memory only: "
        f"not every rank's part reached {shown(directory)} within {seconds:.0f} s"
    }


def main(argv: list[str]) -> int:
    directory, seconds = Path(argv[0]), float(argv[1])
    keep = int(os.environ.get("RALLY_CHECKPOINT_KEEP", "3") or 3)
    try:
        holder = HolderAddress.from_env()
        if holder is None:
            raise CheckpointRefused("no checkpoint holder in the environment")
        result = flush(holder, directory, seconds, max(keep, 1))
    except Exception as exc:  # one line for the agent to print, never a traceback at the job's end
        result = {
            "warn": f"the newest sharded checkpoint in memory could not be written to {shown(directory)}: "
            f"{type(exc).__name__}: {exc}"
        }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
