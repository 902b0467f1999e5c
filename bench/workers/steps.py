"""Restart benchmark worker: train-like loop of all_reduce steps, each step logged with its time.

Appends "<restart_count> <step> <time.time()>" to <out>/steps.<rank> after every all_reduce,
and writes <out>/start.<rank>.<restart> (script's first line) and pid.<rank>.<restart>.
Attempt 0 steps until it is killed; a restarted attempt does `after` steps and exits 0.
"""

import os
import sys
import time

t_start = time.time()
out, after = sys.argv[1], int(sys.argv[2])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
with open(f"{out}/start.{rank}.{restart}", "w") as f:
    f.write(repr(t_start))
with open(f"{out}/pid.{rank}.{restart}", "w") as f:
    f.write(str(os.getpid()))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
log = open(f"{out}/steps.{rank}", "a", buffering=1)
step = 0
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    value = torch.ones(1)
    dist.all_reduce(value)
    log.write(f"{restart} {step} {time.time()!r}\n")
    step += 1
    if restart >= 1 and step >= after:
        break
    time.sleep(0.05)
log.close()
dist.destroy_process_group()
