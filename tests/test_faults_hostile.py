"""Fault matrix: a hostile or buggy worker, and what the job started, cannot steer or outlive the agent.

    heartbeat file replaced by a FIFO          -> the agent keeps watching; SIGTERM stops it at once
    a FIFO at TORCHELASTIC_ERROR_FILE          -> the failure is reported (stderr tail), exit 1
    the error file a symlink to /dev/zero      -> not read (no memory blow-up), exit 1
    error.json holding [1,2,3], a string, or
    100 000 nested brackets                    -> no traceback: reported as a failure without one
    FIFOs planted at the next attempt's logs   -> replaced by regular files; the restart runs
    and at report.json's temporary name
    SIGKILL of the agent's process group       -> the orphan guard (a session of its own) kills every
                                                  descendant: cgroup v2, v1 freezer, v1 pids, or none
    SIGKILL of the agent, `setsid -f env -i`   -> the job's cgroup finds what shed the token
    a c10d store claiming a 1 TiB value, or
    never answering a wait or its cancel       -> one line naming the store, exit 1, within its bound
    an etcd gateway answering too deep, a list,
    wrong types, 1 TiB, a never-ending reply   -> one line naming it, exit 2 (1 once the job has begun)

Run beside a CPU hog too (RALLY_TEST_CPU_HOG=1, see conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from rally.agent.guard.job_cgroup import JobCgroup
from support.descendants import KINDS as LEAVER_KINDS
from support.descendants import round_pids, write_leaver
from support.helpers import (  # noqa: F401
    ProcessTracker,
    clean_env,
    describe_pids,
    eventually,
    procs,
    run_rally,
    survivors,
    wait_for,
    write_probe,
)
from support.live_rally import LiveRally
from support.stranger import require_stranger, stranger_process
from support.stranger_store import HOSTILE_C10D, HOSTILE_ETCD

STANDALONE = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0"]

FIFO_HEARTBEAT = """
import os, time
from rally import job
job.heartbeat()                          # the agent now reads the file every second
path = os.environ["RALLY_HEARTBEAT_FILE"]
os.unlink(path)
os.mkfifo(path)                          # a plain open() of it blocks for ever
print("replaced", flush=True)
time.sleep(120)
"""


# Same under load: the FIFO is in place before the worker prints "replaced" and the test waits for
# that line; what the agent does with it, at each of its reads, is a check of the file's type, not
# a race (as for the FIFOs planted at the next attempt's files below).
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
def test_a_heartbeat_file_replaced_by_a_fifo_does_not_wedge_the_agent(tmp_path: Path, procs: ProcessTracker) -> None:
    write_probe(tmp_path / "probe.py", FIFO_HEARTBEAT)
    rally = LiveRally([*STANDALONE, "--shutdown-timeout", "2", "probe.py"], tmp_path, clean_env(), procs)
    rally.wait_line("replaced", 60)
    time.sleep(3)  # three heartbeat reads of the FIFO
    rally.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, ended = rally.wait_exit(30)
    assert code == 128 + signal.SIGTERM, rally.text()[-3000:]
    assert ended - sent < 10, f"the stop took {ended - sent:.1f} s\n{rally.text()[-3000:]}"
    assert "Traceback" not in rally.text()


def _failing_worker(kind: str) -> str:
    """A worker that leaves something hostile at TORCHELASTIC_ERROR_FILE, says so on stderr, and exits 1."""
    return f"""
import os, sys
path = os.environ["TORCHELASTIC_ERROR_FILE"]
kind = {kind!r}
if os.path.lexists(path):  # the empty file the agent made for it (a hostile worker replaces it)
    os.unlink(path)
if kind == "fifo":
    os.mkfifo(path)
elif kind == "dev-zero":
    os.symlink("/dev/zero", path)
else:
    content = {{"list": "[1,2,3]", "string": '"a string"', "nested": "[" * 100_000 + "]" * 100_000,
               "bad-fields": '{{"message": {{"extraInfo": [1], "message": 7}}}}'}}[kind]
    with open(path, "w") as f:
        f.write(content)
