"""Detection benchmark worker (plain Python, no torch). Two local ranks, per attempt k
(TORCHELASTIC_RESTART_COUNT):

rank 1 installs a SIGTERM handler that writes time.time() to <out>/term.<k> and exits 0, then
  says it is ready (<out>/ready.<k>) and waits;
rank 0 waits for that, lets the launcher settle for 0.3 s, writes time.time() to
  <out>/exit.<k> and calls os._exit(1) right after.
"""

import os
import signal
import sys
import time

out = sys.argv[1]
rank = int(os.environ["LOCAL_RANK"])
k = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
if rank == 1:

    def on_term(*_):
        now = time.time()
        with open(f"{out}/term.{k}", "w") as f:
            f.write(repr(now))
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    with open(f"{out}/ready.{k}", "w") as f:
        f.write("1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        signal.pause()
    os._exit(3)
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{out}/ready.{k}") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    with open(f"{out}/exit.{k}", "w") as f:
        f.write(repr(time.time()))
    os._exit(1)
