"""Fault matrix: another user of the node against the paths rally writes through and the secrets it reads.

rally runs jobs as root and as users on shared machines. Every directory on the way to what it
writes (--log-dir, the run directory, --checkpoint-dir) or to a secret it reads (token_file,
password_file) is judged as ssh's StrictModes judges a key's path (rendezvous/base/path_trust.py):
another user's directory or link, or one everyone may write without the sticky bit, is refused
with one line and exit 2; a group-writable one is a warning, and the run directory is then
written through the descriptor rally opened, so renaming it away and planting links in its place
reaches nothing. And a job that can only have one node gets a random token, as --standalone
does, so the local user who reaches its store cannot forge its end. The attacker is a real other
uid (tests/support/stranger.py).

docs/fault-matrix.md and docs/security.md "Local surfaces" list what these tests prove.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.helpers import ProcessTracker, clean_env, free_port, procs, run_rally, wait_for, write_probe  # noqa: F401
from support.live_rally import LiveRally
from support.stranger import STRANGER_UID, reachable_dir, require_stranger, run_as_stranger
from support.stranger_store import STORE_CLIENT

PRECIOUS = "root's own file, not to be rewritten by a job\n"

ATTACKED_WORKER = """
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        print("first attempt up", flush=True)
        deadline = time.time() + 60
        while not os.path.exists(os.environ["GO_FILE"]) and time.time() < deadline:
            time.sleep(0.05)
        sys.exit(1)
    print("second attempt up", flush=True)
    raise RuntimeError("the second attempt fails under @record")

main()
"""

SWAP_RUN_DIR = """
import os
run, moved, target = {run!r}, {moved!r}, {target!r}
os.rename(run, moved)                          # the run directory's parent lets the group rename
rank = os.path.join(run, "attempt_1", "0")
os.makedirs(rank)
for d in (run, os.path.dirname(rank), rank):
    os.chmod(d, 0o777)
os.symlink(target, os.path.join(rank, "error.json"))   # torch's @record truncates what this names
os.symlink(target, os.path.join(run, "report.json"))
print("swapped", flush=True)
"""


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory under /tmp that the other user can reach (tmp_path's parents are 0700)."""
    with reachable_dir("rally-paths-") as path:
        yield path


def _strangers(path: Path, mode: int) -> Path:
    path.mkdir()
    os.chown(path, STRANGER_UID, STRANGER_UID)
    path.chmod(mode)
    return path


def _team_dir(shared: Path) -> Path:
    """A team's group-writable directory (root's, 0775, the other user in its group): accepted with
    one warning, and the place from which that user can swap what the job made inside it."""
    team = shared / "team"
    team.mkdir()
    os.chown(team, 0, STRANGER_UID)
    team.chmod(0o775)
    return team


def _one_refusal(done, *needles: str) -> str:
    assert done.returncode == 2, done.describe()
    assert "Traceback" not in done.stderr, done.describe()
    said = [line for line in done.stderr_lines if "error" in line]
    assert len(said) == 1, done.describe()
    for needle in needles:
        assert needle in said[0], done.describe()
    return said[0]


# ------------------------------------------------------------------ the run directory swapped away
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_a_swapped_run_directory_gets_no_write_of_the_job_through_a_planted_link(
    shared: Path, procs: ProcessTracker
) -> None:
    """--log-dir is a team's group-writable directory; a member renames the job's run directory
    away and plants attempt_1/0/error.json (and report.json) -> a file of root's. The restarted
    root worker's @record used to truncate and rewrite that file, and the later logs went to the
    member's directory. Now: one warning naming the directory; every write of the job, the agent's
    and the worker's, lands in the directory rally made, files 0600."""
    require_stranger()
    team = _team_dir(shared)
    target = shared / "precious.txt"
    target.write_text(PRECIOUS)
    go = shared / "go"
    write_probe(shared / "worker.py", ATTACKED_WORKER)
    args = ["--standalone", "--max-restarts", "1", "--log-dir", str(team), str(shared / "worker.py")]
    rally = LiveRally(args, shared, clean_env(GO_FILE=str(go)), procs)
    rally.wait_line("first attempt up", 120)
    (run,) = [p for p in team.iterdir() if p.is_dir()]
    moved = team / "moved"
    swap = run_as_stranger(SWAP_RUN_DIR.format(run=str(run), moved=str(moved), target=str(target)), timeout=30)
    assert swap.returncode == 0 and "swapped" in swap.stdout, swap.stderr
    go.touch()
    code, _ = rally.wait_exit(120)
    text = rally.text()
    assert code == 1, text[-4000:]
    assert target.read_text() == PRECIOUS, "a write of the job went through the planted link"
    assert "second attempt up" in text, text[-4000:]
    warned = [line for line in text.splitlines() if "rally: warning: --log-dir" in line]
    assert len(warned) == 1 and f"{team} can be written by its group" in warned[0], text[-4000:]
    # The job's own directory, renamed, got everything: the traceback @record wrote, the report.
    recorded = json.loads((moved / "attempt_1" / "0" / "error.json").read_text())
    assert "the second attempt fails under @record" in recorded["message"]["message"]
    report = json.loads((moved / "report.json").read_text())
    assert report["outcome"] == "failed" and len(report["attempts"]) == 2, report
    for name in ("report.json", "events.jsonl", "endpoint.json", "attempt_1/0/error.json"):
        assert stat.S_IMODE((moved / name).stat().st_mode) == 0o600, name
    planted = run / "attempt_1" / "0"
    assert sorted(p.name for p in planted.iterdir()) == ["error.json"], "the agent wrote into the planted directory"


