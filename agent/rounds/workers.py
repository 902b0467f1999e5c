"""One round's workers on this node: their environment, log files, processes and output.

The environment is torchrun's, name for name (see `worker_env`), so a script written for
torchrun runs unchanged. Log files follow torchrun's layout:
`<log-dir>/<run-id>_<suffix>/attempt_<n>/<local_rank>/{stdout,stderr}.log` and `error.json`,
where n is the rendezvous round (equal to TORCHELASTIC_RESTART_COUNT until a node joins or
leaves; using the round keeps a membership change from overwriting an earlier attempt's logs).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any, BinaryIO

from rally.agent.base.spec import STACK_SIGNAL, STDERR, STDOUT, JobSpec, shared_worker_env
from rally.agent.base.untrusted_files import open_for_writing
from rally.agent.guard.processes import ChildProcess, describe_exit, process_state, spawn
from rally.agent.observe.health import heartbeat_path
from rally.agent.rounds import logs_specs
from rally.agent.rounds.logs_specs import StreamPlan
from rally.agent.rounds.output import ByteSink, OutputStream, WholeWrites, WorkerOutput
from rally.rendezvous.base.path_trust import UnsafePath, Walk, open_directory
from rally.rendezvous.protocol import Assignment


@dataclass
class Worker:
    """One worker process and what is known about it."""

    local_rank: int
    global_rank: int
    process: ChildProcess
    output: WorkerOutput
    error_file: str
    heartbeat_file: str | None = None
    stopped: bool = False  # the agent stopped it (another worker failed, a signal, the end)
    # its training function returned for good (rally.job.run), then the agent stopped it for not
    # exiting (agent/observe/exit_watch.py): whatever its exit code, it succeeded
    stuck_after_return: bool = False
    error_file_shown: str = ""  # error_file as people see it (LogLayout.shown)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def started_at(self) -> float:
        """When its process started (time.monotonic())."""
        return self.process.started_at

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def duration(self) -> float:
        end = self.process.ended_at or time.monotonic()
        return end - self.process.started_at

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 or (self.stuck_after_return and self.returncode is not None)

    def state(self) -> str:
        code = self.returncode
        if code is None:
            return "stopped (SIGSTOP)" if process_state(self.pid) == "stopped (SIGSTOP)" else "running"
        if self.succeeded:
            return "succeeded"
        return "stopped" if self.stopped else "failed"

    def describe_exit(self) -> str:
        return "running" if self.returncode is None else describe_exit(self.returncode)


def worker_env(
    spec: JobSpec,
    base_env: dict[str, str],
    assignment: Assignment,
    master: tuple[str, int],
    local_rank: int,
    error_file: str,
) -> dict[str, str]:
    """The environment torchrun 2.13 gives a worker, plus rally's own RALLY_* variables."""
    env = shared_worker_env(spec, base_env)
    rank = assignment.rank_offset + local_rank
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(assignment.group_rank),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
            "WORLD_SIZE": str(assignment.world_size),
            "GROUP_WORLD_SIZE": str(assignment.group_world_size),
            "ROLE_WORLD_SIZE": str(assignment.world_size),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
            "TORCHELASTIC_RESTART_COUNT": str(assignment.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.run_id,
            # Workers connect to a store the agent hosts; rally hosts a fresh one every round,
            # so no key from an earlier attempt can reach a later one.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
            "RALLY_ROUND": str(assignment.round),
        }
    )
    if spec.is_python:
        env["RALLY_STACK_SIGNAL"] = str(int(STACK_SIGNAL))
        if spec.preemption_signals:
            env["RALLY_PREEMPT_SIGNALS"] = ",".join(signal.Signals(s).name for s in spec.preemption_signals)
    if spec.checkpoint_dir:
        env["RALLY_CHECKPOINT_DIR"] = spec.checkpoint_dir
        if spec.checkpoint_dir_shared:  # the user's consent (agent/checkpoint/core/auth.py)
            env["RALLY_CHECKPOINT_DIR_SHARED"] = "1"
    if spec.numa_binding is not None:  # the CPUs near this worker's GPU (agent/base/numa.py)
        from rally.agent.base.numa import AFFINITY_VARIABLE, cpus_near_gpu, format_cpus

        env[AFFINITY_VARIABLE] = format_cpus(cpus_near_gpu(spec.numa_binding, local_rank))
    if spec.virtual_local_rank:  # as torchrun's LocalElasticAgent._set_local_rank_env
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = virtual_device(local_rank, base_env)
    return env


