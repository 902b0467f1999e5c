"""Reload from memory before the script asks: map the round's resume step while the script starts.

A restarted worker spends its first moments on things that do not need the checkpoint (imports,
CUDA and NCCL set-up, `init_process_group`, building the model), then calls
`job.load_latest()` and copies the state into its model. Reading a 400 MB copy out of shared
memory costs a plain copy (~20 ms here), plus the kernel's work of mapping its 100,000 pages into
the worker (~35 ms of page faults), plus `torch.load`'s unpickling (~7 ms) and the holder's
answer. The step to resume from is fixed before the worker starts (the agent opens the round with
it, see agent/checkpoint/slots.py), so all but the copy can be done early:

    bootstrap.run()   -> start()              # a thread: resume, torch.load(mmap=True), fault the pages in
    job.load_latest() -> take(map_location)   # (step, state) once, if prepared for the CPU; else None
    load_latest(into) -> take_slot(key, step) # a sharded job: this rank's copy, mapped
    job.save()        -> discard()            # a script that saves without loading lets go of it

so the call costs nothing but the copy into the model that follows it. The thread runs only on a
restart (`TORCHELASTIC_RESTART_COUNT` > 0) under the memory tier, and does more than a request
or two to the holder only when this node holds a copy to resume from; a fresh node or a first
start costs nothing.

A sharded job (`job.save` of DTensors) agrees on its step inside `load_latest` (every rank's
holdings are gathered, agent/checkpoint/sharded/storage.py), so the thread prepares what is likely:
it maps and faults in this rank's own newest copy, which `dcp_storage` takes
(`take_slot`) when the agreed step is that one.

The thread never imports a module the script may be importing at the same moment (two threads
importing one package's modules in different orders can deadlock, and it could be the script's
thread that fails): the sharded part needs no torch, the whole-state part waits until the
script's own `import torch` has finished.

Why the prepared answer stays right until the call: a worker belongs to one round, whose resume
step the holder never changes, and the `resume` request marks the slot reloaded, so it is never
written again (agent/checkpoint/slots.py): the mapping holds exactly that step until the worker
lets go of it. It is given once, and only to a `load_latest` that loads to the CPU (the default);
anything else, or any failure of the thread (e.g. a type the script allows with
`torch.serialization.add_safe_globals` only later), and `load_latest` takes its ordinary path,
which reports what is wrong. `RALLY_RESUME_PREFETCH=0` turns it off.

Faulting in: `madvise(MADV_POPULATE_READ)` over the mapping torch made (Linux 5.14+), else a
read of one byte per page. Both only map the holder's pages (reads of a private mapping share
them): no copy, no extra memory.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Any

from rally.agent.base import kept_threads, linux
from rally.agent.checkpoint.core import client, shm
from rally.agent.checkpoint.core.shm import fd_path, storages_of

PREFETCH_ENV = "RALLY_RESUME_PREFETCH"
PAGE = os.sysconf("SC_PAGE_SIZE")
JOIN_SECONDS = 5.0
"""How long `load_latest` waits for the thread (its work is one answer of the holder and ~50 ms per 400 MB)."""

_lock = threading.Lock()
_thread: kept_threads.Call | None = None  # the last start's call: join() and is_alive() as a thread's
# one kept thread for every re-entry's prefetch, not a new one per entry (agent/base/kept_threads.py)
_threads = kept_threads.Pool("rally-resume-prefetch")
_ready: tuple[int, Any] | None = None  # (the round's resume step, its state mapped from this node's copy)
_slot_ready: tuple[str, int, memoryview] | None = None  # (key, step, mapping) of this rank's sharded copy
_discarded = False
_generation = 0  # one per start: a thread of an earlier start (a re-entry's previous round) never lands


def start(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """Start preparing the resume step in the background when this worker may reload one; True if started."""
    if not environ.get(client.HOLDER_ENV) or environ.get(PREFETCH_ENV, "1") == "0":
        return False
    try:
        restarted = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        return False
    if not restarted:
        return False
    _launch()
    return True


def again(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """A re-entry in this process (`rally.job.run`, agent/worker_side/restartable.py): the agent
    opened the new round, its resume step fixed, before it said "enter", so the step is mapped
    while the process group forms rather than after. True if started."""
    if not environ.get(client.HOLDER_ENV) or environ.get(PREFETCH_ENV, "1") == "0":
        return False
    _launch()
    return True


def _launch() -> None:
    global _thread, _generation, _ready, _slot_ready, _discarded
    with _lock:
        _generation += 1
        _ready, _slot_ready, _discarded = None, None, False
        generation = _generation
    _thread = _threads.start(lambda: _prepare(generation))


def _prepare(generation: int) -> None:
    global _ready
    try:
        tier = client.tier()
        if tier is None:
            return
        step, fd = tier.resume(client.WHOLE_STATE_KEY)
        if fd is None:
            _prepare_sharded(tier, generation)
            return
        try:
            if step is None or not _torch_imported(client.REPLY_TIMEOUT):
                return
            import torch  # already imported by the script

            state = torch.load(fd_path(fd), map_location="cpu", weights_only=True, mmap=True)
        finally:
            os.close(fd)  # the mapping keeps the copy
        fault_in(storages_of(state))
        with _lock:
            if not _discarded and generation == _generation:
                _ready = (step, state)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # the node's copy is local rank 0's to save (job.save)
            tier.premap_wanted.add(client.WHOLE_STATE_KEY)  # mapped once training is back (its first save)
    except Exception:  # noqa: BLE001 - the script's own load_latest takes the ordinary path and says what is wrong
        return


def _torch_imported(timeout: float) -> bool:
    """Wait until the script's own import of torch has finished; False if it does not within
    `timeout`. This thread never imports it first: two threads importing one package's modules
    in different orders can deadlock, and the script's thread would be the one to fail."""
    deadline = time.monotonic() + timeout
    while True:
        module = sys.modules.get("torch")
        if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
            return True
        if time.monotonic() > deadline:
            return False
        # wait: background: the prefetch thread waiting for the script's own import of torch: 10 ms slices,
        # REPLY_TIMEOUT (60 s) in all; nobody waits on it (load_latest waits JOIN_SECONDS at most)
        time.sleep(0.01)


