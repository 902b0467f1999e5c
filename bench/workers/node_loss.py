"""Node-loss benchmark worker: a gloo all_reduce every 50 ms, one JSON line per step to <out>
(wall time, world size, round, restart count, group rank, pid), so the bench sees when the
survivor trains again and whether a restart was spent."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
while True:
    dist.all_reduce(torch.ones(4))
    record = {
        "t": time.time(),
        "world": dist.get_world_size(),
        "round": int(os.environ["RALLY_ROUND"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "pid": os.getpid(),
    }
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    time.sleep(0.05)
