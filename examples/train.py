"""A small deterministic DDP training script that survives being killed: the demo and test workload.

A 2-layer MLP learns a synthetic regression (256 samples from a fixed seed) with Adam, on CPU
with gloo. It resumes from the newest checkpoint (``rally.job.load_latest``), saves model and
optimizer every ``--checkpoint-every`` steps, beats the hang-detection heartbeat every step, and
stops cleanly (after a checkpoint) when rally forwards a preemption signal.

Why it is bit-reproducible across kills: the model is initialised from a fixed seed, the batch of
step ``s`` is a pure function of ``s`` and the rank (no RNG state carried between steps), the
optimizer state is restored exactly from the checkpoint, and deterministic algorithms are on. So a
run killed at any step and restarted ends with the same bytes as an uninterrupted run at the same
world size; the last line prints their sha256 to make that easy to check.

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 examples/train.py \\
        --checkpoint-dir /tmp/ckpt --fail-at-step 17 --fail-rank 1 --out /tmp/final.pt
    (torch 2.13 needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun restarts with gloo)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rally import job

if TYPE_CHECKING:
    import torch

NUM_SAMPLES = 256
NUM_FEATURES = 8
HIDDEN = 32
BATCH_PER_RANK = 32
DATA_SEED = 1234
MODEL_SEED = 0
LEARNING_RATE = 1e-2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="train until this many optimizer steps (default 60)")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="save every K steps (default 5)")
    parser.add_argument(
        "--checkpoint-dir", type=Path, help=f"checkpoint directory (default: ${job.CHECKPOINT_DIR_ENV})"
    )
    parser.add_argument("--out", type=Path, help="rank 0 writes the final state_dict here")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step, to slow a demo down")
    parser.add_argument("--fail-at-step", type=int, help="SIGKILL one rank at this step, on the first attempt only")
    parser.add_argument("--fail-rank", type=int, default=0, help="the rank --fail-at-step kills (default 0)")
    args = parser.parse_args(argv)
    if args.checkpoint_dir is None and not os.environ.get(job.CHECKPOINT_DIR_ENV):
        parser.error(f"give --checkpoint-dir or set {job.CHECKPOINT_DIR_ENV}")
    if args.checkpoint_every < 1 or args.steps < 0:
        parser.error("--checkpoint-every must be >= 1 and --steps >= 0")
    return args


def make_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole synthetic data set, identical in every process and every attempt."""
    import torch

    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=gen)
    teacher = torch.randn(NUM_FEATURES, 1, generator=gen)
    y = torch.sin(x @ teacher) + 0.05 * torch.randn(NUM_SAMPLES, 1, generator=gen)
    return x, y


def batch_indices(step: int, rank: int) -> torch.Tensor:
    """Which samples rank ``rank`` trains on at ``step``: a pure function, so resuming needs no RNG state."""
    import torch

    order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(DATA_SEED + step))
    return order[(rank * BATCH_PER_RANK + torch.arange(BATCH_PER_RANK)) % NUM_SAMPLES]


def make_model() -> torch.nn.Module:
    import torch

    torch.manual_seed(MODEL_SEED)
    return torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def params_sha256(model: torch.nn.Module) -> str:
    """Hash of the concatenated parameter bytes: equal hashes mean bit-identical parameters."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(bytes(param.detach().clone().untyped_storage()))
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.checkpoint_dir is not None:
        os.environ[job.CHECKPOINT_DIR_ENV] = str(args.checkpoint_dir)  # the helper reads it from there

    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    distributed = "MASTER_ADDR" in os.environ  # under rally/torchrun; plain `python train.py` runs alone
    if distributed:
        dist.init_process_group("gloo")
    train(args, distributed)
    # Only now, after train() returned and freed DDP while the group was still registered. If DDP's
    # reducer dropped the last reference to the gloo group, its destructor would join gloo's worker
    # threads while holding the GIL, and a worker thread freeing a Python tensor needs the GIL:
    # the process hangs at exit (seen here about one run in eight with torch 2.13).
    if distributed:
        dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, distributed: bool) -> None:
    """Resume, train to ``args.steps``, checkpoint on the way; rank 0 reports the final parameters."""
    import torch
    import torch.nn.functional as F

    ctx = job.context()
    x, y = make_dataset()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    ckpt = job.load_latest()
    if ckpt is not None:
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model

    def checkpoint(step: int) -> None:
        job.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step)

    step = ckpt.step if ckpt is not None else 0
    while step < args.steps:
        step += 1
        if step == args.fail_at_step and ctx.rank == args.fail_rank and ctx.restart_count == 0:
            print(f"rank {ctx.rank}: killing myself at step {step} (--fail-at-step)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        idx = batch_indices(step, ctx.rank)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(net(x[idx]), y[idx])
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
        job.heartbeat(step)  # feeds --heartbeat-timeout and the step times (stragglers)
        if ctx.is_rank0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.checkpoint_every == 0:
            checkpoint(step)
        if preemption_agreed(distributed):
            if step % args.checkpoint_every != 0:
                checkpoint(step)
            if ctx.is_rank0:
                print(f"preempted at step {step}: checkpoint saved, exiting", flush=True)
            return
        if args.step_time:
            time.sleep(args.step_time)

    if ctx.is_rank0:
        if args.out is not None:
            torch.save(model.state_dict(), args.out)
        print(f"params sha256 {params_sha256(model)}", flush=True)


def preemption_agreed(distributed: bool) -> bool:
    """True on every rank once any rank was preempted, so all ranks stop at the same step.

    A forwarded signal reaches the ranks at slightly different moments; acting on the local flag
    alone could leave one rank waiting forever in the next collective.
    """
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if job.preempted() else 0])
    if distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


if __name__ == "__main__":
    sys.exit(main())