def stack_file(rank_dir: Path) -> str:
    """An empty file, this user's only, for the worker's stack dumps (agent/worker_side/bootstrap.py)."""
    path = rank_dir / "stacks"
    path.parent.mkdir(parents=True, exist_ok=True)
    open_for_writing(path).close()
    return str(path)


def virtual_device(local_rank: int, base_env: Mapping[str, str]) -> str:
    """The one GPU a worker sees under --virtual-local-rank (torchrun's mapping)."""
    visible = base_env.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[local_rank].strip() if visible is not None else str(local_rank)


def tee_prefix(spec: JobSpec, local_rank: int, rank: int) -> bytes:
    """The header torchrun 2.13 puts on each --tee'd console line (and each filtered-file line):
    `[<role><local rank>]:` (tail_log.TailLog), or $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with
    ${role_name}, ${rank} (global) and ${local_rank} filled by `string.Template.safe_substitute`,
    as LocalElasticAgent does (an unknown ${name} stays as written; an empty template is unset)."""
    if spec.log_line_prefix_template:
        template = Template(spec.log_line_prefix_template)
        return template.safe_substitute(role_name=spec.role, rank=rank, local_rank=local_rank).encode()
    return f"[{spec.role}{local_rank}]:".encode()


def console_prefix(spec: JobSpec, teed: bool, torchrun_header: bytes, rally_prefix: bytes) -> bytes:
    """What starts each console line of a worker stream: on a --tee'd stream torchrun's header,
    exactly as torchrun prints it (log scrapers grep for it); on the others, which torchrun
    passes through bare, rally's "[rank] " so that concurrent workers' lines stay apart and
    attributable (nothing with --no-prefix, which is then torchrun's console exactly)."""
    if teed:
        return torchrun_header
    return rally_prefix if spec.prefix_output else b""


def _stream_plans(
    spec: JobSpec, logs: LogLayout, attempt: int, envs: dict[int, dict[str, str]]
) -> tuple[dict[int, StreamPlan], dict[int, Path]]:
    """Where each worker's streams go: rally's layout (torchrun's default), or --logs-specs'."""
    if spec.logs_specs:
        if logs.custom is None:
            logs.custom = logs_specs.load(spec.logs_specs, spec, logs.real_dir().parent)  # it writes by path
        return logs_specs.plans(logs.custom, envs)
    plans = {}
    for local_rank, env in envs.items():
        rank_dir = logs.rank_dir(attempt, local_rank)
        tee = spec.tee.get(local_rank, 0)
        paths = {STDOUT: rank_dir / "stdout.log", STDERR: rank_dir / "stderr.log"}
        plans[local_rank] = StreamPlan(
            spec.redirects.get(local_rank, 0) | tee, tee, paths, env["TORCHELASTIC_ERROR_FILE"]
        )
    return plans, {}


