"""Turn the options into a validated launch: every user error becomes one clear line.

Raw values come from the options model (launcher/options.py): on the command line from click
(flags, then PET_*/RALLY_* environment variables, then the YAML file, then defaults, click's own
precedence, with the file as its `default_map`), from `rally.launch` as keyword arguments; then
SLURM fills in what is still unset (launcher/slurm.py). `Options.parse()` checks each value by
itself; `build_launch` checks them together and builds the agent's `JobSpec` and
`RendezvousPlan`. Every check raises `ConfigError` with a message that says what is wrong and
how to fix it.
"""

from __future__ import annotations

import os
import socket
import sys
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rally.agent.spec import JobSpec
from rally.launcher import validate
from rally.launcher.node_checks_options import node_check_fields
from rally.launcher.options import Options, spec_default
from rally.launcher.preload import parse_preload
from rally.launcher.secret_warnings import secret_warnings
from rally.launcher.validate import ConfigError
from rally.launcher.values import parse_rdzv_conf, parse_std_map, visible_gpu_count
from rally.rendezvous.backends import EndpointError, HostPort, StoreRequest, backend_named
from rally.rendezvous.etcd_conf import ETCD_CONF_KEYS
from rally.rendezvous.plan import RendezvousPlan
from rally.rendezvous.protocol import RendezvousSettings
from rally.rendezvous.store import StoreEndpoint, loopback_address
from rally.rendezvous.token import TokenError, resolve_token

__all__ = ["ConfigError", "Launch", "build_launch", "parse_rdzv_conf"]

# torchrun's variable for the workers' grace period, read when --shutdown-timeout is not given.
SHUTDOWN_TIMEOUT_VARIABLE = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


@dataclass
class Launch:
    """A validated launch: what to run and how to find the other nodes."""

    spec: JobSpec
    plan: RendezvousPlan
    notes: list[str]
    warnings: list[str] = field(default_factory=list)  # launcher/secret_warnings.py: one line each
    checkpoint_token: str = ""
    """The job token the user gave on the command line (--rdzv-conf token=/token_file=), which keys
    checkpoints as RALLY_JOB_TOKEN does (agent/checkpoint/auth.py); never --standalone's random
    token or SLURM's per-job one: a resubmitted job must verify what the earlier one wrote."""


def build_launch(o: Options, script: str | None, script_args: list[str], slurm_job: Any = None) -> Launch:
    """Check every option together and build the agent's inputs. `slurm_job` (launcher/slurm.py's
    SlurmJob, when rally runs inside SLURM) gives the preferred node rank and the job's token."""
    check_entry_point(o, script)
    assert script is not None
    p = o.parse()
    min_nodes, max_nodes = p.nnodes
    validate.check_counts(p.nproc_per_node, max_nodes, p.node_rank)
    notes: list[str] = standalone_overrides(o, p.nnodes)
    conf = p.rdzv_conf
    endpoint, settings, run_id, preferred_rank = plan_rendezvous(o, p, conf, slurm_job)
    warnings: list[str] = []
    try:
        token = resolve_token(
            conf["token"], conf["token_file"], bool(o.standalone), slurm_job.job_id if slurm_job else None, warnings
        )
    except TokenError as exc:
        raise ConfigError(str(exc)) from None
    warnings += secret_warnings(conf, endpoint, token, settings.max_nodes)
    if p.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        notes.append(
            f"setting OMP_NUM_THREADS=1 for each of the {p.nproc_per_node} workers (it was unset); "
            "set it yourself to tune CPU threads"
        )
    # Node rank 0 of a static job is, by definition, reachable at the master address.
    static_master = endpoint.host if backend_named(endpoint.backend).static_ranks and endpoint.host_here else None
    spec = job_spec(o, p, script, script_args, run_id, notes)
    if spec.uses_torchrun_logs() and spec.prefix_output:
        notes.append(
            f"--tee/--redirects: console lines follow torchrun's format ([{spec.role}0]: on tee'd streams, "
            "no prefix on the others) instead of rally's [rank]"
        )
    plan = RendezvousPlan(
        endpoint=endpoint,
        settings=settings,
        local_addr=o.local_addr or static_master or loopback_address(endpoint) or socket.getfqdn(),
        preferred_rank=preferred_rank,
        connect_timeout=conf["join_timeout"],
        read_timeout=conf["read_timeout"],
        token=token,
    )
    return Launch(spec, plan, notes, warnings, token if conf["token"] or conf["token_file"] else "")


