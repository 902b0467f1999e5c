"""Turn the options into a validated launch: every user error becomes one clear line.

Raw values come from the options model (launcher/options.py): on the command line from click
(flags, then PET_*/RALLY_* environment variables, then the YAML file, then defaults, click's own
precedence, with the file as its `default_map`), from `rally.launch` as keyword arguments; then
SLURM fills in what is still unset (launcher/schedulers/slurm.py). `Options.parse()` checks every value
and fills the agent's `JobSpec` and the rendezvous flags; `build_launch` plans the rendezvous
from those (`RendezvousPlan`) and resolves the job's token. Every check raises `ConfigError`
with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rally.agent.base.spec import JobSpec
from rally.launcher.checks import validate
from rally.launcher.checks.path_checks import check_job_paths
from rally.launcher.checks.validate import ConfigError
from rally.launcher.checks.values import parse_rdzv_conf
from rally.launcher.options import Options, RendezvousOptions
from rally.launcher.secret_warnings import secret_warnings
from rally.rendezvous.backends import EndpointError, HostPort, StoreRequest, backend_named
from rally.rendezvous.base.token import TokenError, resolve_token
from rally.rendezvous.c10d.store import StoreEndpoint, is_loopback_name, loopback_address
from rally.rendezvous.etcd.conf import ETCD_CONF_KEYS
from rally.rendezvous.plan import RendezvousPlan
from rally.rendezvous.protocol import RendezvousSettings

if TYPE_CHECKING:  # imported only inside SLURM (launcher/cli.py)
    from rally.launcher.schedulers.slurm import SlurmJob

__all__ = ["ConfigError", "Launch", "build_launch", "parse_rdzv_conf"]


@dataclass
class Launch:
    """A validated launch: what to run and how to find the other nodes."""

    spec: JobSpec
    plan: RendezvousPlan
    notes: list[str]
    warnings: list[str] = field(default_factory=list)  # launcher/secret_warnings.py: one line each
    checkpoint_token: str = ""
    """The job token the user gave on the command line (--rdzv-conf token=/token_file=), which keys
    checkpoints as RALLY_JOB_TOKEN does (agent/checkpoint/core/auth.py); never --standalone's random
    token or SLURM's per-job one: a resubmitted job must verify what the earlier one wrote."""


def check_environment() -> None:
    """rally's own environment variables that the agent's helpers read (one line, exit 2, not a helper's traceback)."""
    from rally.agent.checkpoint.memory_limit import MEMORY_LIMIT_ENV, memory_limit_bytes

    try:
        memory_limit_bytes(os.environ.get(MEMORY_LIMIT_ENV, ""))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_launch(
    options: Options, script: str | None, script_args: list[str], slurm_job: SlurmJob | None = None
) -> Launch:
    """Check every option together and build the agent's inputs. `slurm_job` (launcher/schedulers/slurm.py's
    SlurmJob, when rally runs inside SLURM) gives the preferred node rank and the job's token."""
    check_entry_point(options, script)
    check_environment()
    parsed = options.parse(script, script_args)
    spec, r = parsed.spec, parsed.rendezvous
    notes = list(parsed.notes)
    conf = r.rdzv_conf
    endpoint, settings, preferred_rank = plan_rendezvous(r, spec.run_id, slurm_job)
    warnings = list(parsed.warnings) + check_job_paths(spec, conf)  # paths before a secret file is read
    try:
        token = resolve_token(
            conf["token"],
            conf["token_file"],
            r.standalone,
            slurm_job.job_id if slurm_job else None,
            warnings,
        )
    except TokenError as exc:
        raise ConfigError(str(exc)) from None
    warnings += secret_warnings(conf, endpoint, token, settings.max_nodes)
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        notes.append(
            f"setting OMP_NUM_THREADS=1 for each of the {spec.nproc_per_node} workers (it was unset); "
            "set it yourself to tune CPU threads"
        )
    # Node rank 0 of a static job is, by definition, reachable at the master address.
    static_master = endpoint.host if backend_named(endpoint.backend).static_ranks and endpoint.host_here else None
    plan = RendezvousPlan(
        endpoint=endpoint,
        settings=settings,
        local_addr=r.local_addr or static_master or loopback_address(endpoint) or socket.getfqdn(),
        preferred_rank=preferred_rank,
        connect_timeout=conf["join_timeout"],
        read_timeout=conf["read_timeout"],
        token=token,
        own_token_when_hosted=one_local_node(endpoint, settings.max_nodes),
    )
    return Launch(spec, plan, notes, warnings, token if conf["token"] or conf["token_file"] else "")


def one_local_node(endpoint: StoreEndpoint, max_nodes: int) -> bool:
    """A job that can only ever have one node, on a c10d store of this machine: like --standalone,
    no other agent needs its token, so when its agent hosts the store it signs with a random one
    (rendezvous/plan.py), and a local user who reaches the port cannot forge its end ("job
    succeeded", exit 0)."""
    if max_nodes != 1 or endpoint.etcd or endpoint.file_path:
        return False
    return endpoint.host_here or is_loopback_name(endpoint.host)


def check_entry_point(options: Options, script: str | None) -> None:
    """The program to run exists and the entry-point flags fit together."""
    if not script:
        raise ConfigError("no training script given; usage: rally [OPTIONS] SCRIPT [ARGS]... (see rally --help)")
    if options.module and options.no_python:
        raise ConfigError("-m/--module and --no-python cannot be used together")
    if options.run_path and (options.module or options.no_python):
        raise ConfigError("--run-path cannot be combined with -m/--module or --no-python")
    if options.no_python:
        validate.runnable_program(script)
    else:
        validate.python_script(script, bool(options.module))
        if not options.module and not Path(script).is_file():
            raise ConfigError(f"training script '{script}' does not exist (working directory: {os.getcwd()})")


def plan_rendezvous(
    rdzv: RendezvousOptions, run_id: str, slurm_job: SlurmJob | None
) -> tuple[StoreEndpoint, RendezvousSettings, int | None]:
    """The store (planned by its backend, rendezvous/backends.py), the membership rules and this
    node's preferred rank."""
    conf = rdzv.rdzv_conf
    min_nodes, max_nodes = rdzv.nnodes
    backend = backend_named(rdzv.rdzv_backend, conf["store_type"])
    endpoint = rdzv.rdzv_endpoint
    if rdzv.standalone:
        backend, endpoint, min_nodes, max_nodes = (
            backend_named("c10d", conf["store_type"]),
            HostPort("localhost", 0),
            1,
            1,
        )
    elif backend.static_ranks and not endpoint and rdzv.master_port is None and max_nodes == 1:
        # torchrun 2.13 does the same: a single-node static job needs no fixed port (its run id:
        # option_checks.run_id).
        backend, endpoint = backend_named("c10d", conf["store_type"]), HostPort("localhost", 0)
    slurm_rank = slurm_job.node_rank if slurm_job is not None else None
    preferred_rank = rdzv.node_rank if rdzv.node_rank is not None else (0 if backend.static_ranks else slurm_rank)
    if not backend.name.startswith("etcd") and (given := [k for k in ETCD_CONF_KEYS if conf[k] is not None]):
        raise ConfigError(f"--rdzv-conf {given[0]}=... applies to --rdzv-backend etcd only; remove it")
    request = StoreRequest(
        endpoint,
        min_nodes,
        max_nodes,
        run_id,
        rdzv.node_rank,
        rdzv.master_addr,
        rdzv.master_port,
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
    return planned, settings, preferred_rank