# ------------------------------------------------------------------ the checkpoint directory swapped mid-job
SAVING_WORKER = """
import os, time
from rally import job
job.save({"step": 1}, 1)
print("saved 1", flush=True)
deadline = time.time() + 60
while not os.path.exists(os.environ["GO_FILE"]) and time.time() < deadline:
    time.sleep(0.05)
job.save({"step": 2}, 2)
print("saved 2", flush=True)
"""

SWAP_CHECKPOINT_DIR = """
import os
ck, moved, decoy = {ck!r}, {moved!r}, {decoy!r}
os.rename(ck, moved)           # the checkpoint directory's parent lets the group rename
os.symlink(decoy, ck)          # and a link to a directory of the member's choice in its place
print("swapped", flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_swapped_checkpoint_dir_gets_no_write_of_the_job_through_a_planted_link(
    shared: Path, procs: ProcessTracker, tier: str
) -> None:
    """--checkpoint-dir is in a team's group-writable directory (accepted with a warning); after the
    first save a member renames it away and plants a link to a root-owned directory in its place.
    The root job used to write its next checkpoint through the link (the worker's save on disk, or
    the holder's persister) into that directory, and a later run would resume from whatever the
    member put at the name. Now: the job writes through the directory it opened at start (found
    in its renamed place), nothing lands in the linked directory, and one line says the directory
    was moved."""
    require_stranger()
    team = _team_dir(shared)
    decoy = shared / "roots-dir"
    decoy.mkdir(mode=0o755)
    ck, moved, go = team / "ck", team / "moved", shared / "go"
    write_probe(shared / "worker.py", SAVING_WORKER)
    env = clean_env(GO_FILE=str(go), **({"RALLY_MEMORY_TIER": "0"} if tier == "disk" else {}))
    args = ["--standalone", "--checkpoint-dir", str(ck), str(shared / "worker.py")]
    rally = LiveRally(args, shared, env, procs)
    rally.wait_line("saved 1", 120)
    swap = run_as_stranger(SWAP_CHECKPOINT_DIR.format(ck=str(ck), moved=str(moved), decoy=str(decoy)), timeout=30)
    assert swap.returncode == 0 and "swapped" in swap.stdout, swap.stderr
    go.touch()
    code, _ = rally.wait_exit(120)
    text = rally.text()
    assert code == 0, text[-4000:]
    assert "saved 2" in text, text[-4000:]
    assert list(decoy.iterdir()) == [], f"a write of the job went through the planted link: {list(decoy.iterdir())}"
    steps = sorted(p.name for p in moved.iterdir() if p.name.startswith("step_"))
    assert len(steps) == 2 and steps[-1].endswith("2.pt"), steps
    for name in steps:
        assert stat.S_IMODE((moved / name).stat().st_mode) == 0o600, name
    said = [line for line in text.splitlines() if "was moved or replaced while the job ran" in line]
    assert len(said) == 1 and str(ck) in said[0] and str(moved) in said[0], text[-4000:]


# ------------------------------------------------------------------ paths another user can change
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["owned", "world-writable", "link"])
def test_a_log_dir_another_user_could_change_is_one_line_and_exit_2(shared: Path, where: str) -> None:
    """--log-dir under another user's directory, under one everyone can write (no sticky bit), or
    through another user's link in a sticky one: accepted before, with nothing said."""
    require_stranger()
    write_probe(shared / "train.py", "print('ran')\n")
    if where == "owned":
        log_dir, culprit = _strangers(shared / "theirs", 0o755) / "logs", f"{shared / 'theirs'} is owned by uid 65534"
    elif where == "world-writable":
        open_dir = shared / "open"
        open_dir.mkdir()
        open_dir.chmod(0o777)
        log_dir, culprit = open_dir / "logs", f"{open_dir} can be written by every user (mode 0777, no sticky bit)"
    else:
        sticky = shared / "scratch"
        sticky.mkdir()
        sticky.chmod(0o1777)
        mine = shared / "mine"
        mine.mkdir()
        done = run_as_stranger(f"import os; os.symlink({str(mine)!r}, {str(sticky / 'logs')!r})", timeout=30)
        assert done.returncode == 0, done.stderr
        log_dir, culprit = sticky / "logs" / "run", f"{sticky / 'logs'} is a link owned by uid 65534"
    done = run_rally(["--standalone", "--log-dir", str(log_dir), "train.py"], cwd=shared, env=clean_env(), timeout=90)
    _one_refusal(done, f"--log-dir {log_dir}", culprit)
    assert "ran" not in done.stdout
    assert not log_dir.exists() and not (shared / "mine" / "run").exists(), "rally made something there"


@pytest.mark.same_under_load
@pytest.mark.timeout(120)
def test_a_checkpoint_dir_whose_parent_another_user_owns_is_one_line_and_exit_2(shared: Path) -> None:
    """`--checkpoint-dir PROJ/ck` with PROJ another user's: only the leaf was checked (and it did not
    exist yet), so that user could rename ck away and the next run resumed from step 0, exit 0."""
    require_stranger()
    write_probe(shared / "train.py", "print('ran')\n")
    project = _strangers(shared / "project", 0o755)
    args = ["--standalone", "--checkpoint-dir", str(project / "ck"), "train.py"]
    done = run_rally(args, cwd=shared, env=clean_env(), timeout=90)
    _one_refusal(
        done, f"--checkpoint-dir {project / 'ck'}", f"{project} is owned by uid 65534", "checkpoint-dir-shared"
    )
    assert "ran" not in done.stdout


@pytest.mark.same_under_load
@pytest.mark.timeout(120)
@pytest.mark.parametrize("secret", ["token_file", "password_file"])
@pytest.mark.parametrize("whose", ["file", "directory"])
def test_a_secret_file_another_user_controls_is_one_line_and_exit_2(shared: Path, secret: str, whose: str) -> None:
    """A token_file (or etcd password_file) that another user owns, mode 0600, or one of root's in
    a directory another user owns: used before without a word, so that user chose the job's token
    (and the checkpoint key derived from it) or the etcd password."""
    require_stranger()
    write_probe(shared / "train.py", "print('ran')\n")
    if whose == "file":
        path = shared / "secret.txt"
        path.write_text("s3cret\n")
        path.chmod(0o600)
        os.chown(path, STRANGER_UID, STRANGER_UID)
        culprit = f"{path} is a file owned by uid 65534"
    else:
        theirs = _strangers(shared / "theirs", 0o755)
        path = theirs / "secret.txt"
        path.write_text("s3cret\n")
        path.chmod(0o600)
        culprit = f"{theirs} is owned by uid 65534"
    if secret == "token_file":
        args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        conf = f"token_file={path}"
    else:
        args = ["--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        conf = f"username=trainer,password_file={path}"
    done = run_rally([*args, "--rdzv-conf", conf, "train.py"], cwd=shared, env=clean_env(), timeout=90)
    _one_refusal(done, f"{secret}={path}", culprit)


# ------------------------------------------------------------------ a one-node job's token
SLEEPS_THEN_FAILS = """
import time
print("worker up", flush=True)
time.sleep(8)
raise SystemExit(3)
"""

FORGED_SUCCESS = json.dumps({"kind": "succeeded", "detail": "forged by another user", "node": "", "info": {}})


@pytest.mark.timeout(120)
def test_a_one_node_job_on_a_local_store_has_a_token_so_its_end_cannot_be_forged(
    shared: Path, procs: ProcessTracker
) -> None:
    """`--nnodes 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`: no token and no warning
    before, so a local user who wrote a 'succeeded' round end (signed with the empty key, as any
    tokenless agent signs) ended the job with 'job succeeded', exit 0, while its rank was about to
    fail. Now it has a random token as --standalone does: the record is rejected, the job fails."""
    require_stranger()
    write_probe(shared / "worker.py", SLEEPS_THEN_FAILS)
    port = free_port()
    args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "solo"]
    rally = LiveRally([*args, "--max-restarts", "0", "worker.py"], shared, clean_env(), procs)
    rally.wait_line("worker up", 90)
    forge = run_as_stranger(STORE_CLIENT + f"put({port}, 'rally/solo/0/end', {FORGED_SUCCESS.encode()!r})\n", 30)
    assert forge.returncode == 0, forge.stderr
    code, _ = rally.wait_exit(90)
    text = rally.text()
    assert code == 3, text[-4000:]
    assert "job succeeded" not in text, text[-4000:]
    assert "signed with a different job token" in text, text[-4000:]