print("left a hostile error file", file=sys.stderr, flush=True)
sys.exit(1)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind",
    # A FIFO (a blocking open) and /dev/zero (an endless read) are timing faults; the others are
    # JSON the schema check rejects however busy the CPU is.
    [
        "fifo",
        "dev-zero",
        *(pytest.param(k, marks=pytest.mark.same_under_load) for k in ("list", "string", "nested", "bad-fields")),
    ],
)
def test_a_hostile_error_file_is_reported_as_a_plain_failure(tmp_path: Path, kind: str) -> None:
    write_probe(tmp_path / "probe.py", _failing_worker(kind))
    result = run_rally([*STANDALONE, "probe.py"], cwd=tmp_path, env=clean_env(), timeout=90)
    assert result.returncode == 1, result.describe()
    assert "failed with exit code 1" in result.stderr, result.describe()
    assert "left a hostile error file" in result.stderr, result.describe()  # the stderr tail stands in
    assert "Traceback" not in result.stderr, result.describe()
    assert result.elapsed < 60, result.describe()


PLANTS_FIFOS = """
import os, sys
from pathlib import Path
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    run_dir = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parents[2]
    rank_dir = run_dir / "attempt_1" / "0"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for path in (rank_dir / "stdout.log", rank_dir / "stderr.log", run_dir / "report.json.tmp"):
        os.mkfifo(path)              # an open() for writing blocks until a reader comes
    (rank_dir / "heartbeat").symlink_to("/dev/zero")
    sys.exit(1)
print("second attempt ran", flush=True)
"""


# Same under load: the FIFOs are in place before the worker exits, whenever the agent comes to its
# next attempt's files; what it does with them is a check of the file's type, not a race.
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
@pytest.mark.parametrize("logs", [["--redirects", "3"], ["--tee", "3"]], ids=["redirects", "tee"])
def test_fifos_planted_where_the_agent_writes_next_do_not_wedge_it(tmp_path: Path, logs: list[str]) -> None:
    """A worker that knows the log layout plants FIFOs at the next attempt's log files and at
    report.json's temporary name, then fails: the agent replaces them and goes on."""
    write_probe(tmp_path / "probe.py", PLANTS_FIFOS)
    args = [
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        "--log-dir",
        str(tmp_path / "logs"),
        *logs,
        "probe.py",
    ]
    result = run_rally(args, cwd=tmp_path, env=clean_env(), timeout=90)
    assert result.returncode == 0, result.describe()
    (stdout_log,) = (tmp_path / "logs").glob("*/attempt_1/0/stdout.log")
    assert "second attempt ran" in stdout_log.read_text(), result.describe()


# ------------------------------------------------------------------ nothing the job started outlives it

KINDS = (*LEAVER_KINDS, "tokenless")


def _start_leaver(tmp_path: Path, procs: ProcessTracker, cgroup: str) -> tuple[LiveRally, list[int]]:
    out = tmp_path / "pids"
    out.mkdir()
    write_leaver(tmp_path / "probe.py")
    env = clean_env(PROBE_OUT=str(out), RALLY_JOB_CGROUP=cgroup)
    rally = LiveRally([*STANDALONE, "probe.py", "forever", "--tokenless"], tmp_path, env, procs)
    wait_for(lambda: all((out / f"{k}_0_0").exists() for k in KINDS), 60, what="the worker's descendants")
    pids = round_pids(out, 0, KINDS)
    procs.track(*pids)
    assert not survivors(pids, 0) == [], "the descendants did not start"
    tokenless = psutil.Process(pids[KINDS.index("tokenless")])
    assert "RALLY_AGENT_TOKEN" not in tokenless.environ(), "the probe should have shed the token"
    time.sleep(1.0)  # without a cgroup the guard looks every 0.5 s
    return rally, pids


