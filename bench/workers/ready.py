"""Launch benchmark worker: import torch, init gloo, one all_reduce, then record the times.

Writes <out>/ready.<rank>.json with time.time() at the script's first line (`start`), after
`import torch` (`imported`) and after the all_reduce returned (`ready`).
"""

import json
import os
import sys
import time

t_start = time.time()
out = sys.argv[1]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

t_imported = time.time()
dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
t_ready = time.time()
rank = int(os.environ["RANK"])
record = {
    "rank": rank,
    "pid": os.getpid(),
    "start": t_start,
    "imported": t_imported,
    "ready": t_ready,
    "sum": value.item(),
    "world_size": dist.get_world_size(),
}
tmp = f"{out}/ready.{rank}.json.tmp"
with open(tmp, "w") as f:
    json.dump(record, f)
os.replace(tmp, f"{out}/ready.{rank}.json")
dist.destroy_process_group()
