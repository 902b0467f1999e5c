"""The worker that leaves descendants behind in every way a process can, for the "nothing the job
started outlives it" tests (tests/test_faults_processes.py and tests/test_faults_hostile.py).

It leaves a child in its own group, a setsid'd `sleep` (another session), a double-forked setsid'd
daemon whose parent exited (re-parented to the agent, the subreaper; it ignores SIGTERM, so only
SIGKILL takes it) and, with `--tokenless`, a `setsid -f env -i` shell (a new session and an empty
environment: no RALLY_AGENT_TOKEN). Each pid goes to PROBE_OUT/<kind>_<restart>_<rank>, written
atomically. Its first argument: `fail-first` (rank 0 exits 3 in the first round), `succeed`
(exits 0), anything else runs until killed.
"""

from __future__ import annotations

from pathlib import Path

from support.helpers import write_probe

KINDS = ("child", "session", "daemon", "worker")

LEAVER = """
import os, signal, subprocess, sys, time
out, rank, restart = os.environ["PROBE_OUT"], os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]

def note(kind, pid):
    path = os.path.join(out, f"{kind}_{restart}_{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.rename(path + ".tmp", path)

def daemon():
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(r)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL takes it
            while True:
                time.sleep(1)
        os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    return int(os.read(r, 32))

note("child", subprocess.Popen(["sleep", "600"]).pid)
note("session", subprocess.Popen(["sleep", "600"], start_new_session=True).pid)
note("daemon", daemon())
if "--tokenless" in sys.argv:
    path = os.path.join(out, f"tokenless_{restart}_{rank}")
    script = f"echo $$ > {path}.tmp && mv {path}.tmp {path} && exec sleep 600"
    subprocess.run(["setsid", "-f", "env", "-i", "/bin/sh", "-c", script], check=True)
note("worker", os.getpid())
mode = sys.argv[1]
if mode == "fail-first" and restart == "0" and rank == "0":
    sys.exit(3)
if mode == "succeed":
    sys.exit(0)
while True:
    time.sleep(1)
"""


def write_leaver(path: Path) -> Path:
    """The probe script at `path`, for rally to run as the worker."""
    return write_probe(path, LEAVER)


def read_pids(directory: Path, pattern: str) -> list[int]:
    """The pids the probe wrote to the files matching `pattern` (e.g. `daemon_0_*`)."""
    return [int(p.read_text()) for p in sorted(directory.glob(pattern)) if p.read_text().strip()]


def round_pids(directory: Path, restart: int, kinds: tuple[str, ...] = KINDS) -> list[int]:
    """Every pid of `kinds` the workers of round `restart` wrote, kind by kind."""
    return [pid for kind in kinds for pid in read_pids(directory, f"{kind}_{restart}_*")]
