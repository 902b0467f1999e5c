"""A torch-free worker for the SLURM job tests: prints its place in the job as one JSON line.

probe.py ok                    print and exit 0
probe.py exit-rank R CODE      global rank R exits CODE (every attempt); the others exit 0
probe.py until-world N         keep running until rally restarts this rank with WORLD_SIZE=N
                               (a worker of a larger world runs until the agent stops it)
"""

import json
import os
import socket
import sys
import time

KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
)  # fmt: skip

record = {key: os.environ.get(key) for key in KEYS}
record["host"] = socket.gethostname()
print("PROBE " + json.dumps(record), flush=True)

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "exit-rank" and int(record["RANK"]) == int(sys.argv[2]):
    time.sleep(2)  # let every other rank print its record before the job is stopped
    sys.exit(int(sys.argv[3]))
if mode == "until-world":
    while int(record["WORLD_SIZE"]) != int(sys.argv[2]):
        time.sleep(0.05)
    print(f"PROBE-DONE rank={record['RANK']} world={record['WORLD_SIZE']} host={record['host']}", flush=True)
