"""A small gloo all_reduce for the SLURM job tests (imports torch: about 2 s of CPU per worker).

ddp.py                  every rank contributes its rank; all must see sum(range(world))
ddp.py fail-on-node2    on the first attempt (TORCHELASTIC_RESTART_COUNT=0) local rank 0 of
                        the second node (GROUP_RANK=1) exits 7 before importing torch
"""

import os
import socket
import sys

host = socket.gethostname()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"START rank={os.environ['RANK']} host={host} restart={restart}", flush=True)
if (
    sys.argv[1:] == ["fail-on-node2"]
    and os.environ["GROUP_RANK"] == "1"
    and os.environ["LOCAL_RANK"] == "0"
    and restart == 0
):
    print(f"rank {os.environ['RANK']} on {host}: failing on purpose (exit 7)", file=sys.stderr, flush=True)
    sys.exit(7)

import torch  # noqa: E402 - only the workers that get this far pay for it
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank)])
dist.all_reduce(value)
print(f"RESULT rank={rank} world={world} host={host} restart={restart} sum={value.item():g}", flush=True)
dist.destroy_process_group()
