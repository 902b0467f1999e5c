"""Fault matrix: another user of the node against the job's local surfaces:
the store's lists and keep-alives, the orphan guard, /metrics, the standalone store and
the job's secrets. The attacker is a real other uid (tests/support/stranger.py) wherever it is one; it
speaks c10d's wire protocol with the standard library (tests/support/stranger_store.py).

docs/security.md "Local surfaces" lists what these tests prove.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from support.agents import cluster, job_args, write_script  # noqa: F401 - cluster is a fixture
from support.helpers import (  # noqa: F401
    ProcessTracker,
    clean_env,
    describe_pids,
    eventually,
    kill_group,
    procs,
    run_rally,
    start_rally,
    survivors,
    wait_for,
    write_probe,
)
from support.live_rally import LiveRally
from support.stranger import STRANGER_UID, require_stranger, run_as_stranger, stranger_command, stranger_process
from support.stranger_store import STORE_CLIENT, STORE_PROXY
from test_faults_trust import FAST, RANKS_WORKER, TOKEN, _node, server  # noqa: F401 - server is a fixture

# Raw writes besides tests/support/stranger_store.py's enveloped `put`: what any TCPStore client can send.
RAW_PUT = r"""
def raw_put(port, key, data):
    conn = store(port)
    conn.sendall(bytes([SET]) + _text(b"/" + key.encode()) + _text(data))
    done(conn)
