"""Specification: a worker forked from the template is what a fresh `python -u script.py` would be.

Two layers:

* Parity, process by process. One template (preloading torch, as rally's default does) serves
  the whole module; each property is recorded by a probe script started both ways, with the
  same argv, environment, working directory and log fds, and the records are compared:
  argv, sys.orig_argv, /proc/PID/cmdline and /proc/PID/environ, `__main__`, sys.path,
  cwd, environment, open fds and where they point, stdio objects, session and process group,
  signal dispositions and mask, the parent-death signal, thread counts, and the RNGs (which
  must differ between any two workers, as they do between fresh processes); exit codes and
  tracebacks; `-m`; multiprocessing (spawn, fork, forkserver pools, a torch DataLoader).
* rally end to end: workers are children of one template that survives restarts, is
  replaced when it dies, falls back to a plain start (one warning) when it has a thread, and
  is not used for --no-python or --no-preload; SIGKILL of rally takes the template too.

The rest of the suite runs in either mode: RALLY_TEST_START_MODE=plain|template (see
tests/support/helpers.py). Run it once per mode to prove that every env-contract, entry-point, log,
signal and restart test passes both ways.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from rally.agent.base.spec import BOOTSTRAP
from rally.agent.guard import processes
from rally.agent.template.client import ForkedChild, TemplateClient, template_command
from support.helpers import (
    REPO,
    clean_env,
    describe_pids,
    finish,
    is_alive,
    procs,  # noqa: F401 - a fixture
    run_rally,
    start_rally,
    survivors,
    wait_for,
    write_probe,
)

TORCH_CPU_DEFAULT_SEED = 67280421310721  # what a new torch.Generator() starts from

# ------------------------------------------------------------------ process-level parity
PROBE = r"""
import ctypes, json, os, random, signal, sys, threading

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return line.split()[1]

def handler_name(h):
    return getattr(h, "__qualname__", None) or getattr(h, "name", None) or repr(h)

def stream(s):
    if s is None:
        return None
    raw = getattr(s.buffer, "raw", s.buffer)
    return {
        "name": s.name, "mode": s.mode, "encoding": s.encoding, "errors": s.errors,
        "line_buffering": s.line_buffering, "write_through": s.write_through, "fileno": s.fileno(),
        "buffer": type(s.buffer).__name__, "raw": type(raw).__name__, "raw_name": raw.name, "isatty": s.isatty(),
    }

pdeathsig = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
fds = {}
for name in os.listdir("/proc/self/fd"):
    try:
        fds[name] = os.readlink("/proc/self/fd/" + name)
    except OSError:
        pass  # the listing's own fd
threads_before_imports = len(os.listdir("/proc/self/task"))

import multiprocessing.process as mpp
import numpy
import torch

