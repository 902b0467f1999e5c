"""The checkpoint tier as a security boundary (holder, metadata, planted files, file modes, another job).

The attacker is a real other user (tests/support/stranger.py: uid 65534, standard library only) wherever
the finding is about another user; the last cases are the same user's other job. Everything is real: the
agent's holder process, its socket, memfds, files on disk. Where a case needs torch (DCP's
metadata, torch.save'd states) one worker subprocess does the loading.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint import persist
from rally.agent.checkpoint.core import checkpoint_file
from rally.agent.checkpoint.core import client as ckpt_client
from rally.agent.checkpoint.core.client import CheckpointRefused, MemoryTier
from rally.agent.checkpoint.node_checkpoints import HolderProcess
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.checkpoint.sharded import persist as dcp_persist
from support.helpers import eventually, run_rally
from support.stranger import STRANGER_UID, reachable_dir, require_stranger, run_as_stranger, stranger_process

REPO = Path(__file__).resolve().parents[1]
LEASE = 60.0


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that the stranger can reach (tmp_path's parents are 0700)."""
    with reachable_dir("rally-trust-") as path:
        yield path


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[HolderProcess, list[str]]]:
    warnings: list[str] = []
    tier = HolderProcess.start(str(tmp_path / "ckpt"), EventLog(tmp_path / "events.jsonl"), warnings.append)
    assert isinstance(tier, HolderProcess), warnings
    tier.open_round(0, None, LEASE)
    try:
        yield tier, warnings
    finally:
        tier.stop()


def worker_of(tier: HolderProcess, monkeypatch: pytest.MonkeyPatch, **changed: str) -> MemoryTier:
    """A worker's client made as a worker makes it: from the environment the agent gives it."""
    for name, value in {**tier.env(), "RALLY_ROUND": "0", **changed}.items():
        monkeypatch.setenv(name, value)
    made = MemoryTier.from_env()
    assert made is not None
    return made


# A holder of the stranger's: answers every request as the real one would, with its own step, and
# a sharded copy whose DCP metadata is a pickle that runs code (standard library only).
FAKE_HOLDER = """
import json, os, pickle, socket, struct, sys
name, marker = sys.argv[1], sys.argv[2]
class Boom:
    def __reduce__(self):
        return (exec, ("open(%r, 'w').write('pwned')" % marker,))
meta = pickle.dumps(Boom())
blob = struct.pack("<8sQQQ", b"RALLYDCP", len(meta), 1, 0) + meta + b"\\0" * 64
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind("\\0rally-ckpt-" + name)
listener.listen(8)
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    try:
        while packet := conn.recv(65536):
            op = json.loads(packet).get("op")
            fds = []
            if op == "held":
                answer = {"ok": True, "held": {"dcp0of1": [424242]}}
            elif op == "slot":
                fd = os.memfd_create("x")
                os.write(fd, blob)
                answer, fds = {"ok": True, "length": len(blob)}, [fd]
            else:
                answer = {"ok": True, "step": 424242, "slot": 0}
            socket.send_fds(conn, [json.dumps(answer).encode()], fds)
    except OSError:
        pass
    conn.close()
"""


def start_fake_holder(marker: Path) -> tuple[contextlib.AbstractContextManager, str]:  # type: ignore[type-arg]
    name = os.urandom(16).hex()
    code = f"import sys; sys.argv = ['x', {name!r}, {str(marker)!r}]\n" + FAKE_HOLDER
    return stranger_process(code), name


# --- the holder cannot be squatted, and the worker checks who answers ----------------


@pytest.mark.timeout(30)
def test_the_holders_socket_is_named_on_no_command_line_and_another_user_cannot_bind_it(
    agent: tuple[HolderProcess, list[str]],
) -> None:
    require_stranger()
    tier, _ = agent
    name = tier.env()[ckpt_client.HOLDER_ENV]
    cmdline = Path(f"/proc/{tier.pid}/cmdline").read_bytes().decode()
    assert name not in cmdline, "the socket's name is on the holder's command line, readable by every user"
    # Even told the name (abstract names show in /proc/net/unix once bound), the stranger can
    # neither bind it (the agent bound it before the holder started) nor be served on it.
    probe = f"""
import json, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.bind("\\0rally-ckpt-{name}")
    print("bound")
except OSError as exc:
    print("bind refused", exc.errno)
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.settimeout(5)
c.connect("\\0rally-ckpt-{name}")
try:  # the holder may close a stranger's connection before the send: that too is no answer
    c.send(json.dumps({{"op": "resume", "key": "whole"}}).encode())
    print("answer", c.recv(65536))
except OSError as exc:
    print("no answer", exc)
"""
    done = run_as_stranger(probe, timeout=20)
    assert "bind refused 98" in done.stdout, done.stdout + done.stderr
    assert "answer b''" in done.stdout or "no answer" in done.stdout, done.stdout


