"""In-process restarts (`rally.job.run`, docs/restartable.md): a failure re-enters the training
function in the workers' own processes instead of restarting them.

Real rally, real workers (two ranks on gloo, a tiny DDP model), the node's memory tier. Each
fault is compared with an uninterrupted run of the same script: the final parameters must be
bit-identical, and the survivors' pids unchanged (a whole restart, what rally did before
job.run existed, gives the same parameters but new pids, so these tests fail without re-entry).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from support.agents import AgentProcess, StoreProcess, c10d_args, start_agent, stop_all
from support.helpers import (
    clean_env,
    eventually,
    free_port,
    kill_group,
    rally_status,
    read_events,
    run_rally,
    start_rally,
)
from support.once_per_run import once_per_run

pytestmark = pytest.mark.torch

TRAIN = textwrap.dedent(
    """
    import ctypes, glob, hashlib, json, os, signal, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job
    from rally.agent.base.reentry_wire import INTERRUPT_SIGNAL

    OUT = Path(os.environ["OUT"])
    FAULT = os.environ.get("FAULT", "")
    OWN_INIT = os.environ.get("OWN_INIT") == "1"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)  # built once, before job.run: it survives every re-entry
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    if not OWN_INIT:
        dist.init_process_group("gloo")  # rally makes it again before each later entry
    entries = 0
    gloo_threads = []  # at each entry's start: an old round's group left alive shows here

    def gloo_runloops():
        names = []
        for path in glob.glob("/proc/self/task/*/comm"):
            try:
                names.append(Path(path).read_text().strip())
            except OSError:
                pass  # the thread ended meanwhile
        return names.count("pt_gloo_runloop")

    def train(steps):
        global entries
        entries += 1
        gloo_threads.append(gloo_runloops())
        if OWN_INIT:
            dist.init_process_group("gloo")
        ctx = job.context()
        print(f"entry {entries} of pid {os.getpid()}", flush=True)  # where its logs go (docs/restartable.md)
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # holds the group: built per entry
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ckpt = job.load_latest()
        start = 0
        if ckpt is not None:
            model.load_state_dict(ckpt.state["model"])
            opt.load_state_dict(ckpt.state["opt"])
            start = ckpt.step
        for step in range(start + 1, steps + 1):
            x = data[(step * 4) % 64 : (step * 4) % 64 + 4]
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()
            job.heartbeat(step)
            line = [step, entries, os.getpid(), time.monotonic(), ctx.world_size, os.environ["MASTER_PORT"]]
            with open(OUT / f"steps.{ctx.rank}", "a") as f:
                f.write(" ".join(map(str, line)) + "\\n")
            if step % 3 == 0:
                job.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
            kind, _, rest = FAULT.partition(":")
            at, _, who = rest.partition(":")
            if kind and step == int(at) and ctx.rank == int(who) and not (OUT / "fault.done").exists():
                (OUT / "fault.done").write_text(str(time.monotonic()))
                if kind == "sigkill":
                    os.kill(os.getpid(), 9)
                while kind == "stuck":  # in C holding the GIL, the interrupt blocked: not even the
                    signal.pthread_sigmask(signal.SIG_BLOCK, {INTERRUPT_SIGNAL})  # control thread runs
                    ctypes.PyDLL(None).sleep(3600)  # (another signal, the stack dump's, returns it early)
                while kind in ("hang", "stuck", "lost"):  # hang: the interrupt raises at the next bytecode;
                    time.sleep(1)  # lost: the test kills this rank's whole node (its agent and workers)
                raise ValueError(f"injected at step {step}")
        deadline = time.monotonic() + 120
        while os.environ.get("HOLD") and entries > 1 and not (OUT / "release").exists():
            assert time.monotonic() < deadline, "never released"  # a test reads rally status meanwhile
            job.heartbeat(steps)
            time.sleep(0.05)
        params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        result = {"digest": hashlib.sha256(params).hexdigest(), "entries": entries, "pid": os.getpid(),
                  "gloo_threads": gloo_threads}
        (OUT / f"result.{ctx.rank}").write_text(json.dumps(result))
        if OWN_INIT:
            dist.destroy_process_group()

    job.run(train, 12)
    """
)


def _run(tmp: Path, name: str, *flags: str, **env: str) -> tuple[subprocess.CompletedProcess | object, Path, Path]:
    out, logs = tmp / name, tmp / f"{name}-logs"
    out.mkdir()
    script = tmp / "train.py"
    script.write_text(TRAIN)
    argv = ["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(logs), *flags, str(script)]
    result = run_rally(argv, cwd=tmp, env=clean_env(OUT=str(out), **env), timeout=150)
    assert result.returncode == 0, result.describe()
    return result, out, logs


def _steps(out: Path, rank: int) -> list[list[str]]:
    return [line.split() for line in (out / f"steps.{rank}").read_text().splitlines()]


def _rank_1_replaced_and_rank_0_re_entered(result, out: Path, clean_digest: str) -> tuple[dict, dict]:
    """Rank 0 entered twice in one process, rank 1 ran in two processes (the new one entered once),
    and both ended bit-identical to the clean run; their result records."""
    survivor = json.loads((out / "result.0").read_text())
    replaced = json.loads((out / "result.1").read_text())
    assert survivor["digest"] == replaced["digest"] == clean_digest, result.describe()
    assert survivor["entries"] == 2, result.describe()  # rank 0 stayed in its process and entered again
    assert {line[2] for line in _steps(out, 0)} == {str(survivor["pid"])}, "the survivor's pid changed"
    gone = {line[2] for line in _steps(out, 1)} - {str(replaced["pid"])}
    assert len(gone) == 1 and replaced["entries"] == 1, "rank 1 was not replaced by a new process"
    return survivor, replaced


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The uninterrupted run's digest, made once per test run: tests/test_inprocess_doubt.py
    compares against the same clean run of TRAIN (one torch job, not one per module)."""

    def run() -> str:
        _, out, _ = _run(tmp_path_factory.mktemp("clean"), "clean")
        return json.loads((out / "result.0").read_text())["digest"]

    return str(once_per_run(tmp_path_factory, "inprocess-clean-digest", run))


