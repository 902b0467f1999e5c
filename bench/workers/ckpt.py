"""The checkpoint benchmark's worker (bench/checkpoint.py): save a state while stepping, die, reload it.

    <launcher> --nproc-per-node 2 bench/workers/ckpt.py --method rally --dir D --mb 400 --out R.json

Every rank holds the same state (DDP's case): ``--mb`` MB of float32 in 100 tensors, the
parameters of an optimizer whose step overwrites every one in place (an optimizer step's memory
traffic). Attempt 0 measures, on rank 0, a plain copy of the state into preallocated tensors
(``copy_``, warm), then ``--saves`` saves, one per "step": a barrier, the save, then the next
step: ``--compute`` seconds of matrix products on every rank (its forward and backward), the
optimizer's step, and sleep until ``--gap`` seconds after the save. The **stall** of a save is
the time from the call to its return, plus, for rally's overlapped saves, the time the next
optimizer step's fence waited for the copy (agent/checkpoint/core/overlap.py). Then rank 1 SIGKILLs
itself, the launcher restarts both workers, and attempt 1 measures the reload: the time to get
the newest state back into the model's tensors (load + ``copy_``, or DCP's in-place load), and
checks its values are those of the last step saved. Rank 0 writes its figures to ``--out``.

Methods: ``torch_save`` (rank 0, torch.save to a file), ``dcp_async`` (every rank,
torch.distributed.checkpoint.async_save; durable when its future resolves), ``rally``
(rally.job.save/load_latest, the memory tier, overlapped), ``rally_sync`` (the same with
RALLY_CKPT_OVERLAP=0: the whole copy before save returns), ``rally_disk`` (the tier
off), ``dlrover`` (DLRover's DdpCheckpointer,
StorageType.DISK: shared memory, persisted by its agent; run under dlrover-run).

Sharded methods (FSDP's case): every rank holds ``--mb`` MB of its own shards, the state being
DTensors (``Shard(0)`` over the 2 ranks' gloo mesh, made with ``DTensor.from_local``), and every
rank saves: ``rally_sharded`` (rally.job.save: DCP into the memory tier, persisted in the
background), ``dcp_async_sharded`` (DCP async_save) and ``dcp_save_sharded`` (DCP's synchronous
save). The plain copy is a copy of the rank's local shards; the reload loads in place.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

TENSORS = 100


def make_state(mb: int, step: int) -> dict[str, torch.Tensor]:
    n = mb * 1_000_000 // 4 // TENSORS
    return {f"p{i}": torch.full((n,), float(step * 1000 + i)) for i in range(TENSORS)}


def sharded_state(mb: int, step: int) -> dict[str, torch.Tensor]:
    """The same tensors as this rank's shards of DTensors twice their size (rank r holds rows r)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in make_state(mb, step).items()}