"""


def as_stranger(code: str, timeout: float = 60) -> str:
    """Run `code` as uid 65534 with c10d's wire protocol at hand (standard library only); its stdout."""
    done = run_as_stranger(STORE_CLIENT + RAW_PUT + code, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# ------------------------------------------------------------------ 6. a long unsigned list
@pytest.mark.timeout(180)
def test_a_strangers_long_append_to_the_status_list_does_not_stop_keep_alives(cluster, tmp_path):
    """1.5 MB of lines appended to `status/nodes` used to cost node 0's keep-alive thread two
    store calls per line: keep-alives stopped and both nodes exited 1 blaming the network."""
    require_stranger()
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    env = {"RALLY_JOB_TOKEN": TOKEN, "SLOW_RANK_SECONDS": "10", "OTHER_RANK_SECONDS": "10"}
    agents = [cluster.agent(f"n{i}", [*job_args(store.port, "2"), str(script)], env=env) for i in range(2)]
    assert eventually(lambda: len(cluster.records()) == 2, 90), "\n".join(a.output() for a in agents)
    as_stranger(f"append({store.port}, 'rally/testjob/status/nodes', b''.join(b'n%06d\\n' % i for i in range(190000)))")
    codes = [a.wait(90) for a in agents]
    assert codes == [0, 0], "\n".join(a.output() for a in agents)
    assert all("job succeeded" in a.output() for a in agents)


# ------------------------------------------------------------------ 7. the guard and a recycled id
def _stranger_at(pid: int, code: str) -> int | None:
    """Start `code` as uid 65534 on exactly `pid` (a freed id handed out again, as pid_max wraps):
    through /proc/sys/kernel/ns_last_pid, in a double fork, so it is nobody's child here (not a
    descendant of this process, whose descendants a guard may count as the job's). Its pid, or
    None when another process took the id each time."""
    r, w = os.pipe()
    command, env = stranger_command(code), {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"}
    middle = os.fork()
    if middle == 0:  # pragma: no cover - the forked child
        try:
            os.close(r)
            os.setsid()
            for _ in range(100):
                Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
                child = os.fork()
                if child == 0:
                    os.execvpe(command[0], command, env)
                if child == pid:
                    os.write(w, str(child).encode())
                    break
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    got = os.read(r, 32)
    os.close(r)
    return int(got) if got else None


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


@pytest.mark.timeout(60)
def test_the_guard_never_kills_a_stranger_on_a_recycled_group_id(procs: ProcessTracker) -> None:
    """A worker registered with the guard exits early; its id goes to another user's process,
    which leads a group of that number. The agent is then gone: the guard used to killpg the id."""
    require_stranger()
    from rally.agent.guard.client import GuardClient

    guard = GuardClient(os.urandom(8).hex())
    try:
        worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
        guard.guard_group(worker.pid)  # as the agent does, before the worker can be reaped
        time.sleep(0.7)  # the guard has looked at the job (SEEN_INTERVAL)
        worker.kill()
        worker.wait()
        stranger = _stranger_at(worker.pid, "import os, time\nos.setsid()\ntime.sleep(60)")
        if stranger is None:
            pytest.skip(f"pid {worker.pid} was taken by another process each time")
        procs.track(stranger)
        wait_for(lambda: _stat(stranger)[3] == str(stranger), 10, what="the stranger leads its session")
        assert os.stat(f"/proc/{stranger}").st_uid == STRANGER_UID
    finally:
        guard.stop()
    assert guard.process.returncode == 0
    assert not survivors([stranger], 1.0) == [], "the guard killed another user's process on a recycled id"


# ------------------------------------------------------------------ 15. a root worker leaves the cgroup
ESCAPER = """
import os, sys, time
out = os.environ["PROBE_OUT"]

def leave_the_job_cgroup():
    # write this process into the parent of every rally-* cgroup it is in (as root can)
    mounts = {}
    for line in open("/proc/self/mountinfo"):
        fields, _, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        mounts.setdefault(rest[0], []).append((parts[4], parts[3], set(rest[2].split(",")) if len(rest) > 2 else set()))
    for line in open("/proc/self/cgroup"):
        number, controllers, path = line.strip().split(":", 2)
        if "/rally-" not in path:
            continue
        kinds = mounts.get("cgroup2", []) if number == "0" else [
            m for m in mounts.get("cgroup", []) if set(controllers.split(",")) <= m[2]]
        for mount, root, _ in kinds:
            parent = os.path.join(mount, os.path.relpath(os.path.dirname(path), root))
            with open(os.path.join(parent, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

if os.fork() == 0:
    leave_the_job_cgroup()
    os.setsid()
    if os.fork() == 0:
        env = {"PATH": "/usr/bin:/bin"}          # no RALLY_AGENT_TOKEN
        with open(out + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(out + ".tmp", out)
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"], env)
    os._exit(0)
while True:
    time.sleep(1)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cgroup", ["auto", "freezer", "pids"])  # auto: v2 beside the v1 controllers here
def test_a_root_worker_that_leaves_the_cgroup_session_and_token_dies_with_the_agent(
    tmp_path: Path, procs: ProcessTracker, cgroup: str
) -> None:
    """'No orphans, ever' held only for workers that cannot write the cgroup hierarchy: a root
    worker's daemon moved itself out of the job's cgroup, shed its session and the token, and
    outlived the agent's SIGKILL. The guard now also kills what it saw below the agent."""
    out = tmp_path / "escaped"
    write_probe(tmp_path / "escaper.py", ESCAPER)
    rally = LiveRally(
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "escaper.py"],
        tmp_path,
        clean_env(PROBE_OUT=str(out), RALLY_JOB_CGROUP=cgroup),
        procs,
    )
    wait_for(out.exists, 60, what="the escaped daemon")
    escaped = int(out.read_text())
    procs.track(escaped)
    cgroups = Path(f"/proc/{escaped}/cgroup").read_text()
    assert "/rally-" not in cgroups, cgroups
    assert "RALLY_AGENT_TOKEN" not in psutil.Process(escaped).environ()
    time.sleep(1.0)  # the guard looks every SEEN_INTERVAL (0.5 s)
    os.kill(rally.proc.pid, signal.SIGKILL)
    left = survivors([escaped], 5)
    assert not left, f"alive 5 s after SIGKILL of the agent: {describe_pids(left)}\n{cgroups}"


# ------------------------------------------------------------------ 9. /metrics and idle clients
HALF_OPEN = """
import socket, sys, time
port, count = {port}, {count}
held = []
for _ in range(count):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    held.append(s)
print("open", len(held), flush=True)
deadline = time.monotonic() + 30
closed = 0
while time.monotonic() < deadline and closed < count:
    closed = 0
    for s in held:
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    time.sleep(0.2)
print("closed", closed, round(time.monotonic() - deadline + 30, 1), flush=True)
"""


@pytest.mark.timeout(90)
def test_metrics_keep_serving_and_start_no_thread_under_400_half_open_connections() -> None:
    """Another user opens 400 connections to /metrics and sends nothing: prometheus-client's
    server held a thread per connection for ever (8 -> 89 threads in 12 s; under a pids limit,
    `can't start new thread`). Now: no thread per client, scrapes answered, idle ones dropped."""
    import threading
    import urllib.request

    from rally.agent.observe import metrics

    require_stranger()
    server = metrics.serve(0, lambda: None, lambda: [], "local-surfaces", "127.0.0.1")
    try:
        before = threading.active_count()
        code = HALF_OPEN.format(port=server.port, count=400)
        with stranger_process(code) as attacker:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "open 400", attacker.stderr.read() if attacker.poll() else ""
            threads = threading.active_count()
            for _ in range(3):
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
                    assert b"rally_build_info" in response.read()
            closed = attacker.stdout.readline().split()
            assert closed[:2] == ["closed", "400"], closed
            assert float(closed[2]) < 15, closed  # REQUEST_SECONDS (5 s), on a loaded machine
        assert threads - before <= 1, f"{threads - before} threads started for 400 idle connections"
    finally:
        server.close()


CONNECT_CLOSE_FLOOD = """
import socket, struct, time
port = {port}
end = time.monotonic() + {seconds}
rounds = 0
while time.monotonic() < end:
    held = []
    for _ in range(100):  # more than MAX_CLIENTS (64): the server drops the oldest to make room
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
            s.send(b"GET /metrics HTTP/1.1\\r\\n")  # half a request head: readable, never complete
            held.append(s)
        except OSError:
            pass
    for s in held:
        s.close()
    rounds += 1
print("rounds", rounds, flush=True)
"""


@pytest.mark.timeout(90)
def test_a_connect_close_flood_on_metrics_never_ends_its_server() -> None:
    """Another user connects 100 clients at a time to /metrics, sends half a request head on each
    and resets them all, for 4 s. Before: a client the server had dropped to make room, still in
    the same select()'s answer, was read again: KeyError in `_read`, a traceback on the job's
    console, and the port closed for the rest of the job. Now: no exception leaves the server's
    thread and scrapes are answered during and after the flood."""
    import threading
    import urllib.request

    from rally.agent.observe import metrics

    require_stranger()
    failures: list[str] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(f"{args.thread.name}: {args.exc_type.__name__}")
    server = metrics.serve(0, lambda: None, lambda: [], "flood", "127.0.0.1")
    try:
        with stranger_process(CONNECT_CLOSE_FLOOD.format(port=server.port, seconds=4)) as attacker:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().startswith("rounds"), attacker.stderr.read()
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
                assert b"rally_build_info" in response.read()
        assert server.server.thread.is_alive()
        assert failures == [], failures
    finally:
        threading.excepthook = hook
        server.close()


@pytest.mark.same_under_load  # a default, read once
@pytest.mark.timeout(30)
def test_metrics_listen_on_loopback_unless_opened() -> None:
    """/metrics said the job's hosts, ranks and restarts to the whole network by default (0.0.0.0).
    Now the option's default and the server's are loopback; --metrics-addr opens it."""
    from rally.agent.observe import metrics
    from rally.launcher.options import Options

    assert Options.of({}).metrics_addr == "127.0.0.1"
    server = metrics.serve(0, lambda: None, lambda: [], "loopback")
    try:
        assert server.server.sock.getsockname()[0] == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    finally:
        server.close()
    opened = metrics.serve(0, lambda: None, lambda: [], "opened", "0.0.0.0")
    try:
        assert opened.server.sock.getsockname()[0] == "0.0.0.0"
    finally:
        opened.close()


# ------------------------------------------------------------------ 8, 12. secrets and a job without a token
def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: str):
    """build_launch for a 2-node job on `options` (the checks rally runs at start, in-process)."""
    from rally.launcher.config import build_launch
    from rally.launcher.options import Options

    monkeypatch.delenv("RALLY_JOB_TOKEN", raising=False)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    given = {"nnodes": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:29400", **options}
    return build_launch(Options.of(given), str(script), [])


@pytest.mark.same_under_load  # a file mode and a flag, read once at start
@pytest.mark.timeout(30)
def test_a_token_on_argv_and_loose_secret_files_get_one_warning_line_each(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    token_file.chmod(0o644)
    on_argv = _launch(tmp_path, monkeypatch, rdzv_conf="token=s3cret").warnings
    assert len(on_argv) == 1 and "/proc/*/cmdline" in on_argv[0] and "token_file" in on_argv[0], on_argv
    loose = _launch(tmp_path, monkeypatch, rdzv_conf=f"token_file={token_file}").warnings
    assert loose == [f"--rdzv-conf token_file={token_file} can be read by other users (mode 0644); chmod 600 it"]
    token_file.chmod(0o600)
    assert _launch(tmp_path, monkeypatch, rdzv_conf=f"token_file={token_file}").warnings == []
    password = tmp_path / "etcd-password"
    password.write_text("pw\n")
    password.chmod(0o600)
    etcd = {"rdzv_backend": "etcd", "rdzv_endpoint": "127.0.0.1:2379", "rdzv_id": "job"}
    conf = f"token_file={token_file},username=alice,password_file={password}"
    clear = _launch(tmp_path, monkeypatch, **etcd, rdzv_conf=conf).warnings
    assert len(clear) == 1 and "travels in clear over http://" in clear[0] and "alice" in clear[0], clear
    tls_conf = conf + ",protocol=https"
    assert _launch(tmp_path, monkeypatch, **{**etcd, "rdzv_endpoint": "https://127.0.0.1:2379"}, rdzv_conf=tls_conf)


@pytest.mark.same_under_load  # file modes and owners, read once
@pytest.mark.timeout(30)
def test_the_per_user_secret_is_refused_when_linked_or_foreign_and_loose_modes_are_named(tmp_path, monkeypatch):
    from rally.rendezvous.base.token import TokenError, resolve_token

    monkeypatch.delenv("RALLY_JOB_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / ".rally").symlink_to(elsewhere)
    with pytest.raises(TokenError, match=r"\.rally is a symlink"):
        resolve_token(None, None, False, "7")
    (tmp_path / ".rally").unlink()
    (tmp_path / ".rally").mkdir()
    os.chown(tmp_path / ".rally", STRANGER_UID, STRANGER_UID)
    with pytest.raises(TokenError, match=f"owned by uid {STRANGER_UID}"):
        resolve_token(None, None, False, "7")
    os.chown(tmp_path / ".rally", os.geteuid(), os.getegid())
    (tmp_path / ".rally").chmod(0o777)
    warnings: list[str] = []
    first = resolve_token(None, None, False, "7", warnings)
    assert len(warnings) == 1 and "can be written by other users (mode 0777)" in warnings[0], warnings
    (tmp_path / ".rally").chmod(0o700)
    (tmp_path / ".rally" / "secret").chmod(0o644)
    warnings = []
    assert resolve_token(None, None, False, "7", warnings) == first
    assert len(warnings) == 1 and "secret file" in warnings[0] and "mode 0644" in warnings[0], warnings
    (tmp_path / ".rally" / "secret").chmod(0o600)
    warnings = []
    assert resolve_token(None, None, False, "7", warnings) == first and warnings == []


@pytest.mark.same_under_load  # a line at start, no timing
@pytest.mark.timeout(60)
def test_a_multi_node_job_without_a_token_says_at_start_what_a_stranger_can_do(tmp_path, monkeypatch):
    """c10d outside SLURM and etcd: a forged round end used to end such a job silently."""
    etcd = {"rdzv_backend": "etcd", "rdzv_endpoint": "127.0.0.1:2379", "rdzv_id": "job"}
    (line,) = _launch(tmp_path, monkeypatch, **etcd).warnings
    assert line.startswith("no job token: anyone who can write to etcd at 127.0.0.1:2379 can end this job"), line
    monkeypatch.setenv("RALLY_JOB_TOKEN", "s3cret")
    from rally.launcher.config import build_launch
    from rally.launcher.options import Options

    assert build_launch(Options.of({"nnodes": "2", **etcd}), str(tmp_path / "train.py"), []).warnings == []
    done = run_rally(
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--no-preflight"]
        + ["--rdzv-conf", "join_timeout=1", str(tmp_path / "train.py")],
        cwd=tmp_path,
    )
    said = [line for line in done.stderr.splitlines() if "no job token" in line]
    assert len(said) == 1 and "RALLY_JOB_TOKEN or --rdzv-conf token_file=PATH" in said[0], done.stderr


# ------------------------------------------------------------------ 10. the standalone store
# Every key a running single-node round holds or reads (the status record's name is the node's
# own: a stranger who lists the keys finds it, here it is left out), and the round's end before
# the job writes it.
JOB_KEYS = (
    "0/alive/0 0/end 0/acked/0 current 0/master 0/closed 0/assign/0/0 0/node/0 0/joined 0/closer/0 "
    "job/started host status/nodes"
).split()

SLEEPER = """
import time
print("worker up", flush=True)
time.sleep(8)
print("worker done", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_strangers_garbage_in_every_key_of_a_standalone_store_ends_nothing(
    tmp_path: Path, procs: ProcessTracker
) -> None:
    """Another user finds the --standalone store's loopback port and writes garbage into every
    key of the job (and the round's end before it exists): each rejected value is one line, the
    job goes on and succeeds."""
    require_stranger()
    write_probe(tmp_path / "sleeper.py", SLEEPER)
    rally = LiveRally(["--standalone", "--nproc-per-node", "1", "sleeper.py"], tmp_path, clean_env(), procs)
    rally.wait_line("worker up", 60)
    found = re.search(r"localhost:(\d+) --rdzv-id (\S+)", rally.text())
    assert found, rally.text()
    port, run_id = int(found.group(1)), found.group(2)
    as_stranger("".join(f"raw_put({port}, 'rally/{run_id}/{key}', b'garbage')\n" for key in JOB_KEYS))
    code, _ = rally.wait_exit(60)
    assert code == 0, rally.text()[-4000:]
    assert "job succeeded" in rally.text(), rally.text()[-4000:]
    assert "Traceback" not in rally.text()
    warned = [line for line in rally.text().splitlines() if "rally: warning: store key" in line]
    assert warned and len(warned) == len({line.split("'")[1] for line in warned}), warned  # one line per key


# ------------------------------------------------------------------ barriers that decide
def _member(group_rank: int, members: int = 2):
    from rally.rendezvous.base.records import Assignment

    return Assignment(
        round=0, group_rank=group_rank, group_world_size=members, rank_offset=group_rank, world_size=members,
        restart_count=0, membership_changes=0, watch_rank=None, watch_host="", master_host="a.addr",
    )  # fmt: skip


# Same under load: the forged keys are written between two calls; a signature check decides.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_forged_barrier_keys_open_neither_the_preemption_nor_the_exit_barrier(server) -> None:
    """Another user who reaches the store (no token) sets `0/preempt_all_done`, `0/all_acked` and
    the counters, and writes rally-format records for node 1 under the empty key, after node 0 did
    its part. Before: the flag's existence opened the preemption barrier (node 0 requeued while node
    1 was still saving) and the exit barrier. Now both wait for node 1's own signed record, a forged
    one is one line naming its key, and node 1's genuine records open them."""
    from rally.rendezvous.preemption_barrier import PreemptionBarrier
    from rally.rendezvous.protocol import RendezvousSettings
    from rally.rendezvous.round_channel import RoundChannel

    require_stranger()
    settings = RendezvousSettings(**{**FAST, "max_nodes": 2})
    a, b = _node(server, "a", settings), _node(server, "b", settings)
    lines: list[str] = []
    a.store.on_untrusted = lines.append
    node0 = PreemptionBarrier(a.store, a.me, _member(0)), RoundChannel.of(a.store, settings, a.me, _member(0))
    node1 = PreemptionBarrier(b.store, b.me, _member(1)), RoundChannel.of(b.store, settings, b.me, _member(1))
    node0[0].note_checkpointed()
    node0[1].acknowledge_end()
    record = json.dumps({"node_id": "b:id", "group_rank": 1}).encode()
    as_stranger(
        "".join(f"raw_put({server.port}, 'rally/job/0/{key}', b'1')\n" for key in FLAGS_AND_COUNTERS)
        + "".join(f"put({server.port}, 'rally/job/0/{key}/1', {record!r})\n" for key in ("preempt_done", "acked"))
    )
    assert not node0[0].wait_all_checkpointed(1.0), "a stranger's keys opened the preemption barrier"
    assert not node0[1].wait_all_acknowledged(1.0), "a stranger's keys opened the exit barrier"
    assert any("'rally/job/0/preempt_done/1'" in line and "different job token" in line for line in lines), lines
    node1[0].note_checkpointed()
    node1[1].acknowledge_end()
    assert node0[0].wait_all_checkpointed(5) and node0[1].wait_all_acknowledged(5)


FLAGS_AND_COUNTERS = ("preempt_all_done", "preempt_done", "all_acked", "acked")


# ------------------------------------------------------------------ a stranger's store on the endpoint's port
ONE_LINE = "print('the job ran', flush=True)\n"


@pytest.mark.same_under_load  # who owns a socket, and what a marker is signed with
@pytest.mark.timeout(180)
def test_a_store_another_user_listens_on_first_is_joined_only_when_it_proves_it_is_the_jobs(tmp_path: Path) -> None:
    """Another user listens on the endpoint's port first and relays to a store holding the constant
    `rally store` marker (unsigned). Before: the root agent, with a job token, joined it without a
    line and ran the job through the stranger. Now: the listener's owner (uid 65534, from
    /proc/net/tcp) is neither the job's user nor root, so the unsigned marker is not enough: one
    line, exit 2, nothing run. A marker signed with the job's token (`rally store` run with
    RALLY_JOB_TOKEN signs it) proves the store is the job's: the agent joins through the same relay,
    one line naming the store and its listener."""
    from rally.rendezvous.c10d.store import SERVICE_MARKER_KEY, SERVICE_MARKER_VALUE, host_tcp_store

    require_stranger()
    real = host_tcp_store(0, 30, loopback_only=True)
    real.set(SERVICE_MARKER_KEY, SERVICE_MARKER_VALUE)  # what `rally store` writes without a token
    script = write_script(tmp_path, "one.py", ONE_LINE)
    env = clean_env(RALLY_JOB_TOKEN=TOKEN)
    with stranger_process(STORE_PROXY + f"proxy({real.port})\n") as relay:
        assert relay.stdout is not None
        said = relay.stdout.readline().split()
        assert said[:1] == ["listening"], relay.stderr.read() if relay.poll() is not None else said
        port = int(said[1])
        refused = run_rally([*job_args(port, "1"), str(script)], cwd=tmp_path, env=env, timeout=120)
        assert refused.returncode == 2, refused.describe()
        errors = [line for line in refused.stderr.splitlines() if "rally: error" in line]
        assert len(errors) == 1 and f"uid {STRANGER_UID}" in errors[0], refused.describe()
        assert "not signed with this job's token" in errors[0] and "will not join" in errors[0], errors
        assert "the job ran" not in refused.stdout and "Traceback" not in refused.stderr, refused.describe()
    del real
    log = tmp_path / "store.log"
    with open(log, "w") as out:
        signed = start_rally(["store", "--port", "0"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        found = eventually(lambda: re.search(r"listening on port (\d+)", log.read_text()), 60)
        assert found, log.read_text()
        with stranger_process(STORE_PROXY + f"proxy({found.group(1)})\n") as relay:
            assert relay.stdout is not None
            port = int(relay.stdout.readline().split()[1])
            joined = run_rally([*job_args(port, "1"), str(script)], cwd=tmp_path, env=env, timeout=120)
    finally:
        kill_group(signed.pid)
        signed.wait(timeout=10)
    assert joined.returncode == 0 and "the job ran" in joined.stdout, joined.describe()
    text = joined.stdout + joined.stderr
    line = [x for x in text.splitlines() if "joined the `rally store`" in x]
    assert len(line) == 1 and f"127.0.0.1:{port}" in line[0] and f"uid {STRANGER_UID}" in line[0], text
    assert "signed with this job's token" in line[0], line