def _prepare_sharded(tier: client.MemoryTier, generation: int) -> None:
    """A sharded job (`job.save` of DTensors): map and fault in this rank's own newest copy.
    Which step the ranks resume from is decided in `load_latest` (agent/checkpoint/sharded/storage.py);
    it is the newest every rank holds, so this rank's newest is the likely one. Imports no torch."""
    global _slot_ready
    held = tier.held("dcp")
    key = shm.own_key(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    if not held.get(key):
        return
    step = max(held[key])
    view = tier.mapped_slot(key, step)
    if view is None:
        return
    populate(ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes)
    with _lock:
        if not _discarded and generation == _generation:
            _slot_ready = (key, step, view)
    tier.premap_wanted.add(key)  # mapped once training is back (its first save)


def fault_in(storages: list[Any]) -> None:
    """Map every page of `storages` into this process now (torch.load put them in one mapping)."""
    if not storages:
        return
    start = min(s.data_ptr() for s in storages)
    if populate(start, max(s.data_ptr() + s.nbytes() for s in storages) - start):
        return
    import torch  # an older kernel (EINVAL): read one byte of every page instead

    for storage in storages:
        torch.empty(0, dtype=torch.uint8).set_(storage)[::PAGE].max()


def populate(address: int, length: int) -> bool:
    """The pages of [address, address + length) mapped readable now (agent/base/linux.py's
    `populate`), shared with the holder's memfd (no copy even in a private mapping); False where
    the kernel has no such advice (before 5.14)."""
    return linux.populate(address, length, write=False)


def take(map_location: Any) -> tuple[int, Any] | None:
    """(the round's resume step, its state) if prepared and `map_location` is the CPU; else None
    (load it the ordinary way). Given once: a second `load_latest` loads anew."""
    global _ready
    if not _finished():
        return None
    with _lock:
        ready, _ready = _ready, None
    return ready if ready is not None and _on_cpu(map_location) else None


def take_slot(key: str, step: int) -> memoryview | None:
    """This rank's sharded copy of `step` under `key`, mapped and faulted in while the script
    started; None if another was prepared or none (map it then). Given once."""
    global _slot_ready
    if not _finished():
        return None
    with _lock:
        ready, _slot_ready = _slot_ready, None
    return ready[2] if ready is not None and ready[:2] == (key, step) else None


def _finished() -> bool:
    """Whether the thread ran and is done, waiting at most JOIN_SECONDS for it: it is mapping what
    the caller is about to load, so finishing it is the fastest way on. One still busy then (a
    holder slow to answer) is let go, and what it prepares later is dropped."""
    global _discarded
    thread = _thread
    if thread is None:
        return False
    # wait: short: JOIN_SECONDS (5 s) for the prefetch thread; then load_latest takes the ordinary path
    thread.join(JOIN_SECONDS)
    if thread.is_alive():
        with _lock:
            _discarded = True
        return False
    return True


def discard() -> None:
    """Let go of what was prepared for a reload the script did not make (it saves instead): a
    mapping would keep a replaced copy's memory alive."""
    global _ready, _slot_ready, _discarded
    with _lock:
        _ready, _slot_ready, _discarded = None, None, True


def _on_cpu(map_location: Any) -> bool:
    if map_location is None or map_location == "cpu":
        return True
    import torch

    return isinstance(map_location, torch.device) and map_location.type == "cpu"