def local(v: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return v.to_local() if hasattr(v, "to_local") else v


class Overwrite(torch.optim.Optimizer):
    """An optimizer whose step writes ``value`` into every parameter in place: an optimizer step's
    memory traffic, and the values the reload checks."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})
        self.value = 0.0

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.fill_(self.value)


def compute(seconds: float) -> None:
    """The next step's forward and backward: matrix products for ``seconds`` (one thread)."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, b)


def fence_seconds() -> float:
    """How long rally's fences have waited for overlapped copies in this process."""
    from rally.agent.checkpoint.core.overlap import overlap

    return overlap.fence_seconds


def skipped_saves() -> int:
    """rally's overlapped saves skipped so far (the holder's other copy was being persisted)."""
    from rally.agent.checkpoint.core.overlap import overlap

    return overlap.skipped


def plain_copy_seconds(state: dict[str, torch.Tensor]) -> float:
    state = {k: local(v) for k, v in state.items()}
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # warm: the first touch of the buffers is not a copy


class Method:
    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.dir = name, directory
        self.pending = None  # DCP's future of the last save
        self.sharded = name.endswith("_sharded")
        # Imported here, as a script imports at its top: not inside the timed save or reload.
        if name.startswith("rally"):
            from rally import job

            self.job = job
        if name.startswith("dcp"):
            import torch.distributed.checkpoint as dcp

            self.dcp = dcp
        if name.startswith("dcp_async"):  # its background collectives need a group of their own (DCP's docs)
            self.group = dist.new_group(backend="gloo")
        if name == "dlrover":
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

            self.dl = DdpCheckpointer(str(directory))

    def save(self, state: dict, step: int) -> bool:
        """Save ``step``; False when the method dropped it (DLRover skips a save while it persists)."""
        if self.name == "torch_save":
            if dist.get_rank() == 0:
                torch.save(state, self.dir / f"{step}.pt")
        elif self.name.startswith("dcp_async"):
            if self.pending is not None:
                self.pending.result()  # DCP allows one save in flight
            self.pending = self.dcp.async_save(
                state, checkpoint_id=str(self.dir / f"dcp_{step}"), process_group=self.group
            )
        elif self.name == "dcp_save_sharded":
            self.dcp.save(state, checkpoint_id=str(self.dir / f"dcp_{step}"))
        elif self.name.startswith("rally"):
            self.job.save(state, step)
        elif self.name == "dlrover":
            from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType

            self.dl.save_checkpoint(step, state, str(self.dir / f"{step}.pt"), storage_type=StorageType.DISK)
            return self.dl._engine._cached_step == step  # what it sets once the copy is made
        return True

    def durable(self, step: int) -> bool:
        if self.name in ("torch_save", "dcp_save_sharded"):
            return True
        if self.name.startswith("dcp_async"):
            return self.pending is not None and self.pending.done()
        if self.name == "rally_sharded":
            from rally.agent.checkpoint.sharded import files as dcp_files

            return dcp_files.is_intact(self.dir / dcp_files.step_name(step))
        if self.name.startswith("rally"):
            return step in self.job.durable_steps()
        return (self.dir / f"{step}.pt").exists()

    def load_into(self, model: dict[str, torch.Tensor], step: int) -> str:
        """Load the newest checkpoint into ``model``; return where it came from."""
        if self.name == "torch_save":
            state = torch.load(self.dir / f"{step}.pt", weights_only=True)
            source = "disk"
        elif self.name.startswith("dcp_"):
            self.dcp.load(model, checkpoint_id=str(self.dir / f"dcp_{step}"))
            return "disk"
        elif self.name == "rally_sharded":
            ckpt = self.job.load_latest(into=model)
            assert ckpt is not None and ckpt.step == step, ckpt
            return ckpt.source
        elif self.name.startswith("rally"):
            ckpt = self.job.load_latest()
            assert ckpt is not None and ckpt.step == step, ckpt
            state, source = ckpt.state, ckpt.source
        else:
            state = self.dl.load_checkpoint()
            source = "memory" if state else "none"
        for k, v in model.items():
            v.copy_(state[k])
        return source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--gap", type=float, default=1.5)
    parser.add_argument("--compute", type=float, default=0.1, help="seconds of the next step's compute")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    method = Method(args.method, args.dir)
    last = args.saves
    build = sharded_state if method.sharded else make_state
    if attempt == 0:
        state = build(args.mb, 0)
        copy = plain_copy_seconds(state)
        stalls, durable_after, dropped, fences = [], [], [], []
        optimizer = None
        if not method.sharded:  # the state is the parameters of an optimizer, saved as a state_dict's detached views
            params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in state.items()}
            state = {k: p.detach() for k, p in params.items()}
            optimizer = Overwrite(list(params.values()))
        for step in range(1, args.saves + 1):
            if optimizer is None:
                for v in state.values():
                    local(v).fill_(float(step))  # the "training step" of the sharded state
            elif step == 1:
                optimizer.value = 1.0
                optimizer.step()
            dist.barrier()
            start = time.perf_counter()
            if not method.save(state, step):
                dropped.append(step)
            stalls.append(time.perf_counter() - start)
            compute(args.compute)  # the next step: its forward and backward, then its optimizer step
            if optimizer is not None:
                rally = method.name.startswith("rally")
                waited, skipped = (fence_seconds(), skipped_saves()) if rally else (0.0, 0)
                optimizer.value = float(step + 1)
                optimizer.step()  # rally's fence settles the save: its wait counts in the stall
                if rally:
                    fences.append(fence_seconds() - waited)
                    stalls[-1] += fences[-1]
                    if skipped_saves() > skipped:
                        dropped.append(step)
            deadline = start + args.gap
            while not method.durable(step) and time.perf_counter() < deadline:
                time.sleep(0.005)
            durable_after.append(time.perf_counter() - start if method.durable(step) else None)
            time.sleep(max(0.0, deadline - time.perf_counter()))
        if method.pending is not None:
            method.pending.result()
        if rank == 0:
            args.out.write_text(
                json.dumps(
                    {
                        "copy": copy,
                        "stalls": stalls,
                        "fences": fences,
                        "durable_after": durable_after,
                        "dropped": dropped,
                    }
                )
            )
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the launcher stops us once rank 1 is gone
        return
    model = build(args.mb, -1)
    result = json.loads(args.out.read_text()) if rank == 0 else {}
    last = max(set(range(1, args.saves + 1)) - set(result.get("dropped", [])), default=last)
    dist.broadcast_object_list(box := [last], src=0)
    last = box[0]
    dist.barrier()
    start = time.perf_counter()
    source = method.load_into(model, last)
    reload = time.perf_counter() - start
    assert local(model["p0"])[0].item() == last and local(model["p5"])[7].item() == float(last), "wrong state reloaded"
    if rank == 0:
        args.out.write_text(json.dumps({**result, "reload": reload, "reload_source": source}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
