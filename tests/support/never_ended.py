"""Short jobs beside jobs whose helper processes are attacked: the soak behind tests/test_job_end_bounded.py
and bench/never_ended.py ("a job that never ended": a finished job whose agent never exited).

A job is `rally --standalone --nproc-per-node 2` of a script. An attacked job's helpers (the
checkpoint holder, the orphan guard, the worker template) are found among the agent's descendants
by their command lines once its workers run, and one of them is SIGSTOPped for good, SIGKILLed,
or starved (stopped for a few seconds, then continued). Every job must end within `late`
seconds of its workers' exit; one that does not gets its agent's stacks dumped (rally's stack
signal, which the agent answers with faulthandler on its stderr) before it is killed, and the
run reports it with those stacks.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from support.helpers import Result, clean_env, kill_group, start_rally

# What the agent dumps its stacks on (agent/base/spec.py STACK_SIGNAL; the agent registers faulthandler there).
STACK_SIGNAL = signal.SIGRTMIN + 2
# A helper as its command line names it.
HELPERS = {"holder": "holder.py", "guard": "orphan_guard.py", "template": "bootstrap.py template"}
ATTACKS = ("stop", "kill", "starve")
# A job whose workers never say they are done is late after this long (start-up on a loaded machine).
START_BOUND = 90.0

SHORT = "print('done')\n"
# Runs long enough for its helpers to be attacked; says when it runs.
ATTACKED = "import time\nprint('up', flush=True)\ntime.sleep(1.5)\nprint('done', flush=True)\n"


def run_or_dump_stacks(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> Result:
    """`run_rally`, except that a rally still running after `timeout` first dumps its agent's stacks
    (they end its stderr, in the Result), then is killed: the Result's returncode is then -9."""
    started = time.monotonic()
    proc = start_rally(args, cwd=cwd, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal(proc.pid, STACK_SIGNAL)
        try:
            stdout, stderr = proc.communicate(timeout=2)  # the dump takes milliseconds
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            # wait: after_kill: the group was SIGKILLed
            proc.wait()
    return Result(list(proc.args), proc.returncode, stdout, stderr, time.monotonic() - started)


def helpers_of(agent: int) -> dict[str, list[int]]:
    """The agent's helper processes by kind (pids), from its descendants' command lines."""
    found: dict[str, list[int]] = {kind: [] for kind in HELPERS}
    try:
        below = psutil.Process(agent).children(recursive=True)
    except psutil.Error:
        return found
    for proc in below:
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for kind, needle in HELPERS.items():
            if needle in command:
                found[kind].append(proc.pid)
                break
    return found


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Job:
    """One finished (or killed) job of the soak."""

    name: str
    returncode: int | None
    elapsed: float
    attack: str = ""  # e.g. "stop holder [1234]"
    late: bool = False
    stderr: str = ""

    def describe(self) -> str:
        return f"{self.name}: exit {self.returncode} after {self.elapsed:.1f} s {self.attack}\n{self.stderr[-8000:]}"


@dataclass
class Soak:
    root: Path
    until: float
    late: float
    jobs: list[Job] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: list[int] = field(default_factory=list)  # helpers left stopped: killed at the end

    def run_one(self, name: str, script: str, attack: str | None, rng: random.Random) -> None:
        work = self.root / name
        work.mkdir(parents=True, exist_ok=True)
        (work / "job.py").write_text(script)
        out, err = open(work / "out", "w+"), open(work / "err", "w+")
        started = time.monotonic()
        args = ["--standalone", "--nproc-per-node", "2", "--log-dir", str(work / "logs"), "job.py"]
        proc = start_rally(args, cwd=work, env=clean_env(), stdout=out, stderr=err)
        done_at: float | None = None  # when the workers said they were done
        attacked, late = "", False
        try:
            while proc.poll() is None:
                time.sleep(0.05)
                text = (work / "out").read_text(errors="replace")
                if done_at is None and text.count("done") >= 2:
                    done_at = time.monotonic()
                if attack and not attacked and "up" in text:
                    attacked = self._attack(proc.pid, attack, rng)
                now = time.monotonic()
                if (done_at is not None and now - done_at > self.late or now - started > START_BOUND) and not late:
                    late = True
                    _signal(proc.pid, STACK_SIGNAL)  # the agent's stacks, on its stderr
                    time.sleep(1.0)
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            # wait: short: SIGKILLed above, or exited
            proc.wait(timeout=10)
        err.seek(0)
        job = Job(name, proc.returncode, time.monotonic() - started, attacked, late, err.read())
        out.close(), err.close()
        with self.lock:
            self.jobs.append(job)

    def _attack(self, agent: int, attack: str, rng: random.Random) -> str:
        how, kind = attack.split()
        pids = helpers_of(agent)[kind]
        for pid in pids:
            if how == "kill":
                _signal(pid, signal.SIGKILL)
            else:
                _signal(pid, signal.SIGSTOP)
                if how == "starve":
                    threading.Timer(rng.uniform(0.5, 4.0), _signal, (pid, signal.SIGCONT)).start()
                else:
                    with self.lock:
                        self.stopped.append(pid)
        return f"{attack} {pids}"

    def loop(self, tag: str, script: str, attacks: list[str] | None, seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while time.monotonic() < self.until:
            n += 1
            attack = rng.choice(attacks) if attacks else None
            self.run_one(f"{tag}-{n}", script, attack, rng)

    def release(self) -> None:
        """Kill the helpers left stopped (their agents are gone; a stopped process never sees its pipe close)."""
        for pid in self.stopped:
            _signal(pid, signal.SIGKILL)


def every_attack() -> list[str]:
    return [f"{how} {kind}" for how in ATTACKS for kind in HELPERS]


def run_jobs_beside_attacks(root: Path, seconds: float, late: float, short_loops: int = 2, attacked_loops: int = 1,
                            seed: int | None = None) -> list[Job]:  # fmt: skip
    """Loops of short jobs and of attacked jobs side by side for `seconds`; every job they ran."""
    seed = int(time.time()) if seed is None else seed
    soak = Soak(root, time.monotonic() + seconds, late)
    threads = [
        threading.Thread(target=soak.loop, args=(f"short{i}", SHORT, None, seed + i)) for i in range(short_loops)
    ]
    threads += [
        threading.Thread(target=soak.loop, args=(f"attacked{i}", ATTACKED, every_attack(), seed + 100 + i))
        for i in range(attacked_loops)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            # wait: bounded: no loop starts a job after `seconds`; every job ends within late + 1 s of its workers
            thread.join()
    finally:
        soak.release()
    print(f"seed {seed}", file=sys.stderr)
    return soak.jobs