def _the_exception_re_entered(stderr: str, describe: str, out: Path, logs: Path, clean_digest: str, own_init: bool):
    """FAULT=exception:5:1: every rank entered the function again in its own process, resumed
    from the step-3 checkpoint with a new round's group, and ended bit-identical to the clean run;
    the exception is the root cause (rally's `stderr`), one in-process restart in the events."""
    for rank in (0, 1):
        done = json.loads((out / f"result.{rank}").read_text())
        assert done["digest"] == clean_digest, f"rank {rank} did not resume bit-identically\n{describe}"
        assert done["entries"] == 2, describe  # entered again, not restarted
        steps = _steps(out, rank)
        assert {line[2] for line in steps} == {str(done["pid"])}, "a survivor's pid changed"
        first, second = [s for s in steps if s[1] == "1"], [s for s in steps if s[1] == "2"]
        assert second[0][0] == "4", "the second entry did not resume from the step-3 checkpoint"
        assert first[-1][5] != second[0][5], "the second entry reused the old round's MASTER_PORT"
        # no thread of the first round's group at the second entry (the function's own group is not
        # made yet; rally's is the new round's: 2 threads, or fewer not yet named). torch.distributed.nn
        # .functional, imported at the optimizer's first step, held the first round's group in its
        # functions' defaults (4 here before).
        assert done["gloo_threads"][1] <= (0 if own_init else 2), f"rank {rank}: {done['gloo_threads']}"
    # the exception, with its rank and traceback, is the root cause
    assert "root cause: rank 1 (local rank 1, pid" in stderr, describe
    assert "raised ValueError: injected at step 5" in stderr
    assert 'raise ValueError(f"injected at step {step}")' in stderr
    assert "re-entering the training function in every worker (restart 1 of 2)" in stderr
    events = read_events(logs)
    restarts = [e for e in events if e["event"] == "restart"]
    assert [e["in_process"] for e in restarts] == [True], restarts
    assert any(e["event"] == "worker_raised" and e["rank"] == 1 for e in events)
    report = json.loads(next(logs.glob("*/report.json")).read_text())
    assert report["attempts"][0]["recovery"] == "in-process"
    assert report["attempts"][0]["end"]["info"]["traceback"].rstrip().endswith("ValueError: injected at step 5")


