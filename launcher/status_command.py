"""`rally status`: the job as its rendezvous store sees it, from any machine that can reach it.

Every agent keeps a small record in the store (node, round, restart count, each worker's state,
CPU, memory, heartbeat age, step and step time, stragglers, GPU problems), refreshed every couple
of seconds by its keep-alive thread.

Inside a SLURM job (a batch shell, or `srun --overlap --jobid ID rally status`), the endpoint
and the run id are computed from SLURM exactly as the agent computes them (launcher/slurm.py),
for the step that runs rally: `--slurm-step`, 0 by default, the first `srun` of the job, which
is what the templates in slurm/ run. The current step's own id is not used: `rally status` run
through `srun` is a step of its own. The store host is the first host of the job's node list.
"""

from __future__ import annotations

import dataclasses
import os
import time

import click
from rich.console import Console
from rich.table import Table

from rally.launcher import console, validate
from rally.launcher.config import DEFAULT_C10D_PORT, ConfigError, parse_endpoint, parse_etcd_endpoints
from rally.launcher.worker_table import straggler_line, worker_table


@click.command(name="status", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "endpoint", default=None, metavar="HOST[:PORT]", help="The job's rendezvous store (inside a SLURM job: taken from SLURM).")
@click.option("--rdzv-id", "--rdzv_id", "run_id", default=None, help="The job's run id (inside a SLURM job: taken from SLURM).")
@click.option(
    "--rdzv-backend", "--rdzv_backend", "backend", default="c10d", show_default=True,
    type=click.Choice(["c10d", "etcd", "etcd-v2"], case_sensitive=False),
    help="etcd: --rdzv-endpoint lists etcd client endpoints HOST[:PORT],...",
)
@click.option("--slurm-step", type=click.IntRange(min=0), default=0, show_default=True, help="Inside a SLURM job: the srun step that runs rally.")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the store.")
def status_command(endpoint: str | None, run_id: str | None, backend: str, slurm_step: int, timeout: float) -> int:
    """Show the nodes, round, restart count and workers of a running job."""
    from rally.rendezvous.status import read_job_status
    from rally.rendezvous.store import StoreEndpoint, StoreUnavailable, open_store, quiet_torch_logs
    from rally.rendezvous.token import ENV_TOKEN, Signer

    quiet_torch_logs()
    endpoint, run_id = fill_from_slurm(endpoint, run_id, slurm_step)
    try:
        if backend.lower().startswith("etcd"):
            where = StoreEndpoint("", 0, host_here=False, etcd=parse_etcd_endpoints(endpoint))
        else:
            host, port = parse_endpoint(endpoint, DEFAULT_C10D_PORT)
            validate.resolvable(host, "--rdzv-endpoint")
            where = StoreEndpoint(host, port, host_here=False)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        token = os.environ.get(ENV_TOKEN, "")  # without it, records are shown unverified
        signer = Signer(token, verify=bool(token))
        store, _ = open_store(where, f"rally/{run_id}/", timeout, timeout, signer)
        status = read_job_status(store)
    except StoreUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    if status is None:
        raise click.ClickException(f"no job with run id '{run_id}' at {where} (no agent has registered there)")
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    out.print(status_table(run_id, str(where), status, time.time()))
    for node in status["nodes"]:
        for w in node.get("workers") or []:
            if w.get("straggler"):
                out.print(straggler_line(w, node.get("host")), highlight=False)
        if node.get("gpu_problems"):
            out.print(f"unhealthy GPUs on {node.get('host')}: " + "; ".join(node["gpu_problems"]), highlight=False)
    for host, reason in (status.get("quarantined") or {}).items():
        out.print(f"quarantined: {host} ({reason})", highlight=False)
    for line in preflight_lines(status.get("preflight")):
        out.print(line, highlight=False)
    closed = status["closed"]
    if closed is not None:
        console.say(f"the job has ended ({closed.kind}): {closed.detail}")
    return 0


def preflight_lines(verdict: dict | None) -> list[str]:
    """The last pre-flight check (agent/preflight.py): each node's numbers, and who was left out."""
    if not isinstance(verdict, dict):
        return []
    lines = [f"pre-flight of round {verdict.get('round')}: {verdict.get('summary', '')}"]
    for node in verdict.get("nodes") or []:
        if isinstance(node, dict):
            lines.append(f"  {node.get('host')}: {node.get('line', '')}")
    return lines


def fill_from_slurm(endpoint: str | None, run_id: str | None, step: int) -> tuple[str, str]:
    """What is missing of endpoint and run id, taken from SLURM as the agent of `step` takes it."""
    if endpoint and run_id:
        return endpoint, run_id
    from rally.launcher.slurm import SlurmJob

    job_env = {k: v for k, v in os.environ.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    try:
        job = SlurmJob.from_env(job_env)
    except ValueError as exc:
        raise click.UsageError(f"cannot read the SLURM environment: {exc}; give --rdzv-endpoint and --rdzv-id") from None
    if job is None:
        raise click.UsageError(
            "give --rdzv-endpoint HOST:PORT and --rdzv-id ID (only inside a SLURM job step are they taken from SLURM)"
        )
    job = dataclasses.replace(job, step_id=step)
    return endpoint or f"{job.store_host}:{job.store_port}", run_id or job.run_id


def status_table(run_id: str, where: str, status: dict, now: float) -> Table:
    """Every node's workers, one row each (launcher/worker_table.py), the node's columns first."""
    return worker_table(status["nodes"], f"job {run_id} at {where}: round {status['round']}", per_node=True, now=now)
