"""The checkpoint fast paths' torch internals behind one check (agent/checkpoint/core/torch_internals.py).

On this torch (one the fast paths were checked against) they are taken: a whole state's second
save replays its layout with the zip records' CRC left out, and a sharded reload reads tensors
straight out of memory. On a torch outside the checked range, or one that lacks an internal, the
same real round trips take torch's public way (torch.save every time with CRCs, DCP's own reader)
after one warning line, and load exactly what was saved. A real holder process and real slots for
the whole state; DCP's own rank-local save and load, in memory, for the sharded one.
"""

from __future__ import annotations

import io
import os
import re
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.core import overlap, torch_internals
from rally.agent.checkpoint.core.client import MemoryTier
from rally.agent.checkpoint.core.shm import fd_path
from rally.agent.checkpoint.node_checkpoints import HolderProcess

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[HolderProcess]:
    """A real holder (its memory is freed with it, as every test's end checks)."""
    tmp = tmp_path
    agent = HolderProcess.start(str(tmp / "ckpt"), EventLog(tmp / "events.jsonl"), print)
    assert isinstance(agent, HolderProcess)
    agent.open_round(0, None, 60.0)
    try:
        yield agent
    finally:
        agent.stop()


@pytest.fixture
def worker(holder: HolderProcess) -> Iterator[MemoryTier]:
    tier = MemoryTier(holder.address, 0)
    try:
        yield tier
    finally:
        tier.close()


@pytest.fixture(autouse=True)
def fresh_check() -> Iterator[None]:
    """The check is made once per process: each case makes it again, under its own torch."""
    torch_internals.fast_paths.cache_clear()
    torch_internals.sharded_reader.cache_clear()
    yield
    torch_internals.fast_paths.cache_clear()
    torch_internals.sharded_reader.cache_clear()


def unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_internals, "torch_version", lambda: "2.99.0+cpu")


def state_at(step: int) -> dict:
    import torch

    return {"w": torch.arange(1000.0) + step, "b": torch.full((7, 3), float(step)), "lr": 0.5, "name": "run"}


def whole_round_trip(worker: MemoryTier, key: str) -> tuple[dict, bytes]:
    """Save two steps of one layout through the holder; (step 2 loaded back, step 2's archive bytes)."""
    import torch

    for step in (1, 2):
        assert worker.save(state_at(step), key, step, persist=False, keep=2)
    found = worker.slot(key, 2)
    assert found is not None
    fd, length = found
    try:
        with open(fd_path(fd), "rb") as f:
            archive = f.read(length)
        return torch.load(fd_path(fd), weights_only=True), archive
    finally:
        os.close(fd)


def records_with_bad_crc(archive: bytes) -> str | None:
    """zipfile's CRC check of every record: the first whose CRC does not match, else None."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return z.testzip()


def sharded_round_trip() -> tuple[dict, int]:
    """DCP's own rank-local save of a state into memory, loaded back by rally's memory reader;
    (what it loaded, how many tensors it read straight out of memory)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rally.agent.checkpoint.sharded import memory as dcp_memory

    meta, data = dcp_memory._rank_local_files(state_at(3), 0)
    files = {".metadata": meta, dcp_memory.data_name(0): data}
    into = {"w": torch.zeros(1000), "b": torch.zeros(7, 3), "lr": 0.0, "name": ""}
    reader = dcp_memory.MemoryReader(files, dcp_memory._MemoryFileSystem(files))
    dcp.load(into, storage_reader=reader, no_dist=True)
    return into, reader.viewed


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.mark.timeout(120)
def test_this_torch_takes_the_fast_paths(worker: MemoryTier, capfd: pytest.CaptureFixture[str]) -> None:
    assert torch_internals.fast_paths()
    assert overlap.enabled()  # saves overlap the next step (their check reads torch's in-place counter)
    back, archive = whole_round_trip(worker, "fast")
    assert_same(back, state_at(2))
    assert "fast" in worker._layouts  # learnt at step 1, replayed at step 2
    assert records_with_bad_crc(archive) is not None  # the records' CRC left out: no second pass
    loaded, viewed = sharded_round_trip()
    assert_same(loaded, state_at(3))
    assert viewed == 2  # both tensors read straight out of memory
    assert "rally: warning" not in capfd.readouterr().err


@pytest.mark.timeout(120)
def test_an_unchecked_torch_takes_the_public_path_after_one_warning(
    worker: MemoryTier, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from rally.agent.checkpoint.sharded import layout as dcp_layout

    unsupported(monkeypatch)
    back, archive = whole_round_trip(worker, "public")
    assert_same(back, state_at(2))
    assert "public" not in worker._layouts  # torch.save at every save: nothing learnt, nothing replayed
    assert records_with_bad_crc(archive) is None  # torch.save's own CRCs, the flag untouched
    loaded, viewed = sharded_round_trip()
    assert_same(loaded, state_at(3))
    assert viewed == 0  # every tensor DCP's own way
    assert dcp_layout.signature(state_at(4)) is None  # the sharded save's replay is off too
    assert not overlap.enabled()  # saves copy before they return: no check by torch's in-place counter
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("rally: warning")]
    assert len(warnings) == 1, warnings
    assert "torch 2.99.0+cpu is not one rally's checkpoint fast paths were checked against" in warnings[0]
    assert "public, slower path" in warnings[0]


@pytest.mark.timeout(120)
def test_a_missing_internal_takes_the_public_path_and_is_named(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._shard._utils", None)  # a torch without that module
    loaded, viewed = sharded_round_trip()
    assert_same(loaded, state_at(3))
    assert viewed == 0
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("rally: warning")]
    assert len(warnings) == 1 and "has no torch.distributed._shard._utils.narrow_tensor_by_index" in warnings[0], (
        warnings
    )


@pytest.mark.timeout(30)
def test_the_checked_range_is_the_torch_matrixs() -> None:
    """Raising .ci/torch-matrix's NEWEST means running the fast paths' tests on it: the range here follows."""
    import torch

    script = (REPO / ".ci/torch-matrix").read_text()
    oldest, newest = (re.search(rf"^{name}=(\S+)", script, re.M).group(1) for name in ("OLDEST", "NEWEST"))  # type: ignore[union-attr]
    minor = lambda version: tuple(int(x) for x in version.split(".")[:2])  # noqa: E731
    assert (torch_internals.OLDEST, torch_internals.NEWEST) == (minor(oldest), minor(newest))
    assert {oldest, newest, torch.__version__.split("+")[0]} <= set(torch_internals.CHECKED)
