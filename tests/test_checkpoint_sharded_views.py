"""The sharded fast path takes FSDP2's uneven shards (agent/checkpoint/sharded/layout.py).

``fully_shard`` keeps each parameter's shard in a storage padded to the largest rank's shard, so
the last rank's shard of an uneven dimension is a slice of it, and a rank may hold an empty
shard (a dimension smaller than the world). DCP copies such a tensor before it writes it. The
fast path must still take these states, and what it writes must be what DCP
itself writes for the same state, after the values changed since the layout was learnt (the
data file byte for byte; the metadata but for the id DCP gives every save).

The reload reads such files out of memory with one copy per shard
(agent/checkpoint/sharded/reader.py): it must load what DCP's own reader loads.

One real process (world size 1, gloo, a 1-rank mesh) runs DCP's own rank-local save and load and
rally's replay and reader side by side on the same states and prints what it found.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import clean_env

CHECK = r"""
import json, os, pickle, sys, warnings
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from rally.agent.checkpoint.sharded import layout as dcp_layout
from rally.agent.checkpoint.sharded import memory as dcp_memory
from rally.agent.checkpoint.core.layout import Recorder

warnings.simplefilter("ignore")
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
padded = torch.zeros(8, 5)  # FSDP2's padded storage: the shard is its first 7 rows
empty_padded = torch.zeros(4)
flat = torch.zeros(40)
state = {
    "uneven": DTensor.from_local(padded[:7], mesh, [Shard(0)], run_check=False, shape=(7, 5), stride=(5, 1)),
    "empty": DTensor.from_local(empty_padded[:0], mesh, [Shard(0)], run_check=False, shape=(0,), stride=(1,)),
    "offset": flat[10:25],  # a view that starts inside its storage
    "whole": torch.zeros(6),
    "step": torch.tensor(0.0),
    "meta": {"lr": 0.1},
}

def fill(value):
    padded.copy_(torch.arange(40.0).view(8, 5) + value)
    flat.copy_(torch.arange(40.0) * 2 + value)
    state["whole"].fill_(value)
    state["step"].fill_(value)

def recorded(meta):
    # What DCP's metadata says of the state (each save has its own save_id besides).
    found = pickle.loads(bytes(meta))
    return found.state_dict_metadata, found.storage_data, found.planner_data

fill(1.0)
sig, sources = dcp_layout.signature(state)
written, watched = dcp_layout.compacted(state, sources)
recorder = Recorder(watched)
meta, data = dcp_memory._rank_local_files(written, 0, recorder)
learnt = dcp_layout.learn(sig, recorder, meta, data.nbytes)
own_meta, _ = dcp_memory._rank_local_files(state, 0)  # DCP's own save of the state as it is
fill(7.0)  # a later step: same layout, new values
again = dcp_layout.signature(state)
replayed = bytearray(learnt.data.length) if learnt else bytearray()
if learnt:
    learnt.write_data(again[1], memoryview(replayed))
dcp_meta, dcp_data = dcp_memory._rank_local_files(state, 0)

# The reload's fast reader (agent/checkpoint/sharded/reader.py) against DCP's own, into fresh states.
def sharded(local, shape, stride):
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

def fresh():
    return {
        "uneven": sharded(torch.zeros(8, 5)[:7], (7, 5), (5, 1)),
        "empty": sharded(torch.zeros(4)[:0], (0,), (1,)),
        "offset": torch.zeros(40)[10:25], "whole": torch.zeros(6), "step": torch.tensor(-1.0), "meta": {"lr": 0.0},
    }

files = {".metadata": dcp_meta, dcp_memory.data_name(0): dcp_data}
fast, slow = fresh(), fresh()
reader = dcp_memory.MemoryReader(files, dcp_memory._MemoryFileSystem(files))
dcp.load(fast, storage_reader=reader, no_dist=True)
own = FileSystemReader("/rally-memory")
own.fs = dcp_memory._MemoryFileSystem(files)
dcp.load(slow, storage_reader=own, no_dist=True)
local = lambda t: t.to_local() if isinstance(t, DTensor) else t
loaded_alike = fast["meta"] == slow["meta"] == {"lr": 0.1} and all(
    torch.equal(local(fast[k]), local(slow[k])) and torch.equal(local(fast[k]), local(state[k]))
    for k in ("uneven", "empty", "offset", "whole", "step"))
print("RESULT " + json.dumps({
    "kinds": [dcp_layout._local_kind(t) for t in (padded[:7], empty_padded[:0], flat[10:25], state["whole"])],
    "sources": [type(s).__name__ for s in sources],
    "learnt": learnt is not None,
    "same_signature": again is not None and again[0] == sig,
    "meta_same_as_dcp": bool(learnt) and recorded(learnt.meta) == recorded(own_meta) == recorded(dcp_meta),
    "data_same_as_dcp": bytes(replayed) == bytes(dcp_data),
    "loaded_alike": loaded_alike,
    "viewed": reader.viewed,
}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_uneven_and_empty_shards_take_the_fast_path_and_write_what_dcp_writes(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "pg")], env=clean_env(), cwd=tmp_path,
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert found["kinds"] == ["view", "empty", "view", "whole"], found
    assert found["sources"] == ["Tensor", "Tensor", "UntypedStorage", "UntypedStorage"], found
    assert found["learnt"] and found["same_signature"], found  # eligible, and replayable at the next save
    assert found["meta_same_as_dcp"], found  # the compact copies changed nothing DCP records
    assert found["data_same_as_dcp"], found  # the replay wrote DCP's own bytes for the new values
    assert found["loaded_alike"], found  # the reload's reader loads what DCP's own loads
    assert found["viewed"] == 4, found  # every tensor with bytes read straight out of memory, one copy