# "freezer" and "auto" are same under load: what load can change, the guard seeing its agent die, is
# the same code in every kind ("off" runs in the CPU-hog pass), and a frozen cgroup's members are
# killed before they are thawed, so no fork can race the kill however busy the CPU is (as
# test_the_job_cgroup_kills_a_tree_that_left_its_session_and_environment says); "auto" is cgroup
# v2's cgroup.kill (the kernel's, at once) where the machine has v2, as CI's does, else the freezer.
# "pids" kills a list of members that a fork can outrun, and "off" the descendants the guard saw
# (a fork can outrun that too), so both stay in that pass.
SAME_UNDER_LOAD = pytest.mark.same_under_load


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cgroup",
    [pytest.param("auto", marks=SAME_UNDER_LOAD), pytest.param("freezer", marks=SAME_UNDER_LOAD), "pids", "off"],
)
def test_sigkill_of_the_agents_process_group_leaves_no_descendant(
    tmp_path: Path, procs: ProcessTracker, cgroup: str
) -> None:
    """What `timeout -s KILL rally ...` or `kill -9 -PGID` does: the guard leads a session of
    its own, survives, and kills everything, token or not (cgroup v2, v1 freezer, v1 pids, or
    without a cgroup the descendants it saw)."""
    rally, pids = _start_leaver(tmp_path, procs, cgroup)
    os.killpg(rally.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    left = survivors(pids, 5)
    assert not left, f"alive 5 s after SIGKILL of the agent's group ({cgroup}): {describe_pids(left)}"
    print(
        f"MEASURED SIGKILL of the agent's process group ({cgroup}): every descendant gone in "
        f"{time.monotonic() - killed:.2f} s"
    )


# "auto" is same under load, as above: the kernel kills the cgroup's members, tokenless or not, at
# once; "off", where the guard finds the tokenless descendant by what it saw, stays in the CPU-hog pass.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cgroup", [pytest.param("auto", marks=SAME_UNDER_LOAD), "off"])
def test_sigkill_of_the_agent_alone_kills_descendants_without_the_token(
    tmp_path: Path, procs: ProcessTracker, cgroup: str
) -> None:
    rally, pids = _start_leaver(tmp_path, procs, cgroup)
    token = psutil.Process(pids[KINDS.index("worker")]).environ()["RALLY_AGENT_TOKEN"]
    own = Path(f"/proc/{pids[KINDS.index('worker')]}/cgroup").read_text()
    assert token not in own, f"the agent's token is in the job's cgroup name, which every user reads: {own}"
    made = [path for path in Path("/sys/fs/cgroup").glob("*/rally-*-*") if path.name in own]
    assert cgroup != "off" or made == [], made  # off: the descendants the guard saw, no cgroup
    probe = JobCgroup.create(f"probe-{os.getpid()}")
    if probe is not None:
        probe.remove()
    assert cgroup != "auto" or probe is None or made, "auto made no cgroup where the machine allows one"
    os.kill(rally.proc.pid, signal.SIGKILL)
    left = survivors(pids, 5)
    assert not left, f"alive 5 s after SIGKILL of the agent ({cgroup}): {describe_pids(left)}"
    assert eventually(lambda: not any(p.exists() for p in made), 15), f"the job's cgroup was left behind: {made}"


# Same under load: the kernel kills a cgroup's members (cgroup.kill, or frozen then killed) however
# busy the CPU is; the daemon that left the session is in the cgroup before the kill.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["v2", "freezer", "pids"])
def test_the_job_cgroup_kills_a_tree_that_left_its_session_and_environment(kind: str) -> None:
    """agent/guard/job_cgroup.py on its own, each kind: a member's `setsid -f env -i` daemon is killed too."""
    group = JobCgroup.create(f"rally-test-{os.getpid()}-{kind}", (kind,))
    if group is None:
        pytest.skip(f"this machine lets no process create a {kind} cgroup")
    try:
        shell = subprocess.Popen(
            ["/bin/sh", "-c", "setsid -f env -i sleep 600; sleep 600 & exec sleep 600"],
            preexec_fn=lambda: Path(group.procs_file).write_text("0"),
        )
        members = wait_for(lambda: len(group.members()) >= 3 and group.members(), 10, what="three members")
        assert group.kill() == []
        assert shell.wait(timeout=10) == -signal.SIGKILL
        assert not survivors(members, 2), describe_pids(members)
    finally:
        group.kill()
        assert group.remove()


# Same under load: the guard removes the paths when its pipe closes, and the test waits for the
# guard's exit: an order of events, not a deadline.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_the_guard_removes_its_cleanup_paths_once_the_agent_is_gone(tmp_path: Path) -> None:
    """The hook later parts of the job (shared memory, say) use: paths handed to the guard go when
    its pipe closes, however the agent ended; a forgotten one stays."""
    from rally.agent.guard.client import GuardClient

    kept, dropped, directory = tmp_path / "kept", tmp_path / "dropped", tmp_path / "segment"
    kept.write_text("x")
    dropped.write_text("x")
    (directory / "inner").mkdir(parents=True)
    guard = GuardClient(os.urandom(8).hex())
    try:
        for path in (kept, dropped, directory):
            guard.clean_up_at_exit(str(path))
        guard.forget_cleanup(str(kept))
    finally:
        guard.stop()
    assert guard.process.returncode == 0
    assert kept.exists() and not dropped.exists() and not directory.exists()


# Same under load: which cgroups are abandoned is decided from their names and members, no clock.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_an_empty_cgroup_whose_guard_is_gone_is_removed_by_the_next_agent() -> None:
    """A guard SIGKILLed with its agent (a node crash in a test) cannot remove its cgroup; the next
    agent on the machine removes it, and never one whose guard lives or that has members."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = JobCgroup.create(f"rally-{dead.pid}-{os.getpid():x}")
    if abandoned is None:
        pytest.skip("this machine lets no process create a cgroup")
    live = JobCgroup.create(f"rally-{os.getpid()}-{os.getpid():x}")
    assert live is not None
    try:
        from rally.agent.guard.job_cgroup import remove_abandoned

        removed = remove_abandoned(live)
        # an agent starting meanwhile (in a second pytest-xdist worker, say) may remove it first
        assert abandoned.path in removed or not abandoned.path.exists(), removed
        assert not abandoned.path.exists() and live.path.exists() and live.path not in removed, removed
    finally:
        abandoned.remove()
        live.remove()


# ------------------------------------------------------------------ a hostile c10d store
# The endpoint is not this host's to serve (is_host=false): the agent joins what answers there.
HOSTILE_STORE_ARGS = ["--nnodes", "1", "--rdzv-backend", "c10d", "--nproc-per-node", "1", "--no-preflight"]


# Same under load: the store's answer (or its silence) is fixed; the bound is a clock's deadline.
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["huge-value", "silent-wait"])
def test_a_hostile_c10d_store_is_one_line_and_exit_1_never_a_traceback_or_a_hang(tmp_path: Path, mode: str) -> None:
    """A service on the store's port that speaks c10d, but answers a read with a value it says is
    1 TiB long (torch's client: std::bad_alloc, a MemoryError traceback in the agent), or never
    answers a wait nor its CANCEL_WAIT (the agent hung for ever, silent). Now: one line naming the
    store, exit 1, within the wait's own timeout plus read_timeout (2 s here)."""
    require_stranger()
    write_probe(tmp_path / "probe.py", "print('worker ran', flush=True)\n")
    with stranger_process(HOSTILE_C10D + f"hostile_store({mode!r})\n") as hostile:
        assert hostile.stdout is not None
        said = hostile.stdout.readline().split()
        assert said[:1] == ["listening"], hostile.stderr.read() if hostile.poll() is not None else said
        args = [*HOSTILE_STORE_ARGS, "--rdzv-endpoint", f"127.0.0.1:{said[1]}"]
        args += ["--rdzv-conf", "is_host=false,read_timeout=2,join_timeout=20", "probe.py"]
        result = run_rally(args, cwd=tmp_path, env=clean_env(), timeout=90)
    assert result.returncode == 1, result.describe()
    errors = [line for line in result.stderr.splitlines() if "rally: error" in line]
    assert len(errors) == 1 and f"127.0.0.1:{said[1]}" in errors[0], result.describe()
    assert "Traceback" not in result.stderr and "worker ran" not in result.stdout, result.describe()
    assert result.elapsed < 60, result.describe()


# ------------------------------------------------------------------ a hostile etcd gateway
# Same under load: the gateway's reply is fixed; a size cap or the open's deadline decides.
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["nested-object", "list", "wrong-types", "huge-length", "endless-chunked"])
def test_a_hostile_etcd_gateway_is_one_line_and_exit_2_never_a_traceback(tmp_path: Path, shape: str) -> None:
    """What answers on the etcd endpoint replies with JSON nested past the parser, a list, fields
    of the wrong types (past the first request's check: the store's own reads), a 1 TiB
    Content-Length, or a chunked reply that never ends. Before: RecursionError, AttributeError,
    ValueError or MemoryError tracebacks in the agent within a second. Now: one line, exit 2 when
    the first request fails (etcd cannot be used), 1 when a later one does (the store was lost)."""
    require_stranger()
    write_probe(tmp_path / "probe.py", "print('worker ran', flush=True)\n")
    with stranger_process(HOSTILE_ETCD + f"hostile_etcd({shape!r})\n") as gateway:
        assert gateway.stdout is not None
        said = gateway.stdout.readline().split()
        assert said[:1] == ["listening"], gateway.stderr.read() if gateway.poll() is not None else said
        args = ["--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{said[1]}"]
        args += ["--rdzv-id", "hostile", "--rdzv-conf", "read_timeout=3,join_timeout=10", "--nproc-per-node", "1"]
        result = run_rally([*args, "--no-preflight", "probe.py"], cwd=tmp_path, env=clean_env(), timeout=90)
    assert result.returncode == (1 if shape == "wrong-types" else 2), result.describe()
    errors = [line for line in result.stderr.splitlines() if "rally: error" in line]
    assert len(errors) == 1 and f"127.0.0.1:{said[1]}" in errors[0], result.describe()
    assert "Traceback" not in result.stderr and "worker ran" not in result.stdout, result.describe()
    assert result.elapsed < 60, result.describe()