state = numpy.random.get_state()
record = {
    "argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "main_file": sys.modules["__main__"].__file__,
    "main_spec": repr(sys.modules["__main__"].__spec__), "path": sys.path, "cwd": os.getcwd(),
    "environ": dict(os.environ), "executable": sys.executable, "flags": list(sys.flags),
    "proc_cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
    "proc_environ": [e for e in open("/proc/self/environ", "rb").read().decode().split("\0") if e],
    "fds": fds, "stdio": [stream(sys.stdin), stream(sys.stdout), stream(sys.stderr)],
    "dunder_stdio": [sys.stdin is sys.__stdin__, sys.stdout is sys.__stdout__, sys.stderr is sys.__stderr__],
    "pgid_is_pid": os.getpgid(0) == os.getpid(), "sid_is_pid": os.getsid(0) == os.getpid(),
    "handlers": {signal.Signals(s).name if s in signal.Signals._value2member_map_ else str(int(s)):
                 handler_name(signal.getsignal(s))
                 for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "wakeup_fd": signal.set_wakeup_fd(-1),
    "SigBlk": status("SigBlk"), "SigIgn": status("SigIgn"), "SigCgt": status("SigCgt"),
    "pdeathsig": pdeathsig.value, "umask": os.umask(0o022),
    "threads_before_imports": threads_before_imports, "python_threads": threading.active_count(),
    "torch_threads": torch.get_num_threads(), "torch_cuda_initialized": torch.cuda.is_initialized(),
    "original_dir": mpp.ORIGINAL_DIR, "process_name": mpp.current_process().name,
    "numpy_state_shape": [state[0], len(state[1]), int(state[2]), int(state[3]), float(state[4])],
    # Different in every process:
    "torch_seed": torch.initial_seed(), "torch_rand": torch.rand(2).tolist(),
    "numpy_key": [int(x) for x in state[1][:4]], "random": random.random(),
    "authkey": bytes(mpp.current_process().authkey).hex(),
}
with open(os.path.join(os.environ["PROBE_OUT"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(record, f)
print("probe done", os.environ["RANK"])
"""

DIFFERENT_EVERY_PROCESS = {"torch_seed", "torch_rand", "numpy_key", "random", "authkey"}


def worker_argv(mode: str, target: str, *args: str) -> list[str]:
    return [sys.executable, "-u", BOOTSTRAP, mode, target, *args]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers' working directory (not the test's), holding the probes."""
    path = tmp_path_factory.mktemp("workers")
    (path / "out").mkdir()
    return path


@pytest.fixture(scope="module")
def base_env(workdir: Path) -> dict[str, str]:
    return clean_env(PROBE_OUT=str(workdir / "out"), RALLY_STACK_SIGNAL=str(int(signal.SIGRTMIN + 2)))


@pytest.fixture(scope="module")
def template(workdir: Path, base_env: dict[str, str]) -> Iterator[TemplateClient]:
    warnings: list[str] = []
    # Room on the command line for the longest probe argv used below (rally itself sizes it exactly).
    longest = worker_argv("script", str(workdir / ("x" * 120)))
    client = TemplateClient(sys.executable, BOOTSTRAP, longest, ("torch",), base_env, str(workdir), warnings.append)
    client.warnings = warnings  # type: ignore[attr-defined]
    client.start()
    yield client
    client.stop()


def start(
    how: str, template: TemplateClient, argv: list[str], env: dict[str, str], cwd: Path, tag: str
) -> tuple[int, str, str]:
    """Run one worker plainly or from the template; return (returncode, stdout, stderr)."""
    out_path, err_path = cwd / f"{tag}.stdout", cwd / f"{tag}.stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        if how == "plain":
            child: Any = processes.spawn(argv, env, str(cwd), out, err)
        else:
            child = template.spawn(argv, env, str(cwd), out, err)
            assert isinstance(child, ForkedChild), f"not forked: {template.warnings}"  # type: ignore[attr-defined]
    try:
        code = child.wait()
        assert child.ended_at is not None and child.ended_at >= child.started_at
    finally:
        child.close()
    return code, out_path.read_text(), err_path.read_text()


def start_both(
    template: TemplateClient, argv: list[str], env: dict[str, str], cwd: Path, tag: str
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """`start` plainly and from the template at the same time, for a probe whose own children
    import torch (seconds of CPU each): the two runs overlap instead of queueing. (plain, forked)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="plain-start") as pool:
        plain = pool.submit(start, "plain", template, argv, env, cwd, f"{tag}-plain")
        forked = start("template", template, argv, env, cwd, f"{tag}-template")
        return plain.result(), forked


def normalised(record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    text = json.dumps({k: v for k, v in record.items() if k not in DIFFERENT_EVERY_PROCESS})
    return json.loads(text.replace(str(run_dir), "<run>"))


def plain_sigint() -> str:
    """What `python script.py` started from this process installs for SIGINT: Python's
    KeyboardInterrupt handler, unless SIGINT is ignored here (a shell's background job starts
    so, and Python keeps an inherited SIG_IGN)."""
    return "SIG_IGN" if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else "default_int_handler"


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_a_forked_worker_is_indistinguishable_from_a_plain_start(
    template: TemplateClient, workdir: Path, base_env: dict[str, str]
) -> None:
    argv = worker_argv("script", "probe.py", "--lr", "0.1", "two words", "")
    records = {}
    for how, rank in (("plain", "plain"), ("template", "t1"), ("template", "t2")):
        run_dir = workdir / how  # the same layout in another directory, so paths differ only there
        write_probe(run_dir / "probe.py", PROBE)
        env = {**base_env, "RANK": rank, "LOCAL_RANK": "0"}
        code, out, err = start(how, template, argv, env, run_dir, "worker")
        assert code == 0, err
        assert out == f"probe done {rank}\n" and err == ""
        record = json.loads((workdir / "out" / f"{rank}.json").read_text())
        records[rank] = (record, normalised(record, run_dir), env)

    plain, plain_norm, plain_env = records["plain"]
    for rank in ("t1", "t2"):
        forked, forked_norm, env = records[rank]
        # Everything but the per-process values, key by key (the env differs only in RANK).
        forked_norm["environ"]["RANK"] = forked_norm["proc_environ"] = "<rank>"
        plain_copy = {**plain_norm, "environ": {**plain_norm["environ"], "RANK": "<rank>"}, "proc_environ": "<rank>"}
        for key in plain_copy:
            assert forked_norm[key] == plain_copy[key], (
                f"{key}: forked {forked_norm[key]!r} != plain {plain_copy[key]!r}"
            )
        # The essentials, spelled out.
        assert forked["argv"] == ["probe.py", "--lr", "0.1", "two words", ""]
        assert forked["orig_argv"] == argv
        assert forked["proc_cmdline"] == argv[:-1]  # the probe strips trailing NULs: the last argument is ""
        assert forked["environ"] == env and sorted(forked["proc_environ"]) == sorted(f"{k}={v}" for k, v in env.items())
        assert forked["main_file"] == str(workdir / "template" / "probe.py") and forked["name"] == "__main__"
        assert forked["path"][0] == str(workdir / "template") and forked["cwd"] == str(workdir / "template")
        assert forked["original_dir"] == forked["cwd"]
        assert sorted(forked["fds"]) == ["0", "1", "2"], forked["fds"]
        assert forked["fds"]["1"] == str(workdir / "template" / "worker.stdout")
        assert forked["fds"]["2"] == str(workdir / "template" / "worker.stderr")
        assert forked["pgid_is_pid"] and forked["sid_is_pid"]
        assert forked["handlers"]["SIGINT"] == plain_sigint()
        assert forked["handlers"]["SIGTERM"] == forked["handlers"]["SIGCHLD"] == "SIG_DFL"
        assert forked["handlers"]["SIGPIPE"] == "SIG_IGN"
        assert forked["SigBlk"] == "0000000000000000" and forked["wakeup_fd"] == -1
        assert forked["pdeathsig"] == signal.SIGKILL
        assert forked["threads_before_imports"] == 1 and forked["torch_cuda_initialized"] is False

    # RNGs: seeded from entropy in each process, so no two workers share a stream.
    seeds = [records[r][0]["torch_seed"] for r in ("plain", "t1", "t2")]
    assert len(set(seeds)) == 3 and TORCH_CPU_DEFAULT_SEED not in seeds, seeds
    for key in ("torch_rand", "numpy_key", "random", "authkey"):
        values = [json.dumps(records[r][0][key]) for r in ("plain", "t1", "t2")]
        assert len(set(values)) == 3, f"{key} repeats across workers: {values}"


@pytest.mark.timeout(120)
def test_module_mode_matches_python_dash_m(template: TemplateClient, workdir: Path, base_env: dict[str, str]) -> None:
    write_probe(workdir / "mpkg" / "__init__.py", "")
    write_probe(
        workdir / "mpkg" / "entry.py",
        """
        import json, os, sys
        record = {"argv": sys.argv, "name": __name__, "path0": sys.path[0], "spec": __spec__.name, "cwd": os.getcwd(),
                  "main": sys.modules["__main__"].__file__, "orig_argv": sys.orig_argv}
        print(json.dumps(record))
        """,
    )
    argv = worker_argv("module", "mpkg.entry", "--x", "1")
    runs = {
        how: start(how, template, argv, {**base_env, "RANK": "0"}, workdir, f"module-{how}")
        for how in ("plain", "template")
    }
    assert runs["plain"] == runs["template"]
    code, out, _ = runs["template"]
    record = json.loads(out)
    assert code == 0 and record["argv"] == [str(workdir / "mpkg" / "entry.py"), "--x", "1"]
    assert record["name"] == "__main__" and record["path0"] == str(workdir) and record["spec"] == "mpkg.entry"


EXITS = {
    "clean": "print('fine')",
    "exit_3": "import sys\nprint('leaving', file=sys.stderr)\nsys.exit(3)",
    "exit_message": "import sys\nsys.exit('bad configuration')",
    "exception": "def load(name):\n    raise KeyError(f'{name} is missing')\n\n"
    "def main():\n    load('shard-7')\n\nmain()",
    "chained": "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    raise RuntimeError('wrapped') from e",
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "sigkill": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "sigterm_default": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
    "atexit_and_thread": (
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread finished'))).start()\n"
        "print('main done')"
    ),
}
EXPECTED_CODES = {
    "clean": 0, "exit_3": 3, "exit_message": 1, "exception": 1, "chained": 1,
    "keyboard_interrupt": -signal.SIGINT, "sigkill": -signal.SIGKILL, "sigterm_default": -signal.SIGTERM,
    "atexit_and_thread": 0,
}  # fmt: skip


@pytest.mark.timeout(180)
def test_exit_codes_output_and_tracebacks_are_identical(
    template: TemplateClient, workdir: Path, base_env: dict[str, str]
) -> None:
    for name, body in EXITS.items():
        write_probe(workdir / f"exit_{name}.py", body + "\n")
        argv = worker_argv("script", f"exit_{name}.py")
        plain = start("plain", template, argv, {**base_env, "RANK": "0"}, workdir, f"{name}-plain")
        forked = start("template", template, argv, {**base_env, "RANK": "0"}, workdir, f"{name}-template")
        assert forked == plain, f"{name}: forked {forked!r} != plain {plain!r}"
        assert forked[0] == EXPECTED_CODES[name], f"{name}: {forked!r}"
    exception_stderr = start(
        "template", template, worker_argv("script", "exit_exception.py"), {**base_env, "RANK": "0"}, workdir, "tb"
    )[2]
    assert exception_stderr.startswith('Traceback (most recent call last):\n  File "')
    assert "bootstrap.py" not in exception_stderr and "template.py" not in exception_stderr
    assert "in load\n" in exception_stderr and exception_stderr.endswith("KeyError: 'shard-7 is missing'\n")


MULTIPROCESSING = """
import json, multiprocessing as mp, sys
import torch
from torch.utils.data import DataLoader, Dataset

def square(x):
    return x * x

class Draws(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.rand(1).item()  # seeded per DataLoader worker from the default generator

if __name__ == "__main__":
    results = {}
    for method in ("spawn", "fork", "forkserver"):
        with mp.get_context(method).Pool(2) as pool:
            results[method] = pool.map(square, range(6))
    draws = [float(x) for batch in DataLoader(Draws(), batch_size=1, num_workers=2) for x in batch]
    results["loader_draws"] = len(set(draws))
    print(json.dumps(results))
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_multiprocessing_and_dataloader_workers_work_in_a_forked_worker(
    template: TemplateClient, workdir: Path, base_env: dict[str, str]
) -> None:
    write_probe(workdir / "mp_probe.py", MULTIPROCESSING)
    argv = worker_argv("script", "mp_probe.py")
    plain, forked = start_both(template, argv, {**base_env, "RANK": "0"}, workdir, "mp")
    assert plain == forked, f"forked {forked!r} != plain {plain!r}"
    squares = [x * x for x in range(6)]
    assert json.loads(forked[1]) == {"spawn": squares, "fork": squares, "forkserver": squares, "loader_draws": 4}


@pytest.mark.timeout(120)
def test_an_environment_the_template_was_not_started_with_means_a_plain_start(
    template: TemplateClient, workdir: Path, base_env: dict[str, str]
) -> None:
    write_probe(workdir / "pid.py", "import os\nprint(os.getppid())")
    argv = worker_argv("script", "pid.py")
    forks = template.forks
    env = {**base_env, "RANK": "0", "LD_PRELOAD": ""}  # read when libraries load: the template's would be stale
    child = template.spawn(argv, env, str(workdir), None, None)
    assert not isinstance(child, ForkedChild) and child.wait() == 0
    child.close()
    assert template.forks == forks
    assert any("LD_PRELOAD" in w for w in template.warnings)  # type: ignore[attr-defined]


SIGNAL_STATE = """
import json, os, signal
# Not SigCgt: glibc catches signal 33 (SIGSETXID) once a process has had a thread, and the
# template has (OpenBLAS, see agent/template/client.py); this probe imports nothing that starts one.
status = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith(("SigIgn", "SigBlk"))}
handlers = {int(s): getattr(signal.getsignal(s), "name", None) or getattr(signal.getsignal(s), "__qualname__", "?")
            for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
print(json.dumps({"status": status, "handlers": handlers}))
"""


@pytest.mark.timeout(120)
def test_signals_the_agent_ignores_or_blocks_at_spawn_time_are_inherited_as_by_a_plain_start(
    template: TemplateClient, workdir: Path, base_env: dict[str, str]
) -> None:
    """The template started before; the agent (this process) now ignores SIGHUP, as under nohup,
    and blocks SIGUSR2: a forked worker must get what a plain start gets now."""
    write_probe(workdir / "signal_state.py", SIGNAL_STATE)
    argv = worker_argv("script", "signal_state.py")
    runs = {}
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        for how in ("plain", "template"):
            runs[how] = start(how, template, argv, {**base_env, "RANK": "0"}, workdir, f"signals-{how}")
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        signal.signal(signal.SIGHUP, previous)
    assert runs["template"] == runs["plain"]
    state = json.loads(runs["template"][1])
    assert state["handlers"][str(int(signal.SIGHUP))] == "SIG_IGN"
    assert int(state["status"]["SigBlk"], 16) == 1 << (signal.SIGUSR2 - 1)
    assert state["handlers"][str(int(signal.SIGINT))] == plain_sigint()


@pytest.mark.timeout(120)
def test_a_preload_that_hangs_means_plain_starts_not_a_hung_agent(
    workdir: Path, base_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import rally.agent.template.connection

    write_probe(workdir / "sleepy.py", "import time\ntime.sleep(600)\n")
    write_probe(workdir / "hello.py", "print('hello')\n")
    monkeypatch.setattr(rally.agent.template.connection, "READY_TIMEOUT", 2.0)
    warnings: list[str] = []
    argv = worker_argv("script", "hello.py")
    client = TemplateClient(sys.executable, BOOTSTRAP, argv, ("sleepy",), base_env, str(workdir), warnings.append)
    client.start()
    stuck = client.pid
    try:
        started = time.monotonic()
        child = client.spawn(argv, {**base_env, "RANK": "0"}, str(workdir), subprocess.DEVNULL, None)
        assert not isinstance(child, ForkedChild) and child.wait() == 0
        assert time.monotonic() - started < 30
        child.close()
        assert len(warnings) == 1 and "did not answer within 2 s" in warnings[0], warnings
        assert stuck is not None and not is_alive(stuck), "the stuck template is killed"
        second = client.spawn(argv, {**base_env, "RANK": "1"}, str(workdir), subprocess.DEVNULL, None)
        assert not isinstance(second, ForkedChild) and second.wait() == 0
        second.close()
        assert len(warnings) == 1
    finally:
        client.stop()


PREIMPORTED = """
import gc, json, sys
job = sys.modules.get("rally.agent.worker_side.job")
# Imported before the fork: in the template's permanent generation (gc.freeze), which gc.get_objects() leaves out.
print(json.dumps({"imported": job is not None,
                  "in_the_template": job is not None and not any(o is job.__dict__ for o in gc.get_objects())}))
"""


# Imported before the fork or after it: no CPU load changes which.
@pytest.mark.same_under_load
@pytest.mark.timeout(120)
def test_the_preemption_handler_module_is_imported_in_the_template_not_in_each_worker(
    workdir: Path, base_env: dict[str, str]
) -> None:
    """RALLY_PREEMPT_SIGNALS is set by default: the bootstrap installs the handler from
    rally.agent.worker_side.job before the script's first line, 40-60 ms of imports in every
    forked worker of a restart on a busy machine unless the template imported it first."""
    env = {**base_env, "RALLY_PREEMPT_SIGNALS": "SIGUSR1,SIGUSR2"}
    warnings: list[str] = []
    script = workdir / "preimported.py"
    write_probe(script, PREIMPORTED)
    client = TemplateClient(
        sys.executable, BOOTSTRAP, worker_argv("script", str(script)), (), env, str(workdir), warnings.append
    )
    client.warnings = warnings  # type: ignore[attr-defined]
    client.start()
    try:
        code, out, err = start(
            "template", client, worker_argv("script", str(script)), {**env, "RANK": "0"}, workdir, "preimported"
        )
    finally:
        client.stop()
    assert code == 0, err
    assert json.loads(out) == {"imported": True, "in_the_template": True}


# Which of the bootstrap's modules a forked worker finds imported in the template (gc.freeze's
# permanent generation, which gc.get_objects() leaves out), as one JSON line.
PREIMPORTED_BOTH = """
import gc, json, sys
frozen = lambda name: name in sys.modules and not any(o is sys.modules[name].__dict__ for o in gc.get_objects())
print(json.dumps({name: frozen(name) for name in ("rally.agent.worker_side.job",
                                                  "rally.agent.checkpoint.core.resume_prefetch")}), flush=True)
"""

WARMED = (
    PREIMPORTED_BOTH
    + """
import os, sys, time
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt}: dynamo {'torch._dynamo' in sys.modules}", flush=True)
import torch  # rally's default: the template preloads torch for a script that imports it
if attempt == "0":
    time.sleep(12)  # the template idles meanwhile (WARM_AFTER_IDLE_SECONDS, 10 s)
    sys.exit(3)
started = time.perf_counter()
torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1).zero_grad()
print(f"optimizer's first use {time.perf_counter() - started:.3f} s", flush=True)
"""
)


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_the_idle_template_imports_torch_dynamo_so_a_restarted_worker_finds_it_imported(tmp_path: Path) -> None:
    """torch imports torch._dynamo at an optimizer's first use (0.7-0.9 s here, in every worker
    start): the template imports it once it idles after the first round's forks, not before
    them (a script without an optimizer would wait for it), and the next round's workers have it.

    And, end to end with rally's defaults, the bootstrap's modules: RALLY_PREEMPT_SIGNALS and
    RALLY_CKPT_HOLDER are in each worker's environment, not the template's, so the template imports
    the modules they need at its first fork; before that fix each worker imported them (30 ms of its
    start, measured fork -> first line 40 ms -> 8 ms). Both rounds' workers find them imported in
    the template (that was a job of its own: two workers of one round)."""
    write_probe(tmp_path / "warmed.py", WARMED)
    result = run_rally(
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "warmed.py"],
        cwd=tmp_path,
        env=rally_env(tmp_path),
        timeout=110,
    )
    assert result.returncode == 0, result.describe()
    assert "[0] attempt 0: dynamo False" in result.stdout, result.describe()
    assert "[0] attempt 1: dynamo True" in result.stdout, result.describe()
    assert "warning" not in result.stderr, result.describe()
    records = [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("[0] {")]
    both = {"rally.agent.worker_side.job": True, "rally.agent.checkpoint.core.resume_prefetch": True}
    assert records == [both, both], result.describe()  # round 0's worker (the first fork) and round 1's


def test_template_command_line_has_room_for_the_workers_exactly() -> None:
    worker = worker_argv("script", "train.py", "--lr", "0.1")
    padded = template_command(sys.executable, BOOTSTRAP, worker)
    assert padded[:4] == [sys.executable, "-u", BOOTSTRAP, "template"]
    assert sum(len(a) + 1 for a in padded) == sum(len(a) + 1 for a in worker)


def test_cuda_or_threads_in_the_template_make_forking_unsafe() -> None:
    code = """
        import sys, threading, time, types
        from rally.agent.template.client import why_fork_is_unsafe
        print(why_fork_is_unsafe())
        sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
        print(why_fork_is_unsafe())
        del sys.modules["torch"]
        threading.Thread(target=time.sleep, args=(5,), daemon=True, name="loader").start()
        print(why_fork_is_unsafe())
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "None"
    assert lines[1] == "CUDA is initialised in the template"
    assert lines[2].startswith("the template has 2 threads") and "loader" in lines[2]


# ------------------------------------------------------------------ rally end to end
ROUND_PROBE = """
import json, os, sys, time
out, rank, count = os.environ["PROBE_OUT"], os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
cmdline = open("/proc/self/cmdline", "rb").read().split(b"\\0")[:-1]
record = {"pid": os.getpid(), "ppid": os.getppid(), "cmdline": [a.decode() for a in cmdline]}
path = os.path.join(out, f"round{count}_rank{rank}.json")
with open(path + ".tmp", "w") as f:  # renamed whole: the test polls for these files
    json.dump(record, f)
os.replace(path + ".tmp", path)
fail_until = int(os.environ.get("PROBE_FAIL_UNTIL", "0"))
if int(count) < fail_until:
    if rank == "1":  # after rank 0 wrote its record: no test may depend on which worker starts first
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(out, f"round{count}_rank0.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
    time.sleep(60)
time.sleep(float(os.environ.get("PROBE_SLEEP_ROUND" + count, "0")))
"""


def round_records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("round*_rank*.json"))}


def rally_env(out: Path, *, plain: bool = False, **extra: str) -> dict[str, str]:
    env = clean_env(PROBE_OUT=str(out), **extra)
    env.pop("RALLY_PRELOAD", None)
    env.pop("RALLY_NO_PRELOAD", None)
    if plain:
        env["RALLY_NO_PRELOAD"] = "1"
    return env


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_rally_forks_every_round_from_one_template(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", ROUND_PROBE)
    result = run_rally(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--shutdown-timeout",
            "5",
            "--preload",
            "torch",
            "probe.py",
            "--flag",
        ],
        cwd=tmp_path,
        env=rally_env(out, PROBE_FAIL_UNTIL="2"),
        timeout=170,
    )
    assert result.returncode == 0, result.describe()
    records = round_records(out)
    assert len(records) == 6, sorted(records)
    parents = {r["ppid"] for r in records.values()}
    assert len(parents) == 1, f"one template serves every round: {parents}"
    assert "warning" not in result.stderr, result.describe()
    for record in records.values():
        assert record["cmdline"] == [sys.executable, "-u", BOOTSTRAP, "script", "probe.py", "--flag"]


@pytest.mark.timeout(120)
def test_no_preload_and_no_python_start_workers_as_children_of_rally(tmp_path: Path, procs) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", ROUND_PROBE)
    write_probe(tmp_path / "ppid.sh", '#!/bin/sh\necho "$PPID" > "$PROBE_OUT/sh_$RANK"\n', executable=True)
    for args, plain in ((["probe.py"], True), (["--no-python", "./ppid.sh"], False)):
        rally = start_rally(
            ["--standalone", "--nproc-per-node", "2", *args], cwd=tmp_path, env=rally_env(out, plain=plain)
        )
        procs.track_group(rally.pid)
        result = finish(rally, 100)
        assert result.returncode == 0, result.describe()
        if plain:
            parents = {r["ppid"] for r in round_records(out).values()}
        else:
            parents = {int((out / f"sh_{rank}").read_text()) for rank in (0, 1)}
        assert parents == {rally.pid}, f"{args}: workers' parents {parents}, rally {rally.pid}"


def wait_for_workers(out: Path, rally: subprocess.Popen, count: int, round_: int = 0) -> dict[str, dict]:
    def ready() -> dict[str, dict] | None:
        records = {k: v for k, v in round_records(out).items() if k.startswith(f"round{round_}_")}
        if rally.poll() is not None:
            pytest.fail(finish(rally, 5).describe())
        return records if len(records) == count else None

    return wait_for(ready, timeout=90, what=f"{count} workers of round {round_}")  # type: ignore[return-value]


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_a_dead_template_takes_its_workers_and_is_replaced(tmp_path: Path, procs) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", ROUND_PROBE)
    rally = start_rally(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--shutdown-timeout",
            "3",
            "--preload",
            "torch",
            "probe.py",
        ],
        cwd=tmp_path,
        env=rally_env(out, PROBE_SLEEP_ROUND0="120"),
    )
    procs.track_group(rally.pid)
    workers = wait_for_workers(out, rally, 2)
    template_pid = workers["round0_rank0"]["ppid"]
    assert template_pid != rally.pid and psutil.Process(template_pid).ppid() == rally.pid
    worker_pids = [r["pid"] for r in workers.values()]
    procs.track(template_pid, *worker_pids)
    os.kill(template_pid, signal.SIGKILL)
    left = survivors(worker_pids, within=3.0)
    assert not left, f"workers outlived their template: {describe_pids(left)}"
    result = finish(rally, 200)
    assert result.returncode == 0, result.describe()
    second = {k: v for k, v in round_records(out).items() if k.startswith("round1_")}
    new_template = {r["ppid"] for r in second.values()}
    assert len(second) == 2 and len(new_template) == 1, second
    assert template_pid not in new_template and rally.pid not in new_template
    assert "the worker template died" in result.stderr, result.describe()
    assert re.search(r"root cause: rank \d .*SIGKILL", result.stderr), result.describe()


@pytest.mark.timeout(180)
def test_a_thread_in_the_template_means_plain_starts_with_one_warning(tmp_path: Path, procs) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", ROUND_PROBE)
    write_probe(
        tmp_path / "threaded.py",
        """
        import threading, time
        threading.Thread(target=time.sleep, args=(600,), daemon=True, name="prefetcher").start()
        """,
    )
    rally = start_rally(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--preload", "threaded", "probe.py"],
        cwd=tmp_path,
        env=rally_env(out, PROBE_FAIL_UNTIL="1"),
    )
    procs.track_group(rally.pid)
    result = finish(rally, 170)
    assert result.returncode == 0, result.describe()
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "prefetcher" in warnings[0] and "plainly" in warnings[0], result.describe()
    records = round_records(out)
    assert len(records) == 4 and {r["ppid"] for r in records.values()} == {rally.pid}


@pytest.mark.timeout(120)
def test_a_module_that_cannot_be_preloaded_is_reported_and_workers_still_fork(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", ROUND_PROBE)
    result = run_rally(
        ["--standalone", "--nproc-per-node", "2", "--preload", "json,no_such_module_here", "probe.py"],
        cwd=tmp_path,
        env=rally_env(out),
        timeout=110,
    )
    assert result.returncode == 0, result.describe()
    assert "could not preload no_such_module_here: ModuleNotFoundError" in result.stderr, result.describe()
    records = round_records(out)
    assert len({r["ppid"] for r in records.values()}) == 1


@pytest.mark.timeout(120)
def test_sigkill_of_rally_takes_the_template_and_its_workers(tmp_path: Path, procs) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_probe(tmp_path / "probe.py", ROUND_PROBE)
    rally = start_rally(
        ["--standalone", "--nproc-per-node", "2", "--preload", "json", "probe.py"],
        cwd=tmp_path,
        env=rally_env(out, PROBE_SLEEP_ROUND0="120"),
    )
    procs.track_group(rally.pid)
    workers = wait_for_workers(out, rally, 2)
    pids = [r["pid"] for r in workers.values()]
    template_pid = workers["round0_rank0"]["ppid"]
    helpers_ = [p.pid for p in psutil.Process(rally.pid).children()]
    assert template_pid in helpers_
    procs.track(*pids, *helpers_)
    os.kill(rally.pid, signal.SIGKILL)
    rally.wait(timeout=5)
    rally.communicate()
    left = survivors(pids + helpers_, within=2.0)
    assert not left, f"still alive 2 s after rally was SIGKILLed: {describe_pids(left)}"
    assert not is_alive(template_pid)


def test_the_helpers_hook_maps_start_modes_to_rally_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from support.helpers import start_mode_env

    monkeypatch.setenv("RALLY_TEST_START_MODE", "plain")
    assert start_mode_env() == {"RALLY_NO_PRELOAD": "1"}
    monkeypatch.setenv("RALLY_TEST_START_MODE", "template")
    assert start_mode_env() == {"RALLY_PRELOAD": "torch"}
    monkeypatch.delenv("RALLY_TEST_START_MODE")
    assert start_mode_env() == {}
    assert REPO.is_dir()