@dataclass
class LogLayout:
    """Where this node's log files go; one run directory per agent, as torchrun does.

    The run directory is made (0700) and opened once, through directories rally judged
    (rendezvous/base/path_trust.py), and every write of the job goes through that open directory:
    `run_dir` is `/proc/<agent pid>/fd/<n>`, which the kernel resolves to the directory the agent
    holds, not to whatever now has its name. Another user who may rename entries of --log-dir (a
    group-writable project directory) can move the run directory away and put their own, with
    links, in its place: the agent, its helpers and its workers (TORCHELASTIC_ERROR_FILE, the
    heartbeat file) still write into the directory rally made. `shown` turns such a path into
    the directory's real one, for people."""

    run_dir: Path
    fd: int = -1  # the run directory, open (O_PATH) for the agent's lifetime
    custom: Any = None  # --logs-specs: the user's LogsSpecs object, built once (agent/rounds/logs_specs.py)

    @classmethod
    def create(cls, log_dir: str | None, run_id: str) -> LogLayout:
        import tempfile

        safe_run_id = run_id.replace("/", "_")
        if log_dir:
            base = open_directory(log_dir, f"--log-dir {log_dir}", create=True)
        else:
            where = open_directory(tempfile.gettempdir(), "the temporary directory", create=True)
            base = _made_in(where, "rally_")
        try:
            run = _made_in(base, f"{safe_run_id}_")
        finally:
            base.close()
        assert run.fd is not None
        return cls(Path(f"/proc/{os.getpid()}/fd/{run.fd}"), run.fd)

    def real_dir(self) -> Path:
        """The run directory's path now (after a rename too), or `run_dir` when it cannot be read."""
        try:
            return Path(os.readlink(self.run_dir))
        except OSError:
            return self.run_dir

    def shown(self, path: str | Path) -> str:
        """`path` (under `run_dir`) as a person can use it: under the run directory's real path."""
        text, prefix = str(path), str(self.run_dir)
        if text == prefix or text.startswith(prefix + "/"):
            return str(self.real_dir()) + text[len(prefix) :]
        return text

    def attempt_dir(self, attempt: int) -> Path:
        return self.run_dir / f"attempt_{attempt}"

    def rank_dir(self, attempt: int, local_rank: int) -> Path:
        path = self.attempt_dir(attempt) / str(local_rank)
        path.parent.mkdir(mode=0o700, exist_ok=True)  # inside the run directory, which only rally writes
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def error_file(self, attempt: int, local_rank: int) -> str:
        """The worker's TORCHELASTIC_ERROR_FILE, made empty by the agent (exclusively, 0600, never
        through a link): torch's `@record` truncates and writes it, an empty one reads as no error."""
        path = self.rank_dir(attempt, local_rank) / "error.json"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            os.close(os.open(path, flags, 0o600))
        except FileExistsError:  # a rank directory reused by a restart of the same round number
            os.unlink(path)
            os.close(os.open(path, flags, 0o600))
        return str(path)


def _made_in(parent: Walk, prefix: str) -> Walk:
    """A new private directory named `prefix` + random in the open directory `parent`, opened
    without following a link and checked to be the one made (this user's, 0700), as mkdtemp."""
    import secrets

    assert parent.fd is not None
    for _ in range(100):
        name = prefix + secrets.token_hex(4)
        try:
            os.mkdir(name, 0o700, dir_fd=parent.fd)
        except FileExistsError:
            continue
        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent.fd)
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
            os.close(fd)
            raise UnsafePath(f"{parent.real / name} was replaced as soon as rally made it; refusing to write there")
        return Walk(fd, parent.real / name)
    raise FileExistsError(f"no free name for a run directory in {parent.real}")