def standalone_overrides(o: Options, nnodes: tuple[int, int]) -> list[str]:
    """--standalone runs one node on a private store (as torchrun's does): the rendezvous flags it
    replaces are named in one line, never dropped in silence."""
    if not o.standalone:
        return []
    replaced = [f"--nnodes {o.nnodes}"] if nnodes != (1, 1) else []
    replaced += [f"--rdzv-endpoint {o.rdzv_endpoint}"] if o.rdzv_endpoint else []
    replaced += [f"--rdzv-backend {o.rdzv_backend}"] if o.rdzv_backend not in ("static", "c10d") else []
    replaced += [f"--rdzv-id {o.rdzv_id}"] if o.rdzv_id != spec_default("run_id") else []
    if not replaced:
        return []
    return [
        f"--standalone overrides {', '.join(replaced)}: it runs one node on a private store at a free port, "
        "with a random run id; drop --standalone to use them"
    ]


def trusted_checkpoint_dir(given: str | None, shared: bool) -> str | None:
    """--checkpoint-dir resolved, refused with one line if another user may plant checkpoints in it
    (unless --checkpoint-dir-shared), and a key to sign checkpoints with (agent/checkpoint/auth.py)."""
    if not given:
        return None
    from rally.agent.checkpoint import auth

    path = Path(given).resolve()
    problem = auth.directory_problem(path)
    if problem is not None and not shared:
        raise ConfigError(auth.refusal_line(path, problem).removeprefix("rally: "))
    try:
        auth.job_keys()
    except auth.NoKey as exc:
        raise ConfigError(str(exc).removeprefix("rally: ")) from None
    return str(path)


def check_entry_point(o: Options, script: str | None) -> None:
    """The program to run exists and the entry-point flags fit together."""
    if not script:
        raise ConfigError("no training script given; usage: rally [OPTIONS] SCRIPT [ARGS]... (see rally --help)")
    if o.module and o.no_python:
        raise ConfigError("-m/--module and --no-python cannot be used together")
    if o.run_path and (o.module or o.no_python):
        raise ConfigError("--run-path cannot be combined with -m/--module or --no-python")
    if o.no_python:
        validate.runnable_program(script)
    else:
        validate.python_script(script, bool(o.module))
        if not o.module and not Path(script).is_file():
            raise ConfigError(f"training script '{script}' does not exist (working directory: {os.getcwd()})")


def plan_rendezvous(
    o: Options, p: types.SimpleNamespace, conf: dict[str, Any], slurm_job: Any
) -> tuple[StoreEndpoint, RendezvousSettings, str, int | None]:
    """The store (planned by its backend, rendezvous/backends.py), the membership rules, the run
    id and this node's preferred rank."""
    min_nodes, max_nodes = p.nnodes
    backend = backend_named(o.rdzv_backend, conf["store_type"])
    endpoint, run_id = o.rdzv_endpoint, str(o.rdzv_id)
    if o.standalone:
        backend, endpoint, min_nodes, max_nodes = (
            backend_named("c10d", conf["store_type"]),
            HostPort("localhost", 0),
            1,
            1,
        )
        run_id = str(uuid.uuid4())
    elif backend.static_ranks and not endpoint and o.master_port is None and max_nodes == 1:
        # torchrun 2.13 does the same: a single-node static job needs no fixed port.
        backend, endpoint = backend_named("c10d", conf["store_type"]), HostPort("localhost", 0)
        run_id = str(uuid.uuid4()) if run_id == "none" else run_id
    slurm_rank = slurm_job.node_rank if slurm_job is not None else None
    preferred_rank = p.node_rank if p.node_rank is not None else (0 if backend.static_ranks else slurm_rank)
    if not backend.name.startswith("etcd") and (given := [k for k in ETCD_CONF_KEYS if conf[k] is not None]):
        raise ConfigError(f"--rdzv-conf {given[0]}=... applies to --rdzv-backend etcd only; remove it")
    request = StoreRequest(
        endpoint,
        min_nodes,
        max_nodes,
        run_id,
        p.node_rank,
        o.master_addr,
        p.master_port,
        conf["is_host"],
        conf["store_type"],
        conf,
    )
    try:
        planned = backend.plan(request)
    except EndpointError as exc:
        raise ConfigError(str(exc)) from None
    keep_alive_timeout = (
        conf["keep_alive_timeout"]
        or conf["heartbeat_timeout"]
        or (conf["keep_alive_interval"] * conf["keep_alive_max_attempt"])
    )
    settings = RendezvousSettings(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        join_timeout=conf["join_timeout"],
        last_call_timeout=conf["last_call_timeout"],
        keep_alive_interval=conf["keep_alive_interval"],
        keep_alive_timeout=keep_alive_timeout,
        close_timeout=conf["close_timeout"],
    )
    return planned, settings, run_id, preferred_rank