@pytest.mark.timeout(30)
def test_a_worker_refuses_a_checkpoint_socket_served_by_another_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    attacker, name = start_fake_holder(marker)
    with attacker as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening", proc.stderr
        monkeypatch.setenv(ckpt_client.HOLDER_ENV, name)
        monkeypatch.setenv("RALLY_CKPT_HOLDER_PID", str(os.getpid()))  # the holder the agent started: not the squatter
        monkeypatch.setenv("RALLY_CKPT_SECRET", "the-jobs-secret")
        worker = MemoryTier.from_env()
        assert worker is not None
        with pytest.raises(CheckpointRefused, match=r"served by pid \d+ \(uid 65534\).*refusing it"):
            worker.resume("whole")  # main: (424242, ...) from the squatter
        worker.close()


@pytest.mark.timeout(30)
def test_a_holder_that_cannot_bind_its_socket_leaves_the_tier_off_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rally.agent.checkpoint import node_checkpoints

    attacker, name = start_fake_holder(tmp_path / "unused")
    with attacker as proc:  # the stranger holds the name first
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        monkeypatch.setattr(node_checkpoints, "socket_name", lambda: name, raising=False)
        warnings: list[str] = []
        started = HolderProcess.start(str(tmp_path / "ckpt"), EventLog(tmp_path / "e.jsonl"), warnings.append)
        assert started is None, "the tier is half on: a holder without its socket"
        assert len(warnings) == 1 and "tier is off" in warnings[0] and "Address already in use" in warnings[0]


