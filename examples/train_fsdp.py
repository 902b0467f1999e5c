"""A small deterministic FSDP2 training script that checkpoints only through rally.job: the sharded workload.

A 3-layer MLP, sharded with ``fully_shard`` over every rank (gloo, CPU), learns a synthetic
regression with Adam. ``job.load_latest(into=state)`` fills the freshly sharded model's and
optimizer's state (torch.distributed.checkpoint underneath, resharded when the world size
changed) and ``job.save(state, step)`` writes each rank's shards. Nothing else touches the disk.

Why it is bit-reproducible at a fixed world size: the model is initialised from a fixed seed, the
global batch of step ``s`` is a pure function of ``s`` (each rank takes its equal slice), the
optimizer state is restored exactly, deterministic algorithms are on and each rank uses one
intra-op thread (however many workers share its node). At every checkpoint and
after a resume every rank prints the sha256 of the full (unsharded) model and optimizer state, so a
test can compare a resumed job, on any world size, with an uninterrupted one.

    rally --standalone --nproc-per-node 2 --max-restarts 1 --checkpoint-dir /tmp/ckpt \\
        examples/train_fsdp.py --steps 20 --fail-at-step 7 --fail-rank 1
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rally import job

NUM_FEATURES, HIDDEN = 8, 24
GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks
DATA_SEED, MODEL_SEED = 1234, 0
LEARNING_RATE = 1e-2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="train until this step (default 20)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="save every K steps (default 2)")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--fail-at-step", type=int, help="SIGKILL one rank at this step, on the first attempt only")
    parser.add_argument("--fail-rank", type=int, default=0, help="the rank --fail-at-step kills (default 0)")
    return parser.parse_args()


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(MODEL_SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(DATA_SEED + step)
    x = torch.randn(GLOBAL_BATCH, NUM_FEATURES, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    share = GLOBAL_BATCH // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def digest(state: Any) -> str:
    """sha256 of the full state: DTensors gathered (a collective), keys in sorted order."""
    sha = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                feed(f"{prefix}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                feed(f"{prefix}/{i}", item)
        elif isinstance(value, torch.Tensor):
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            sha.update(prefix.encode())
            sha.update(tensor.detach().contiguous().cpu().numpy().tobytes())
        else:
            sha.update(f"{prefix}={value!r}".encode())

    feed("", state)
    return sha.hexdigest()


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # a CPU matmul's sums depend on its thread count: one, on any launcher and node layout
    dist.init_process_group("gloo")
    ctx = job.context()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)

    model_state, optim_state = get_state_dict(model, opt)
    ckpt = job.load_latest(into={"model": model_state, "optim": optim_state})
    start = 0
    if ckpt is not None:
        set_state_dict(model, opt, model_state_dict=ckpt.state["model"], optim_state_dict=ckpt.state["optim"])
        start = ckpt.step
    model_state, optim_state = get_state_dict(model, opt)
    print(f"start step {start} world {world} digest {digest({'model': model_state, 'optim': optim_state})}", flush=True)

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        job.heartbeat(step)
        if args.step_time:
            time.sleep(args.step_time)
        if step == args.fail_at_step and rank == args.fail_rank and ctx.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.checkpoint_every == 0:
            model_state, optim_state = get_state_dict(model, opt)
            state = {"model": model_state, "optim": optim_state}
            job.save(state, step)
            print(f"saved step {step} world {world} digest {digest(state)}", flush=True)
    model_state, optim_state = get_state_dict(model, opt)
    print(
        f"final step {args.steps} world {world} digest {digest({'model': model_state, 'optim': optim_state})}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