def shutdown_timeout(given: float | None) -> float:
    """--shutdown-timeout, else torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else JobSpec's default."""
    if given is not None:
        return given
    from_env = os.environ.get(SHUTDOWN_TIMEOUT_VARIABLE, "")
    if from_env.strip():
        return validate.seconds(from_env, SHUTDOWN_TIMEOUT_VARIABLE, zero_ok=True)
    return spec_default("shutdown_timeout")


def job_spec(
    o: Options, p: types.SimpleNamespace, script: str, script_args: list[str], run_id: str, notes: list[str]
) -> JobSpec:
    """What the agent runs on this node, from the parsed options."""
    from rally.launcher.worker_flags import ExtrasError, extras

    nproc = p.nproc_per_node
    grace = shutdown_timeout(p.shutdown_timeout)
    try:
        extra_fields, extra_notes = extras(o, nproc, visible_gpu_count())
    except ExtrasError as exc:
        raise ConfigError(str(exc)) from None
    notes += extra_notes
    return JobSpec(
        entrypoint=script,
        args=tuple(script_args),
        nproc_per_node=nproc,
        run_id=run_id,
        role=o.role,
        max_restarts=p.max_restarts,
        module=bool(o.module),
        no_python=bool(o.no_python),
        run_path=bool(o.run_path),
        log_dir=p.log_dir,
        redirects=parse_std_map(o.redirects, "--redirects", nproc),
        tee=parse_std_map(o.tee, "--tee", nproc),
        local_ranks_filter=p.local_ranks_filter,
        prefix_output=not o.no_prefix,
        quiet=bool(o.quiet),
        shutdown_timeout=float(grace),
        signals_to_handle=p.signals_to_handle,
        preemption_signals=p.preemption_signals,
        preemption_grace=p.preemption_grace,
        requeue=bool(o.requeue),
        **node_check_fields(
            o, p.nnodes[1]
        ),  # --heartbeat-timeout, quarantine, pre-flight (launcher/node_checks_options.py)
        silence_timeout=p.silence_timeout,
        resource_interval=p.resource_interval if p.resource_interval is not None else spec_default("resource_interval"),
        startup_timeout=p.startup_timeout,
        straggler_factor=p.straggler_factor,
        straggler_window=p.straggler_window,
        metrics_port=p.metrics_port,
        metrics_addr=p.metrics_addr,
        checkpoint_dir=trusted_checkpoint_dir(p.checkpoint_dir, bool(o.checkpoint_dir_shared)),
        checkpoint_dir_shared=bool(o.checkpoint_dir_shared),
        crash_loop_limit=p.crash_loop_limit,
        python_exec=os.environ.get("PYTHON_EXEC", sys.executable),
        **extra_fields,
        preload=parse_preload(o.preload, bool(o.no_preload), bool(o.no_python), script, bool(o.module)),
    )