@pytest.mark.timeout(30)
def test_the_agent_notices_its_holder_dying_and_never_counts_its_memory_steps_as_durable(
    agent: tuple[HolderProcess, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, warnings = agent
    worker = worker_of(tier, monkeypatch)
    slot = worker.reserve("whole", 7, 4096, True, 3)
    assert slot is not None
    worker.commit("whole", 7, 100)  # saved in memory; the persister may or may not have written it yet
    worker.close()
    assert eventually(lambda: tier.last_saved == 7, 10)
    os.kill(tier.pid, 9)
    assert eventually(lambda: any("holder of this node" in w and "died" in w for w in warnings), 10), warnings
    if tier.last_durable != 7:  # died before the disk: the job's end must not count it
        assert tier.lost() is not None and "never reached" in tier.lost()  # type: ignore[operator]
    # never half on: the next round's workers get no holder, and no round agrees on its memory steps
    assert tier.env() == {ckpt_client.HOLDER_LOST_ENV: "1"}
    assert tier.memory_steps() == []


HOLDER_DIES = """
import time, psutil
from rally.agent.checkpoint.core import client
tier = client.tier()
slot = tier.reserve("whole", 7, 4096, False, 3)  # step 7, in memory only
slot[:4] = b"abcd"
tier.commit("whole", 7, 4)
time.sleep(0.5)  # the holder tells its agent "saved"
me, holder = psutil.Process(), None
while me is not None and holder is None:  # the holder: a child of the agent, an ancestor of this worker
    holder = next((c for c in me.children() if "holder.py" in " ".join(c.cmdline())), None)
    me = me.parent()
holder.kill()
time.sleep(1.5)
print("worker done", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_job_whose_holder_died_with_its_newest_step_does_not_exit_0(tmp_path: Path) -> None:
    from support.helpers import clean_env, run_rally

    script = tmp_path / "train.py"
    script.write_text(HOLDER_DIES)
    ckpt = tmp_path / "ckpt"
    result = run_rally(
        ["--standalone", "--nproc-per-node", "1", "--checkpoint-dir", str(ckpt), str(script)],
        cwd=tmp_path, env=clean_env(), timeout=80,
    )  # fmt: skip
    assert "worker done" in result.stdout, result.describe()
    assert result.returncode != 0, result.describe()  # main: exit 0, "succeeded"
    assert "checkpoint step 7 never reached" in result.stderr, result.describe()


HOLDER_DIES_MID_JOB = """
import json, os, sys, time
from pathlib import Path
import psutil, torch
from rally import job
marker = Path(sys.argv[1])
found = job.load_latest()
print("round " + json.dumps({"holder": "RALLY_CKPT_HOLDER" in os.environ, "resumed": found.step if found else None,
                             "source": found.source if found else None}), flush=True)
for step in range(found.step + 1 if found else 0, 6):
    job.save({"w": torch.full((4,), float(step))}, step)
    if step == 2 and not marker.exists():
        deadline = time.monotonic() + 20
        while 2 not in job.durable_steps() and time.monotonic() < deadline:
            time.sleep(0.05)
        marker.write_text("")
        me, holder = psutil.Process(), None
        while me is not None and holder is None:  # the holder: a child of an ancestor of this worker
            holder = next((c for c in me.children() if "holder.py" in " ".join(c.cmdline())), None)
            me = me.parent()
        holder.kill()
        time.sleep(1.0)
print("worker done", flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_holder_killed_mid_job_turns_the_tier_off_and_the_job_goes_on_from_disk(tmp_path: Path) -> None:
    from support.helpers import clean_env, run_rally

    script = tmp_path / "train.py"
    script.write_text(HOLDER_DIES_MID_JOB)
    ckpt = tmp_path / "ckpt"
    result = run_rally(
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--checkpoint-dir", str(ckpt),
         str(script), str(tmp_path / "killed")],
        cwd=tmp_path, env=clean_env(), timeout=110,
    )  # fmt: skip
    rounds = [json.loads(line.split("round ", 1)[1]) for line in result.stdout.splitlines() if "round {" in line]
    assert result.returncode == 0, result.describe()  # main: every later round's save fails on the dead holder
    assert rounds[0] == {"holder": True, "resumed": None, "source": None}, result.describe()
    assert rounds[1] == {"holder": False, "resumed": 2, "source": "disk"}, result.describe()
    assert result.stderr.count("died: its in-memory checkpoints are lost") == 1, result.describe()
    assert "the memory tier is off from the next round on, saves go to disk" in result.stderr, result.describe()
    newest = ckpt / "step_000000000005.pt"
    fd, verified = checkpoint_file.open_mapped_verified(newest)  # written by the worker itself, signed
    os.close(fd)
    assert verified.signed and verified.step == 5


# Environment only, no processes to time: a busy CPU changes nothing here.
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_without_a_checkpoint_dir_a_round_after_the_holders_death_says_once_that_checkpoints_are_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rally.agent.worker_side import job, memory_only

    for name in (ckpt_client.HOLDER_ENV, ckpt_client.HOLDER_PID_ENV, ckpt_client.SECRET_ENV, "RALLY_CHECKPOINT_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ckpt_client.HOLDER_LOST_ENV, "1")  # what the agent gives the next round's workers
    monkeypatch.setattr(ckpt_client, "_tier_resolved", False)
    monkeypatch.setattr(memory_only, "_told_off", False, raising=False)
    assert job.load_latest() is None
    assert job.save({"step": 1}, 1) is None and job.save({"step": 2}, 2) is None  # main: CheckpointDirNotSet
    assert capsys.readouterr().err.count("checkpoints are off: this node's checkpoint holder died") == 1


SAVE_OR_LOAD = """
import json, os, sys
import torch
from rally import job
if sys.argv[1] == "save":
    job.save({"w": torch.arange(4.0)}, 3)
    print("saved", flush=True)
else:
    found = job.load_latest()
    print("loaded " + json.dumps(found.step if found else None), flush=True)
print("token in env: " + str(any(v == "tok-" + "shared-by-the-nodes" for v in os.environ.values())), flush=True)
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_nodes_sharing_only_a_token_file_verify_each_others_checkpoints(tmp_path: Path) -> None:
    """Two launches with different homes (no shared ~/.rally/secret) and one --rdzv-conf token_file:
    what the first wrote (through its holder) the second loads, as a multi-node job's nodes would."""
    from support.helpers import clean_env, run_rally

    script, ckpt, token = tmp_path / "train.py", tmp_path / "ckpt", tmp_path / "token"
    script.write_text(SAVE_OR_LOAD)
    token.write_text("tok-shared-by-the-nodes\n")
    token.chmod(0o600)
    results = []
    for node, what in (("a", "save"), ("b", "load")):
        (tmp_path / node).mkdir()
        args = ["--standalone", "--nproc-per-node", "1", "--rdzv-conf", f"token_file={token}"]
        args += ["--checkpoint-dir", str(ckpt), str(script), what]
        env = clean_env(HOME=str(tmp_path / node), RALLY_JOB_TOKEN=None)
        results.append(run_rally(args, cwd=tmp_path, env=env, timeout=55))
    saved, loaded = results
    assert saved.returncode == 0 and "saved" in saved.stdout, saved.describe()
    assert loaded.returncode == 0 and "loaded 3" in loaded.stdout, loaded.describe()  # main: refused, not signed
    assert "token in env: False" in saved.stdout and "token in env: False" in loaded.stdout  # the key, not the token


# --- no code from a squatter's DCP metadata --------------------------------------------

SHARDED_RESUME = """
import json, os, sys, tempfile
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from rally import job
from rally.agent.checkpoint.core.client import CheckpointRefused
try:
    found = job.load_latest(into={"w": torch.zeros(4)})
    print(json.dumps({"step": found.step if found else None}))
except CheckpointRefused as exc:
    print(json.dumps({"refused": str(exc)}))
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_squatters_dcp_metadata_never_runs_code_in_the_worker(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    attacker, name = start_fake_holder(marker)
    with attacker as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "RANK", "WORLD_SIZE", "LOCAL_"))}
        env |= {
            ckpt_client.HOLDER_ENV: name,
            "RALLY_CKPT_HOLDER_PID": str(os.getpid()),
            "RALLY_CKPT_SECRET": "the-jobs-secret",
            "RALLY_CHECKPOINT_DIR": str(ckpt),
            "RALLY_ROUND": "0",
        }
        done = subprocess.run(
            [sys.executable, "-c", SHARDED_RESUME], env=env, cwd=REPO, capture_output=True, text=True, timeout=100
        )
    assert not marker.exists(), "the squatter's pickle ran in the worker"
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refusing it" in json.loads(done.stdout.strip().splitlines()[-1]).get("refused", ""), done.stdout


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_dcp_metadata_is_read_with_an_allow_list_of_dcps_own_classes(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from rally.agent.checkpoint.sharded import metadata as dcp_metadata

    dcp.save(
        {"w": torch.zeros(3, dtype=torch.bfloat16), "n": 1}, storage_writer=FileSystemWriter(tmp_path), no_dist=True
    )
    genuine = dcp_metadata.loads((tmp_path / ".metadata").read_bytes())
    assert "w" in genuine.state_dict_metadata
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (exec, (f"open({str(marker)!r}, 'w').write('pwned')",))

    with pytest.raises(dcp_metadata.UnsafeMetadata, match="builtins.exec"):
        dcp_metadata.loads(pickle.dumps(Boom()))
    assert not marker.exists()


# --- planted checkpoints --------------------------------------------------------------

PLANTED_LOAD = """
import json, os, sys
import torch
from rally import job
out = {}
try:
    found = job.load_latest()
    out["whole"] = found.step if found else None
except Exception as exc:
    out["whole_error"] = f"{type(exc).__name__}: {exc}"
try:
    found = job.load_latest(into={"w": torch.zeros(4)})
    out["sharded"] = found.step if found else None
except Exception as exc:
    out["sharded_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

PLANT = """
import base64, json, os, sys, zlib, struct
directory, payload, meta = sys.argv[1], base64.b64decode(sys.argv[2]), base64.b64decode(sys.argv[3])
with open(os.path.join(directory, "step_000000000099.pt"), "wb") as f:   # a legacy footer, a valid CRC
    f.write(payload + struct.pack("<8sQI4s", b"RALLYCKP", len(payload), zlib.crc32(payload), b"END1"))
step = os.path.join(directory, "step_000000000099.dcp")
os.mkdir(step)
files = {".metadata": meta, "__0_0.distcp": b"x" * 16}
for name, data in files.items():
    open(os.path.join(step, name), "wb").write(data)
manifest = {"format": "rally-dcp-1", "step": 99,
            "files": {n: {"size": len(d), "crc32": zlib.crc32(d)} for n, d in files.items()}}
open(os.path.join(step, "rally.json"), "w").write(json.dumps(manifest))
print("planted")
"""


def planted_payloads(marker: Path) -> tuple[str, str]:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"w": torch.full((4,), 424242.0)}, buffer)

    class Boom:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (exec, (f"open({str(marker)!r}, 'w').write('pwned')",))

    return base64.b64encode(buffer.getvalue()).decode(), base64.b64encode(pickle.dumps(Boom())).decode()


def load_in_worker(directory: Path, shared: bool) -> tuple[dict, str]:
    """What a worker's load_latest() and load_latest(into=...) find in ``directory`` (each may fail)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLY_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env |= {"RALLY_CHECKPOINT_DIR": str(directory)} | ({"RALLY_CHECKPOINT_DIR_SHARED": "1"} if shared else {})
    done = subprocess.run(
        [sys.executable, "-c", PLANTED_LOAD], env=env, cwd=REPO, capture_output=True, text=True, timeout=100
    )
    lines = done.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if lines else {"crashed": done.returncode}), done.stderr


@pytest.mark.torch
@pytest.mark.timeout(150)
def test_checkpoints_another_user_planted_are_never_loaded_even_with_consent(open_dir: Path) -> None:
    require_stranger()
    shared = open_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # a shared scratch directory
    marker = open_dir / "pwned"
    payload, meta = planted_payloads(marker)
    args = f"import sys; sys.argv = ['x', {str(shared)!r}, {payload!r}, {meta!r}]\n"
    done = run_as_stranger(args + PLANT, timeout=20)
    assert "planted" in done.stdout, done.stderr
    found, stderr = load_in_worker(shared, shared=True)
    assert not marker.exists(), "the planted .metadata pickle ran code in the job"
    assert found.get("whole") is None and found.get("sharded") is None, (found, stderr[-2000:])
    assert "not loaded" in stderr
    refused, _ = load_in_worker(shared, shared=False)  # without consent: one line, nothing loaded
    assert "--checkpoint-dir-shared" in refused.get("whole_error", ""), refused


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_legacy_checkpoints_still_load_from_a_private_directory_with_one_line_each(tmp_path: Path) -> None:
    import io

    import torch

    private = tmp_path / "mine"
    private.mkdir(mode=0o700)
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(4)}, buffer)
    payload = buffer.getvalue()
    legacy = checkpoint_file.LEGACY_FOOTER.pack(b"RALLYCKP", len(payload), __import__("zlib").crc32(payload), b"END1")
    (private / "step_000000000003.pt").write_bytes(payload + legacy)
    import zlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    sharded = private / "step_000000000004.dcp"  # a sharded step with the manifest of before (CRCs, no MAC)
    dcp.save({"w": torch.full((4,), 4.0)}, storage_writer=FileSystemWriter(sharded), no_dist=True)
    files = {p.name: p.read_bytes() for p in sharded.iterdir()}
    manifest = {
        "format": "rally-dcp-1",
        "step": 4,
        "files": {n: {"size": len(d), "crc32": zlib.crc32(d)} for n, d in files.items()},
    }
    (sharded / "rally.json").write_text(json.dumps(manifest))
    found, stderr = load_in_worker(private, shared=False)
    assert found.get("whole") == 3 and found.get("sharded") == 4, (found, stderr)
    assert stderr.count("unauthenticated") == 2, stderr


@pytest.mark.timeout(30)
def test_a_signed_checkpoint_renamed_to_another_step_or_signed_by_another_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"0123456789" * 100
    fd = os.memfd_create("slot")
    os.write(fd, data)
    written = persist.persist(fd, len(data), tmp_path, 5, 3)
    os.close(fd)
    assert checkpoint_file.is_intact(written)
    renamed = tmp_path / "step_000000000009.pt"
    os.rename(written, renamed)
    assert not checkpoint_file.is_intact(renamed)
    monkeypatch.setenv("RALLY_CKPT_KEY", "00" * 32)  # another user's key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fd = os.memfd_create("slot")
    os.write(fd, data)
    foreign = persist.persist(fd, len(data), tmp_path / "other", 5, 3)
    os.close(fd)
    monkeypatch.delenv("RALLY_CKPT_KEY")
    assert not checkpoint_file.is_intact(foreign)


@pytest.mark.timeout(60)
def test_the_launcher_refuses_a_checkpoint_dir_others_can_write_unless_told_it_is_shared(open_dir: Path) -> None:
    shared = open_dir / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o777)
    script = open_dir / "train.py"
    script.write_text("print('ran')\n")
    base = ["--standalone", "--nproc-per-node", "1", "--checkpoint-dir", str(shared)]
    refused = run_rally([*base, str(script)], cwd=open_dir, timeout=50)
    assert refused.returncode != 0 and "ran" not in refused.stdout
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "writable by every user" in lines[0] and "--checkpoint-dir-shared" in lines[0], lines
    accepted = run_rally(
        [*base[:-2], "--checkpoint-dir-shared", "--checkpoint-dir", str(shared), str(script)], cwd=open_dir, timeout=50
    )
    assert accepted.returncode == 0 and "ran" in accepted.stdout, accepted.stderr[-2000:]


# --- private sharded files, unpredictable temp names, no links followed ---------


def write_part(directory: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's part of a sharded step, as its background writer writes it (no torch: rank 1 does not publish)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("RALLY_ROUND", "0")
    dcp_persist.persist_part(directory, step, 3, 1, 2, b"metadata", b"shards of rank 1")


@pytest.mark.timeout(30)
def test_sharded_parts_and_manifests_are_readable_by_no_other_user(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_stranger()
    ckpt = open_dir / "ckpt"  # the user's own directory, 0755: others may look, not write
    ckpt.mkdir(mode=0o755)
    write_part(ckpt, 4, monkeypatch)
    (temp,) = [p for p in ckpt.iterdir() if dcp_files.TEMP_RE.match(p.name)]
    assert temp.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in temp.iterdir()} == {
        "__1_0.distcp": 0o600,
        "__1.metadata": 0o600,
        "__1.rally.json": 0o600,
    }
    done = run_as_stranger(f"print(open({str(temp / '__1_0.distcp')!r}, 'rb').read())", timeout=10)
    assert "PermissionError" in done.stderr and "shards" not in done.stdout
    published = dcp_files.TempDir(ckpt, 5)
    (published.path / ".metadata").write_bytes(b"m")
    path = published.publish({".metadata": (1, "0" * 64)})
    published.close()
    assert (path / dcp_files.MANIFEST).stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(30)
def test_a_link_planted_at_the_sharded_temp_name_is_never_followed(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_stranger()
    shared = open_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("RALLY_ROUND", "0")
    names = {".step_000000000007.dcp.job1-0.tmp", dcp_persist.temp_name(7)}  # main's name, and today's (leaked)
    plant = f"""
import os
trap = {str(shared / "trap")!r}
os.mkdir(trap); os.chmod(trap, 0o777)
for name in {sorted(names)!r}:
    os.symlink(trap, os.path.join({str(shared)!r}, name))
print("planted")
"""
    assert "planted" in run_as_stranger(plant, timeout=10).stdout
    with contextlib.suppress(PermissionError):  # refused: the name is another user's link
        write_part(shared, 7, monkeypatch)
    assert list((shared / "trap").iterdir()) == [], "the job wrote its shards into the stranger's directory"
    assert (shared / "trap").stat().st_uid == STRANGER_UID


# --- another job of the same user ------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_same_user_process_without_the_jobs_secret_is_turned_away(
    agent: tuple[HolderProcess, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, _ = agent
    owner = worker_of(tier, monkeypatch)
    slot = owner.reserve("whole", 3, 4096, False, 3)
    assert slot is not None
    slot[:5] = b"state"
    owner.commit("whole", 3, 5)
    other = worker_of(tier, monkeypatch, RALLY_CKPT_SECRET="another-jobs-secret")  # name and pid learnt, not the secret
    with pytest.raises(CheckpointRefused, match="turned this connection away"):
        other.held("")  # main: {"whole": [3]}, and its memfd on a "slot" request
    other.close()
    owner.close()


@pytest.mark.timeout(30)
def test_a_huge_reserve_is_refused_and_never_latches_the_job_to_disk_only(
    agent: tuple[HolderProcess, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, warnings = agent
    worker = worker_of(tier, monkeypatch)
    with pytest.raises(CheckpointRefused, match="more than this node's memory"):
        worker.reserve("whole", 1, 1 << 50, True, 3)  # 1 PiB
    slot = worker.reserve("whole", 2, 4096, True, 3)  # the next save is held in memory as ever
    assert slot is not None
    worker.commit("whole", 2, 10)
    assert eventually(lambda: tier.last_saved == 2, 10)
    assert not any("disk only" in w for w in warnings), warnings
    worker.close()


# --- a checkpoint is bound to the job that wrote it (--checkpoint-dir-shared) ---------

RESUME_OR_SAVE = """
import sys
from rally import job
found = job.load_latest()
print("resumed", found.step if found else None, flush=True)
if found is None:
    job.save({"step": int(sys.argv[1])}, int(sys.argv[1]))
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("identity", ["rdzv-id", "directory id"])
def test_a_checkpoint_of_another_job_moved_into_a_shared_dir_is_refused_and_the_job_resumes_its_own(
    open_dir: Path, identity: str
) -> None:
    """Two jobs of the user keep checkpoints in shared directories (0777, --checkpoint-dir-shared).
    Another user cannot read the 0600 files, but can rename them: they move job A's step 5 into
    job B's directory, where B saved only step 1. B used to resume from A's step 5 (the MAC bound
    key, kind, step and bytes, not the job). Now B refuses it with one line naming why and resumes
    from its own step 1. The job is the --rdzv-id the user gave, or the random id rally keeps in
    the directory (.rally-job-id, 0600)."""
    require_stranger()
    script = open_dir / "train.py"
    script.write_text(RESUME_OR_SAVE)
    dirs = {name: open_dir / name for name in ("a", "b")}
    for path in dirs.values():
        path.mkdir()
        os.chmod(path, 0o777)  # shared scratch: every user may write it (no sticky bit)

    def run(name: str, step: int):
        named = ["--rdzv-id", f"job-{name}"] if identity == "rdzv-id" else []
        args = ["--standalone", *named, "--nproc-per-node", "1", "--checkpoint-dir-shared"]
        done = run_rally(
            [*args, "--checkpoint-dir", str(dirs[name]), str(script), str(step)], cwd=open_dir, timeout=100
        )
        assert done.returncode == 0, done.describe()
        return done

    run("a", 5)
    run("b", 1)
    (a_step,) = [p for p in dirs["a"].iterdir() if p.name.startswith("step_")]
    if identity == "directory id":
        for path in dirs.values():
            kept = path / ".rally-job-id"
            assert kept.stat().st_mode & 0o777 == 0o600 and kept.stat().st_uid == os.geteuid()
    moved = run_as_stranger(f"import os; os.rename({str(a_step)!r}, {str(dirs['b'] / a_step.name)!r})", timeout=10)
    assert moved.returncode == 0, moved.stderr
    again = run("b", 1)
    assert "resumed 1" in again.stdout, again.describe()  # main: "resumed 5", A's weights
    refused = [line for line in again.stderr.splitlines() if "is not loaded" in line]
    assert len(refused) == 1 and a_step.name in refused[0] and "signed by another job" in refused[0], again.describe()


@pytest.mark.timeout(60)
def test_a_sharded_step_of_another_job_is_refused_in_a_shared_dir_and_an_old_manifest_is_one_line(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DCP manifest names its job inside the MAC: another user renames job A's published step
    into job B's shared directory, and B's check refuses it; B's own step verifies; in a directory
    only the user can write a step of another of their jobs still loads (nothing else can bring it
    there); a manifest of the format before (`rally-dcp-3`) verifies, with one line in a shared one."""
    require_stranger()
    from rally.agent.checkpoint.core import auth, digest

    monkeypatch.setenv(auth.KEY_ENV, "11" * 32)
    scratch = open_dir / "scratch"  # a shared scratch directory: every user may write it
    scratch.mkdir()
    os.chmod(scratch, 0o777)
    shared_a, shared_b, private = scratch / "a", scratch / "b", open_dir / "private"
    for path in (shared_a, shared_b):
        path.mkdir()
        os.chmod(path, 0o777)
    private.mkdir(mode=0o700)

    def publish(directory: Path, step: int, job: str) -> Path:
        monkeypatch.setenv(auth.JOB_ENV, auth.job_tag_of(job).hex())
        temp = dcp_files.TempDir(directory, step)
        data = f"metadata of {job}".encode()
        (temp.path / ".metadata").write_bytes(data)
        path = temp.publish({".metadata": (len(data), digest.of(data).hex())})
        temp.close()
        return path

    theirs = publish(shared_a, 7, "rdzv:job-a")
    ours = publish(shared_b, 3, "rdzv:job-b")
    # A step directory (0700, the user's) cannot be moved to another parent by another user (its
    # '..' would change), but the checkpoint directories can: B's is put aside and A's takes its name.
    aside = scratch / "b-old"
    swap = f"import os; os.rename({str(shared_b)!r}, {str(aside)!r}); os.rename({str(shared_a)!r}, {str(shared_b)!r})"
    moved = run_as_stranger(swap, timeout=10)
    assert moved.returncode == 0, moved.stderr
    # job B reads its directory
    with pytest.raises(dcp_files.DamagedCheckpoint, match="signed by another job"):
        dcp_files.verify(shared_b / theirs.name)  # main: verified (True), and B resumed from A's step 7
    assert dcp_files.newest_intact_step(shared_b) is None
    assert any("signed by another job" in line for line in auth.take_refusals())
    ours = aside / ours.name
    assert dcp_files.verify(ours) is True
    own_private = publish(private, 9, "rdzv:job-a")
    monkeypatch.setenv(auth.JOB_ENV, auth.job_tag_of("rdzv:job-b").hex())
    assert dcp_files.verify(own_private) is True  # a private directory: any job of the user's
    # the format before: the signed part without a job, under the old format name
    manifest = json.loads((ours / dcp_files.MANIFEST).read_text())
    manifest["format"] = "rally-dcp-3"
    del manifest["job"]
    signed = {k: manifest[k] for k in ("format", "step", "files")}
    manifest["mac"] = auth.sign("dcp", 3, json.dumps(signed, sort_keys=True, separators=(",", ":")).encode())
    (ours / dcp_files.MANIFEST).write_text(json.dumps(manifest))
    assert dcp_files.verify(ours) is True
    line = dcp_files.old_format_line(ours)
    assert line is not None and "before checkpoints were bound to their job" in line


@pytest.mark.timeout(30)
def test_a_whole_state_file_of_the_footer_before_job_binding_still_loads_with_one_line_in_a_shared_dir(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files signed before checkpoints were bound to their job (footer END3) stay loadable: the
    check accepts them, and in a shared directory it says so in one line; in a private one, nothing."""
    from rally.agent.checkpoint.core import auth, digest

    monkeypatch.setenv(auth.KEY_ENV, "22" * 32)
    monkeypatch.setenv(auth.JOB_ENV, auth.job_tag_of("rdzv:job-b").hex())
    payload = b"torch.save bytes" * 64
    mac = auth.seal(auth.signing_key(), checkpoint_file.MAC_KIND, 4, digest.of(payload))  # no job: format 3
    old = checkpoint_file.OLD_FOOTER.pack(b"RALLYCK3", len(payload), 4, mac, b"END3")
    shared, private = open_dir / "shared", open_dir / "private"
    shared.mkdir()
    os.chmod(shared, 0o777)
    private.mkdir(mode=0o700)
    for directory, told in ((shared, True), (private, False)):
        path = directory / "step_000000000004.pt"
        path.write_bytes(payload + old)
        fd, verified = checkpoint_file.open_mapped_verified(path)
        os.close(fd)
        assert verified.signed and verified.step == 4 and verified.job is None
        assert checkpoint_file.refusal(path, verified) is None
        line = checkpoint_file.old_format_line(path, verified)
        assert (line is not None and "before checkpoints were bound to their job" in line) == told, line