@dataclass
class WorkerGroup:
    """This node's workers for one round. `streams` are the pipes the agent must read."""

    workers: list[Worker] = field(default_factory=list)
    streams: list[OutputStream] = field(default_factory=list)
    filtered_files: list[BinaryIO] = field(default_factory=list)  # --duplicate-*-filters

    @classmethod
    def start(
        cls,
        spec: JobSpec,
        base_env: dict[str, str],
        assignment: Assignment,
        master: tuple[str, int],
        logs: LogLayout,
        multi_node: bool,
        console_out: ByteSink | None = None,
        console_err: ByteSink | None = None,
        launch: Callable[..., ChildProcess] = spawn,
        local_ranks: set[int] | None = None,
    ) -> WorkerGroup:
        """Start this node's workers. `launch` has `processes.spawn`'s signature: a plain start by
        default, or the worker template's `TemplateClient.spawn` (agent/template/client.py).
        `local_ranks`: only these (replacements for dead workers beside surviving ones, rally.job.run)."""
        console_out = console_out or WholeWrites(sys.stdout.buffer)
        console_err = console_err or WholeWrites(sys.stderr.buffer)
        group = cls()
        host = socket.gethostname()
        duplicates: dict[int, tuple[BinaryIO, tuple[bytes, ...]]] = {}
        envs = {
            local_rank: worker_env(
                spec,
                base_env,
                assignment,
                master,
                local_rank,
                logs.error_file(assignment.round, local_rank),
            )
            for local_rank in (range(spec.nproc_per_node) if local_ranks is None else sorted(local_ranks))
        }
        stream_plans, filtered_paths = _stream_plans(spec, logs, assignment.round, envs)
        for bit, name, filters in (
            (STDOUT, "stdout", spec.duplicate_stdout_filters),
            (STDERR, "stderr", spec.duplicate_stderr_filters),
        ):
            if filters:
                path = filtered_paths.get(bit) or logs.attempt_dir(assignment.round) / f"filtered_{name}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                filtered = open_for_writing(path)  # closed in close(); a worker may have put a FIFO there
                group.filtered_files.append(filtered)
                duplicates[bit] = (filtered, tuple(f.encode() for f in filters))
        for local_rank, env in envs.items():
            rank = assignment.rank_offset + local_rank
            rank_dir = logs.rank_dir(assignment.round, local_rank)
            plan = stream_plans[local_rank]
            error_file = plan.error_file
            heartbeat = heartbeat_path(rank_dir) if spec.is_python else None
            if heartbeat:
                env["RALLY_HEARTBEAT_FILE"] = heartbeat
            output = WorkerOutput()
            if spec.is_python:
                output.stack_file = env["RALLY_STACK_FILE"] = stack_file(rank_dir)
            redirect, tee = plan.redirect, plan.tee
            shown = spec.shows_on_console(local_rank)
            header = tee_prefix(spec, local_rank, rank)
            rally_prefix = f"[{host}:{rank}] ".encode() if multi_node else f"[{rank}] ".encode()
            fds: dict[int, object] = {}
            for bit, name, console in ((STDOUT, "stdout", console_out), (STDERR, "stderr", console_err)):
                path = plan.paths.get(bit, rank_dir / f"{name}.log")
                if redirect & bit and not tee & bit:
                    fds[bit] = open_for_writing(path)  # handed to the child, closed below
                    output.file_paths.append(str(path))
                    if bit == STDERR:
                        output.stderr_file = str(path)
                    continue
                prefix = console_prefix(spec, bool(tee & bit), header, rally_prefix)
                read_end, write_end = os.pipe()
                os.set_blocking(read_end, False)
                fds[bit] = write_end
                output.streams.append(
                    OutputStream(
                        fd=read_end,
                        console=console if shown else None,
                        prefix=prefix,
                        whole_lines=bool(tee & bit) or bool(prefix),
                        file=open_for_writing(path) if tee & bit else None,
                        tail=output.stderr_tail if bit == STDERR else None,
                        duplicate=duplicates.get(bit) if tee & bit else None,  # as torchrun: tee'd streams only
                        duplicate_prefix=header,
                    )
                )
            try:
                process = launch(spec.command(), env, spec.cwd, fds[STDOUT], fds[STDERR])
            finally:
                for value in fds.values():
                    if isinstance(value, int):
                        os.close(value)
                    else:
                        value.close()  # type: ignore[attr-defined]
            error_shown = logs.shown(error_file)
            group.workers.append(
                Worker(local_rank, rank, process, output, error_file, heartbeat, error_file_shown=error_shown)
            )
            group.streams.extend(output.streams)
        return group

    def replace(self, fresh: WorkerGroup) -> list[Worker]:
        """Put `fresh`'s workers in the places of the same local ranks; returns the workers replaced."""
        ranks = {w.local_rank for w in fresh.workers}
        gone = [w for w in self.workers if w.local_rank in ranks]
        for worker in gone:
            worker.process.close()
        self.workers = sorted([w for w in self.workers if w.local_rank not in ranks] + fresh.workers, key=_local)
        self.streams.extend(fresh.streams)
        self.filtered_files.extend(fresh.filtered_files)
        return gone

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.returncode is None]

    def all_succeeded(self) -> bool:
        return all(w.succeeded for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.process.close()
        for stream in self.streams:
            if stream.open:
                stream.finish()
        for filtered in self.filtered_files:
            filtered.close()


def _local(worker: Worker) -> int:
    return worker.local_rank