# The same fault with rally initialising the group (OWN_INIT unset) was this test's other
# parametrization, a job of its own: it is checked on test_status_and_metrics_mark_an_in_process_restart's
# job, which is that job (the same script and fault; only held at its end until the test has read
# `rally status`, and its output tee'd to files), so one torch job of two workers is spared.
@pytest.mark.timeout(400)
def test_an_exception_re_enters_the_function_in_the_same_processes(tmp_path: Path, clean_digest: str) -> None:
    result, out, logs = _run(tmp_path, "fault", FAULT="exception:5:1", OWN_INIT="1")
    _the_exception_re_entered(result.stderr, result.describe(), out, logs, clean_digest, own_init=True)


@pytest.mark.timeout(400)
def test_status_and_metrics_mark_an_in_process_restart(tmp_path: Path, clean_digest: str) -> None:
    """`rally status` (its table, --json, and once the job is over) and /metrics tell an in-process
    restart from a whole one (without the mark, a restart that kept every process looks like any);
    the re-entered workers' output stays in their first attempt's files, as documented. And what
    test_an_exception_re_enters_the_function_in_the_same_processes checks, with rally initialising
    the group (_the_exception_re_entered, on rally's stderr)."""
    out, logs = tmp_path / "fault", tmp_path / "fault-logs"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    args = ["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(logs), "--metrics-port", "0"]
    args += ["--tee", "3", str(script)]  # the workers' output in files too: where a re-entered one's goes
    stdout, stderr = tmp_path / "held.log", tmp_path / "held.stderr"
    with open(stdout, "w") as out_file, open(stderr, "w") as err_file:  # the child keeps its own descriptors
        env = clean_env(OUT=str(out), FAULT="exception:5:1", HOLD="1")
        agent = AgentProcess("held", start_rally(args, cwd=tmp_path, env=env, stdout=out_file, stderr=err_file), stdout)

    def output() -> str:
        return stdout.read_text(errors="replace") + stderr.read_text(errors="replace")

    try:
        served = r"Prometheus metrics at http://\S+:(\d+)/metrics"
        assert eventually(lambda: re.search(served, output()), 90), output()
        port = int(re.search(served, output()).group(1))  # type: ignore[union-attr]

        def in_process_record() -> dict | None:  # node 0's view, refreshed every 2 s
            done = rally_status([str(logs), "--json"], Path("/"))
            record = json.loads(done.stdout) if done.returncode == 0 else {}
            nodes = record.get("nodes") or [{}]
            return record if nodes[0].get("round") == 1 and nodes[0].get("in_process_restarts") == 1 else None

        record = eventually(in_process_record, 120)
        assert record, rally_status([str(logs), "--json"], Path("/")).stdout + output()
        assert record["nodes"][0]["restart_count"] == 1
        assert record["last_restart"]["kind"] == "worker_failed" and record["last_restart"]["recovery"] == "in-process"
        table = rally_status([str(logs)], Path("/"))
        assert re.search(r"│ 1 \(1 in-process\)\s*│", table.stdout), table.describe()
        assert "last restart: round 0 ended (worker_failed, in-process): rank 1" in table.stdout, table.stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert re.search(r'^rally_restarts_total\{run_id="[^"]+"\} 1\.0$', metrics, re.M), metrics
        assert re.search(r'^rally_in_process_restarts_total\{run_id="[^"]+"\} 1\.0$', metrics, re.M), metrics
        (out / "release").touch()
        assert agent.wait(120) == 0, output()
    finally:
        stop_all([agent])
    _the_exception_re_entered(stderr.read_text(errors="replace"), output()[-8000:], out, logs, clean_digest, False)
    # A re-entered worker's output stays in the files of the attempt its process started in (docs/restartable.md)
    (run_dir,) = logs.glob("*/")
    for rank in (0, 1):
        first = (run_dir / "attempt_0" / str(rank) / "stdout.log").read_text()
        assert "entry 1 of pid" in first and "entry 2 of pid" in first, first
        assert not (run_dir / "attempt_1" / str(rank) / "stdout.log").exists()
    done = rally_status([str(logs)], Path("/"))  # over: from events.jsonl
    assert "last restart: round 0 ended (worker_failed, in-process): rank 1" in done.stdout, done.describe()
    record = json.loads(rally_status([str(logs), "--json"], Path("/")).stdout)
    assert record["source"] == "run_dir" and record["last_restart"]["recovery"] == "in-process", record


@pytest.mark.timeout(300)
def test_a_killed_rank_is_replaced_and_the_survivor_re_enters(tmp_path: Path, clean_digest: str) -> None:
    result, out, logs = _run(tmp_path, "fault", FAULT="sigkill:5:1")
    survivor, replaced = _rank_1_replaced_and_rank_0_re_entered(result, out, clean_digest)
    assert "failed with SIGKILL" in result.stderr and "re-entering the training function" in result.stderr
    events = read_events(logs)
    assert [e["in_process"] for e in events if e["event"] == "restart"] == [True]
    started = [e for e in events if e["event"] == "worker_started" and e["round"] == 1]
    assert [(e["rank"], e["pid"]) for e in started] == [(1, replaced["pid"])], started


@pytest.mark.timeout(300)
def test_a_hung_rank_is_interrupted_and_every_rank_re_enters(tmp_path: Path, clean_digest: str) -> None:
    # 8 s: a worker's exit after its last heartbeat (torch's finalisation) must not look like a hang
    result, out, logs = _run(tmp_path, "fault", "--heartbeat-timeout", "8", FAULT="hang:5:1")
    for rank in (0, 1):
        done = json.loads((out / f"result.{rank}").read_text())
        assert done["digest"] == clean_digest, result.describe()
        assert done["entries"] == 2, result.describe()
        assert {line[2] for line in _steps(out, rank)} == {str(done["pid"])}, "a pid changed"
    assert "is hung" in result.stderr and "re-entering the training function" in result.stderr, result.describe()
    events = read_events(logs)
    assert [(e["kind"], e["in_process"]) for e in events if e["event"] == "restart"] == [("worker_hung", True)]


@pytest.mark.timeout(300)
def test_a_rank_that_cannot_be_interrupted_is_killed_and_replaced_and_the_survivor_re_enters(
    tmp_path: Path, clean_digest: str
) -> None:
    """Rank 1 hangs in a C call that holds the GIL, with the agent's interrupt signal blocked: neither
    the signal nor its own control thread can get it out. Rank 0, waiting for it in DDP's all-reduce,
    is released by its control thread (the entry's connections shut down RELEASE_SECONDS after the
    abort) and parks; rank 1 is killed after PARK_SECONDS and a new process takes its place. Rank 0
    re-enters in its own process (the heartbeat timeout names it the hung rank: it is the first
    silent one, and its stack is in autograd's engine, not in a torch.distributed frame)."""
    result, out, logs = _run(tmp_path, "fault", "--heartbeat-timeout", "8", FAULT="stuck:5:1")
    survivor, replaced = _rank_1_replaced_and_rank_0_re_entered(result, out, clean_digest)
    line = "rank 1 did not leave the training function within 10 s: killing it; a new process takes its place"
    assert line in result.stderr and "re-entering the training function" in result.stderr, result.describe()
    assert "restarting the worker processes instead" not in result.stderr, result.describe()
    events = read_events(logs)
    assert [(e["kind"], e["in_process"]) for e in events if e["event"] == "restart"] == [("worker_hung", True)]
    assert [e["replaced"] for e in events if e["event"] == "workers_parked"] == [1], events
    started = [e for e in events if e["event"] == "worker_started" and e["round"] == 1]
    assert [(e["rank"], e["pid"]) for e in started] == [(1, replaced["pid"])], started
    reentered = [e for e in events if e["event"] == "worker_reentered"]
    assert [(e["rank"], e["pid"]) for e in reentered] == [(0, survivor["pid"])], reentered


@pytest.mark.timeout(300)
def test_a_lost_node_leaves_the_survivor_re_entering_in_the_smaller_world(tmp_path: Path, clean_digest: str) -> None:
    """Two nodes (two agents on loopback, one worker each, a standalone `rally store`, --nnodes 1:2).
    Rank 1's whole node is SIGKILLed (agent and worker) while rank 0 waits for it in DDP's all-reduce:
    rank 0 re-enters in its own process in a world of one and finishes bit-identical to the clean
    two-rank run. Every rank trains on the same batch, so DDP's average of identical gradients is
    each one exactly (halving and doubling are exact): the result does not depend on the world size."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    store = StoreProcess(tmp_path)
    # a long last call: round 0 is both nodes even when the machine is slow to start the second (it
    # forms as soon as both are there; the round after the loss does not wait for it)
    args = [*c10d_args(store.port, "1:2", extra_conf="last_call_timeout=20"), "--nproc-per-node", "1"]
    args += ["--max-restarts", "2"]
    env = {"OUT": str(out), "FAULT": "lost:5:1"}
    agents = [
        start_agent(f"n{i}", tmp_path, [*args, "--log-dir", str(tmp_path / f"logs{i}"), str(script)], env)
        for i in (0, 1)
    ]
    try:
        assert eventually(lambda: (out / "fault.done").exists(), 120), "\n".join(a.output() for a in agents)
        rank1_pid = int(_steps(out, 1)[-1][2])
        victim = next(a for a in agents if rank1_pid in {p.pid for p in a.descendants()})
        survivor_agent = next(a for a in agents if a is not victim)
        victim.kill_node()
        assert survivor_agent.wait(120) == 0, survivor_agent.output()
    finally:
        stop_all(agents)
        store.stop()
    text = survivor_agent.output()
    done = json.loads((out / "result.0").read_text())
    assert done["digest"] == clean_digest, text
    assert done["entries"] == 2, text  # entered again in its process, not restarted
    steps = _steps(out, 0)
    assert {line[2] for line in steps} == {str(done["pid"])}, "the survivor's pid changed"
    first, second = [s for s in steps if s[1] == "1"], [s for s in steps if s[1] == "2"]
    assert {s[4] for s in first} == {"2"} and {s[4] for s in second} == {"1"}, "the world did not shrink to one"
    assert not (out / "result.1").exists(), "rank 1's node was not lost"
    # the node's loss is the root cause, not rank 0's "connection closed" that came first; no restart spent
    assert re.search(r"root cause: node 1 .*sent no keep-alive", text), text
    assert "re-forming the job" in text and "restart 0/2" in text.split("round 1:")[1], text
    logs = tmp_path / ("logs0" if survivor_agent is agents[0] else "logs1")
    events = read_events(logs)
    ends = [(e["event"], e["kind"], e["in_process"]) for e in events if e["event"] in ("restart", "membership_change")]
    assert ends == [("membership_change", "node_lost", True)], ends
    reentered = [e for e in events if e["event"] == "worker_reentered"]
    assert [(e["rank"], e["pid"]) for e in reentered] == [(0, done["pid"])], reentered


LEAK = textwrap.dedent(
    """
    import collections, ctypes, gc, json, os, sys, threading, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from rally import job

    OUT = Path(os.environ["OUT"])
    ENTRIES = int(os.environ["ENTRIES"])
    TORCH_ERROR_ENTRY = 10
    dist.init_process_group("gloo")  # rally makes it again before each later entry
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = None  # the last entry's wrapper, kept between entries as a script keeps it for evaluation
    entries = 0

    def descriptors_now():
        kinds = collections.Counter()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # the listing's own descriptor
            kinds[target.split(":")[0] if ":" in target else target] += 1
        return dict(kinds)

    def descriptors():
        # at the 5th and the last entry the fewest of 10 reads 20 ms apart: the resume prefetch's
        # thread may still hold the round's checkpoint open (2 memfds) as the entry begins, on a
        # loaded machine (2 reads in 14 runs); a leaked descriptor is in every read
        reads = [descriptors_now()]
        while entries in (5, ENTRIES) and len(reads) < 10:
            time.sleep(0.02)
            reads.append(descriptors_now())
        return min(reads, key=lambda kinds: sum(kinds.values()))

    def tasks():
        # every thread, torch's C++ ones too. At the 5th and the last entry the fewest of 10 looks
        # 20 ms apart: a thread that finished (the last teardown's, joined) may not have left the
        # kernel's list yet on a loaded machine (up to 7 reads in 50 counted one more).
        counts = [len(os.listdir("/proc/self/task"))]
        while entries in (5, ENTRIES) and len(counts) < 10:
            time.sleep(0.02)
            counts.append(len(os.listdir("/proc/self/task")))
        return min(counts)

    def hook_depth():
        # how many times torch's init_process_group has wrapped sys.excepthook (once per call)
        hook, depth = sys.excepthook, 0
        while getattr(hook, "__name__", "") == "_distributed_excepthook":
            depth += 1
            hook = next(c.cell_contents for c in hook.__closure__ if callable(c.cell_contents))
        return depth

    def anonymous_rss():
        # the resident memory the process holds (heap, arenas, stacks): RssAnon, in bytes. Not the
        # pages of the libraries' code and unwind tables that a first error path faults in (RssFile:
        # 1-3 MB at the entry whose collective first fails; shared, and dropped when memory is short)
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    def train():
        global ddp, entries
        entries += 1
        ctx = job.context()
        row = {
            "entry": entries,
            "pid": os.getpid(),
            "fds": descriptors(),
            "tasks": tasks(),
            "threads": sorted(t.name for t in threading.enumerate()),
            "shm": sum("/dev/shm/" in line or "/memfd:" in line for line in open("/proc/self/maps")),
            "rss": anonymous_rss(),
            "excepthook": hook_depth(),
            "frozen": gc.get_freeze_count(),  # what rally's gc.freeze keeps: never collected while train runs
        }
        with open(OUT / f"entries.{ctx.rank}", "a") as f:
            f.write(json.dumps(row) + "\\n")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            ddp(torch.ones(4, 8)).sum().backward()
            opt.step()
        job.save({"model": model.state_dict()}, entries)  # progress: each re-entry follows a newer checkpoint
        job.wait_saved()
        dist.barrier()
        if entries == TORCH_ERROR_ENTRY and ctx.rank == 0:
            # once, rank 0 fails first, inside torch.distributed (an invalid root): its failure
            # report's traceback has frames of distributed_c10d.py, as a collective's error has
            dist.broadcast(torch.zeros(1), src=ctx.world_size)
        if entries < ENTRIES and ctx.rank == 1 and entries != TORCH_ERROR_ENTRY:
            raise ValueError(f"entry {entries}")  # rank 0 waits in the barrier below: rally releases it
        if entries <= 5 and ctx.rank == 0:
            # up to the 5th entry, rank 0 waits outside any collective (rally's abort interrupts
            # the sleep): its barrier's own error on rank 1's teardown, which now and then comes
            # before the abort, would make its first failure report before the 5th entry
            time.sleep(60)
        dist.barrier()

    job.run(train)
    """
)

# torch's c10d flight recorder keeps the last TORCH_FR_BUFFER_SIZE collectives of the process
# (2000 by default), each with its Python stack (~1.7 KB), in one ring that no group's destruction
# frees: a job fills it at the same pace with or without re-entries (8 collectives an entry here:
# 12-14 KB an entry for 250 entries). A ring of 16 is full by the 3rd entry, so what grows from
# the 5th is what re-entries leave.
FLIGHT_RECORDER_RING = "16"
# Objects rally's gc.freeze (job.run, at each entry) may add from the 5th entry to the 50th.
# Measured: -12 to +28 (caches filled once, after the 5th); before the collection ahead of each
# freeze, every re-entry froze the cycles it made for good (the resume prefetch's torch.load
# class, a ctypes library), 20-23 objects an entry: about 1,000.
FROZEN_SLACK = 100
# Anonymous RSS may grow this much from the 5th entry to the 50th: NOT the "no higher",
# which torch 2.13 does not allow (every entry makes a new gloo group, and torch keeps 512 B of each).
# Measured on this 2-core machine (per rank, 45 entries, 20 runs of this test, two at a time):
# +60 to +104 KiB, 1.3-2.3 KB an entry: what is kept plus the pages it pins, half as much again
# allowed. What each entry keeps, by call site (`python -m bench.reentry_heap`, heaptrack): torch
# 512 B (c10d's RankLocal<WorkRegistry>, ProcessGroupGloo's constructor, the flight recorder),
# everything else 0 B: Python objects, rally's code, and the round's new MASTER_PORT, RALLY_ROUND and
# TORCHELASTIC_RESTART_COUNT (135 B an entry kept by glibc's setenv until agent/worker_side/round_env.py).
# The bound catches what the code did before (bench/results/restartable-history.md): a new thread an
# entry for the teardown and another for the resume prefetch spread what each round keeps over ten
# glibc arenas, a page pinned per chunk (agent/base/kept_threads.py), and each answer of the
# checkpoint holder was received into a new 64 KiB allocation: up to +408 KiB, its larger rank
# above this bound in 22 of 24 runs. And rank 0's error at the 10th entry made its failure report
# read torch's distributed_c10d.py whole into linecache, whose high-water mark Python's allocator
# kept for life (+1060 to +1084 KiB at the 50th in 3 runs of that code). Not measured: the
# libraries' code and unwind tables a first error path faults in (RssFile, 1-3 MB once; shared with
# every process mapping them, dropped when memory is short).
RSS_SLACK = 160 << 10


@pytest.mark.timeout(300)
def test_fifty_re_entries_leak_no_descriptors_threads_or_memory(tmp_path: Path) -> None:
    entries = 50
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    script = tmp_path / "leak.py"
    script.write_text(LEAK)
    argv = ["--nproc-per-node", "2", "--max-restarts", str(entries), "--log-dir", str(logs), str(script)]
    env = clean_env(OUT=str(out), ENTRIES=str(entries), TORCH_FR_BUFFER_SIZE=FLIGHT_RECORDER_RING)
    result = run_rally(argv, cwd=tmp_path, env=env, timeout=280)
    assert result.returncode == 0, result.describe()
    assert "did not leave the training function" not in result.stderr, result.describe()
    raised = [(e["round"], e["rank"]) for e in read_events(logs) if e["event"] == "worker_raised"]
    assert (9, 0) in raised, f"rank 0's error in torch.distributed at the 10th entry was not reported: {raised}"
    for rank in (0, 1):
        rows = [json.loads(line) for line in (out / f"entries.{rank}").read_text().splitlines()]
        assert [row["entry"] for row in rows] == list(range(1, entries + 1)), f"rank {rank} was restarted"
        assert {row["pid"] for row in rows} == {rows[0]["pid"]}, f"rank {rank} was restarted, not re-entered"
        fifth, last = rows[4], rows[-1]
        assert last["fds"] == fifth["fds"], f"rank {rank}: descriptors {fifth['fds']} -> {last['fds']}"
        assert last["tasks"] == fifth["tasks"], f"rank {rank}: threads went from {fifth['tasks']} to {last['tasks']}"
        assert last["threads"] == fifth["threads"], (
            f"rank {rank}: Python threads {fifth['threads']} -> {last['threads']}"
        )
        assert last["shm"] == fifth["shm"], (
            f"rank {rank}: shared-memory mappings went from {fifth['shm']} to {last['shm']}"
        )
        # torch's init_process_group wraps sys.excepthook on every call: a chain one longer each entry
        hooks = last["excepthook"]
        assert hooks == fifth["excepthook"], f"rank {rank}: sys.excepthook wrapped {hooks} times"
        frozen = last["frozen"] - fifth["frozen"]
        assert frozen <= FROZEN_SLACK, f"rank {rank}: {frozen} more objects frozen at the 50th entry than at the 5th"
        growth = last["rss"] - fifth["rss"]
        assert growth <= RSS_SLACK, (
            f"rank {rank}: anonymous RSS grew {growth >> 10} KiB from the 5th entry to the 50th "
            f"({RSS_SLACK >> 10} allowed)"
        )


@pytest.mark.timeout(300)
def test_a_warm_spare_takes_a_killed_ranks_place(tmp_path: Path, clean_digest: str) -> None:
    result, out, logs = _run(tmp_path, "fault", "--warm-spares", "1", FAULT="sigkill:5:1")
    survivor = json.loads((out / "result.0").read_text())
    promoted = json.loads((out / "result.1").read_text())
    assert survivor["digest"] == promoted["digest"] == clean_digest, result.describe()
    assert survivor["entries"] == 2, result.describe()
    events = read_events(logs)
    spares = [e["pid"] for e in events if e["event"] == "spare_started"]
    assert promoted["pid"] == spares[0], f"rank 1 is pid {promoted['pid']}, not the spare started first ({spares})"
    assert [e["pid"] for e in events if e["event"] == "spare_promoted"] == [spares[0]]
    assert len(spares) == 2, "no new spare was started after the first one took a rank's place"
    assert not [e for e in events if e["event"] == "worker_started" and e["round"] == 1], "a worker was forked anyway"


# The NCCL path of the teardown between two entries (agent/worker_side/restartable.py `teardown`),
# on a real NCCL group of two processes, one GPU each: a collective its peer never joins is released
# by the communicators' abort (else the teardown's synchronize would hang past its bound), the
# process group is gone, the CUDA context and the tensors the script holds stay, the allocator's
# cache is given back, and a new round's group on a fresh port works with the same tensors.
NCCL_TEARDOWN = textwrap.dedent(
    """
    import os, time
    import torch
    import torch.distributed as dist
    from rally.agent.worker_side import restartable

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    kept = torch.ones(1 << 20, device="cuda")  # the script's model: it survives the teardown
    dist.all_reduce(kept)
    torch.cuda.synchronize()
    assert kept[0].item() == 2
    cached = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del cached  # freed into the allocator's cache: the teardown gives it back to the device
    reserved = torch.cuda.memory_reserved()
    if rank == 1:  # the peer never joins: only the communicator's abort ends this kernel
        dist.all_reduce(torch.ones(1, device="cuda"))
    started = time.monotonic()
    why = restartable.teardown()
    took = time.monotonic() - started
    assert why is None, why
    assert not dist.is_initialized(), "the process group survived the teardown"
    assert torch.cuda.is_initialized() and kept[0].item() == 2, "the CUDA context or the script's tensor was lost"
    after = torch.cuda.memory_reserved()
    assert after <= reserved - (256 << 20), f"the cache was not freed: {reserved} -> {after} bytes reserved"
    os.environ["MASTER_PORT"] = os.environ["NEXT_PORT"]  # the next round, as the agent gives it
    dist.init_process_group("nccl")
    dist.all_reduce(kept)
    torch.cuda.synchronize()
    assert kept[0].item() == 4, kept[0].item()
    dist.destroy_process_group()
    print(f"teardown ok in {took:.2f} s", flush=True)
    """
)


def _nccl_missing() -> str | None:
    """Why the NCCL teardown cannot be tried on this machine, or None."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL (a CPU build): the NCCL teardown needs CUDA torch and GPUs"
    if torch.cuda.device_count() < 2:
        return f"2 CUDA devices needed (NCCL runs one rank per GPU); this machine has {torch.cuda.device_count()}"
    return None


@pytest.mark.timeout(300)
def test_the_nccl_teardown_aborts_a_blocked_collective_keeps_cuda_and_frees_the_cache(tmp_path: Path) -> None:
    missing = _nccl_missing()
    if missing is not None:
        pytest.skip(missing)
    script = tmp_path / "nccl_teardown.py"
    script.write_text(NCCL_TEARDOWN)
    ports = {"MASTER_PORT": str(free_port()), "NEXT_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=clean_env(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), **ports),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc.pid)
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0 and "teardown ok" in output, f"rank {rank}:\n{output[-5000:]}"
