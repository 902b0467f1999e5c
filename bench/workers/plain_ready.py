"""Plain-Python worker (no torch): writes time.time() to <out>/ready.<rank> (and pid), then
sleeps `seconds` (default 0) and exits 0."""

import os
import sys
import time

now = time.time()
out = sys.argv[1]
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
rank = os.environ["RANK"]
with open(f"{out}/pid.{rank}", "w") as f:
    f.write(str(os.getpid()))
with open(f"{out}/ready.{rank}.tmp", "w") as f:
    f.write(repr(now))
os.replace(f"{out}/ready.{rank}.tmp", f"{out}/ready.{rank}")
if seconds:
    time.sleep(seconds)
