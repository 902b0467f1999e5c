"""The `train.py` that tests/test_slurm_jobs.py runs through slurm/train.sbatch as written.

A stand-in for the user's training script with the same rally calls (load_latest, heartbeat,
save, preempted) and no torch: the script asks for 8 GPUs per node, so rally starts 8 workers
on each of 2 nodes, 16 processes on this machine's 2 cores. The first run (no
SLURM_RESTART_COUNT) holds at step HOLD until the time-limit warning comes, so the test's
warning always finds it training; the requeued run resumes and trains to STEPS.
"""

import argparse
import os
import socket
import time

from rally import job

STEPS = 20
HOLD = 10
HOLD_LIMIT_S = 300.0  # a first run never warned ends here, so a broken test cannot hang

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
args = parser.parse_args()

ctx = job.context()
ckpt = job.load_latest()
start = ckpt.step + 1 if ckpt else 0
print(f"TRAIN rank={ctx.rank} world={ctx.world_size} host={socket.gethostname()} start={start} lr={args.lr}")
first_run = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
for step in range(start, STEPS):
    time.sleep(0.05)  # one training step
    job.heartbeat(step)
    if step == HOLD and first_run:
        print(f"TRAIN-HOLD rank={ctx.rank} step={step}")
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not job.preempted() and time.monotonic() < deadline:
            time.sleep(0.05)
            job.heartbeat(step)
    if job.preempted():  # the time-limit warning, forwarded by the batch shell, srun and rally
        job.save({"step": step}, step)
        print(f"preempted at step {step}: saved, exiting")
        break
    if step % 5 == 0:
        job.save({"step": step}, step)
else:
    print(f"TRAIN-DONE rank={ctx.rank} step={step}")
