"""`rally status`: the job as its rendezvous store sees it, from any machine that can reach it.

Every agent keeps a small record in the store (node, round, restart count, each worker's state,
CPU, memory, heartbeat age, step and step time, stragglers, GPU problems), refreshed every couple
of seconds by its keep-alive thread.

Inside a SLURM job (a batch shell, or `srun --overlap --jobid ID rally status`), the endpoint
and the run id are computed from SLURM exactly as the agent computes them (launcher/slurm.py),
for the step that runs rally: `--slurm-step`, 0 by default, the first `srun` of the job, which
is what the templates in slurm/ run. The current step's own id is not used: `rally status` run
through `srun` is a step of its own. The store host is the first host of the job's node list.

`rally status RUN_DIR` finds the job from what its agent wrote in its run directory
(agent/observe/run_info.py), and shows that directory's report and last restart once the store is gone.
`--json` prints one JSON object instead of the table. Either way the last restart's cause is
shown (each node's status record keeps the newest round end it went round again after).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from rally.agent.display import console
from rally.agent.display.worker_table import straggler_line, worker_table
from rally.agent.observe import run_info
from rally.launcher.validate import ConfigError
from rally.launcher.values import parse_rdzv_conf
from rally.rendezvous.backends import BACKENDS, SELECTABLE, EndpointError, HostPort, backend_named, open_endpoint
from rally.rendezvous.protocol import job_prefix
from rally.rendezvous.store import StoreEndpoint


@click.command(name="status", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", required=False, metavar="[RUN_DIR]", type=click.Path(path_type=Path))
@click.option(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "endpoint",
    default=None,
    metavar="HOST[:PORT]",
    help="The job's rendezvous store (inside a SLURM job: taken from SLURM).",
)
@click.option(
    "--rdzv-id", "--rdzv_id", "run_id", default=None, help="The job's run id (inside a SLURM job: taken from SLURM)."
)
@click.option(
    "--rdzv-backend",
    "--rdzv_backend",
    "backend",
    default="c10d",
    show_default=True,
    type=click.Choice(list(SELECTABLE), case_sensitive=False),
    help="etcd: --rdzv-endpoint lists etcd client endpoints HOST[:PORT],...",
)
@click.option(
    "--rdzv-conf",
    "--rdzv_conf",
    "rdzv_conf",
    default="",
    metavar="K=V,...",
    help="etcd: TLS and user keys as the job got them (protocol, cacert, cert, key, username, password_file).",
)
@click.option(
    "--slurm-step",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Inside a SLURM job: the srun step that runs rally.",
)
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the store.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout instead of the table (for scripts).")
def status_command(
    run_dir: Path | None,
    endpoint: str | None,
    run_id: str | None,
    backend: str,
    rdzv_conf: str,
    slurm_step: int,
    timeout: float,
    as_json: bool,
) -> int:
    """Show the nodes, round, restart count and workers of a running job.

    RUN_DIR is the run directory a job printed at start (in --log-dir): the job is found from
    what its agent wrote there, and once it is over, its report and last restart are shown."""
    from rally.rendezvous.store import StoreUnavailable, quiet_torch_logs
    from rally.rendezvous.store_connect import NoStoreThere

    quiet_torch_logs()
    file_store = None
    found: str | HostPort | None = endpoint  # the flag's, the run directory's or SLURM's store host
    if run_dir is not None:
        try:
            run_dir = run_info.find_run_dir(run_dir)
            written = run_info.read_endpoint(run_dir)
        except run_info.RunDirError as exc:
            raise click.UsageError(str(exc)) from None
        found, run_id = endpoint or written.get("endpoint"), run_id or written["run_id"]
        backend, file_store = written.get("backend") or backend, written.get("file_store")
        if (run_info.read_report(run_dir) or {}).get("outcome", "running") != "running":  # over: no store to ask
            return _show_finished(run_dir, str(run_id), as_json, f"job {run_id} has ended", str(found or file_store))
    else:
        found, run_id = fill_from_slurm(endpoint, run_id, slurm_step)
    where = _where(found, backend, file_store, rdzv_conf)
    try:
        status = read_status(where, str(run_id), timeout)
    except (StoreUnavailable, NoStoreThere) as exc:
        if run_dir is None:
            raise ConfigError(str(exc)) from None  # one line, exit 2 (launcher/cli.py)
        return _show_finished(
            run_dir, str(run_id), as_json, f"job {run_id}: its store is not answering ({exc})", str(where)
        )
    if status is None:
        if run_dir is not None:
            return _show_finished(
                run_dir, str(run_id), as_json, f"job {run_id}: no agent has registered at {where}", str(where)
            )
        raise click.ClickException(f"no job with run id '{run_id}' at {where} (no agent has registered there)")
    status["last_restart"] = last_restart(status["nodes"])
    if as_json:
        click.echo(json.dumps(as_record(run_id, str(where), status, "store"), default=str))
        return 0
    show_running(str(run_id), str(where), status)
    return 0


def _where(endpoint: str | HostPort | None, backend: str, file_store: str | None, rdzv_conf: str) -> StoreEndpoint:
    """Where the job's store is, from the registry's backend (a file store: its path)."""
    try:
        if file_store:
            return BACKENDS["file"].locate(file_store)
        return backend_named(backend).locate(endpoint or "", parse_rdzv_conf(rdzv_conf))
    except (EndpointError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None


def read_status(where: StoreEndpoint, run_id: str, timeout: float) -> dict | None:
    """The job's status from its store (StoreUnavailable when the store cannot be reached)."""
    from rally.rendezvous.status import read_job_status
    from rally.rendezvous.token import Signer, TokenError, env_token

    try:
        token = env_token()  # without it, records are shown unverified
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None
    from rally.rendezvous.store_connect import bounded

    store = open_endpoint(where, job_prefix(run_id), timeout, timeout, Signer(token, verify=bool(token))).store
    # Bounded as a whole: a store that freezes after the connect must not hang the command.
    return bounded(lambda: read_job_status(store), timeout, f"reading job {run_id} from {where}")


def last_restart(nodes: list[dict]) -> dict | None:
    """Why the job last went round again: the newest round end any node recorded."""
    seen = [n["last_restart"] for n in nodes if isinstance(n.get("last_restart"), dict)]
    return max(seen, key=lambda r: r.get("round") if isinstance(r.get("round"), int) else -1, default=None)


def restart_line(restart: dict | None) -> str:
    if not restart:
        return "no restart so far"
    return f"last restart: round {restart.get('round')} ended ({restart.get('kind')}): {restart.get('detail')}"


def as_record(run_id: str, where: str, status: dict, source: str) -> dict:
    """`rally status --json`: the same facts as the table, as one JSON object."""
    closed = status.get("closed")
    if closed is not None and not isinstance(closed, dict):
        closed = {"kind": str(closed.kind), "detail": closed.detail}
    return {
        "run_id": run_id,
        "endpoint": where,
        "source": source,  # "store": the running job; "run_dir": what its agent left behind
        "round": status.get("round"),
        "closed": closed,
        "last_restart": status.get("last_restart"),
        "nodes": status.get("nodes", []),
        **{k: status[k] for k in ("outcome", "exit_code", "report") if k in status},
    }


def show_running(run_id: str, where: str, status: dict) -> None:
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    out.print(status_table(run_id, where, status, time.time()))
    for node in status["nodes"]:
        for w in node.get("workers") or []:
            if w.get("straggler"):
                out.print(straggler_line(w, node.get("host")), highlight=False)
        if node.get("gpu_problems"):
            out.print(f"unhealthy GPUs on {node.get('host')}: " + "; ".join(node["gpu_problems"]), highlight=False)
    for node in status["nodes"]:
        if node.get("waiting"):  # what it waits for (rendezvous/waiting.py, agent/node_waits.py)
            updated = node.get("updated")
            age = f" ({time.time() - updated:.0f} s ago)" if isinstance(updated, (int, float)) else ""
            out.print(f"{node.get('host')}: {node['waiting']}{age}", highlight=False)
    out.print(restart_line(status["last_restart"]), highlight=False)
    for host, reason in (status.get("quarantined") or {}).items():
        out.print(f"quarantined: {host} ({reason})", highlight=False)
    for line in preflight_lines(status.get("preflight")):
        out.print(line, highlight=False)
    closed = status["closed"]
    if closed is not None:
        console.say(f"the job has ended ({closed.kind}): {closed.detail}")


def _show_finished(run_dir: Path, run_id: str, as_json: bool, heading: str, where: str) -> int:
    """The store is gone (the job ended, or its host did): what the agent left in RUN_DIR."""
    report = run_info.read_report(run_dir) or {}
    status = {
        "round": None,
        "closed": None,
        "nodes": [],
        "last_restart": run_info.last_restart_from_events(run_dir),
        "outcome": report.get("outcome", "unknown (no report.json: the agent may have been killed)"),
        "exit_code": report.get("exit_code"),
        "report": str(run_dir / run_info.REPORT_FILE) if report else None,
    }
    if as_json:
        click.echo(json.dumps({**as_record(run_id, where, status, "run_dir"), "run_dir": str(run_dir)}, default=str))
        return 0
    click.echo(f"{heading}; from {run_dir}:")
    exit_code = "" if status["exit_code"] is None else f", exit code {status['exit_code']}"
    click.echo(f"outcome: {status['outcome']}{exit_code}")
    click.echo(restart_line(status["last_restart"]))
    if status["report"]:
        click.echo(f"report: {status['report']}")
    return 0


def preflight_lines(verdict: dict | None) -> list[str]:
    """The last pre-flight check (agent/checks/preflight.py): each node's numbers, and who was left out."""
    if not isinstance(verdict, dict):
        return []
    lines = [f"pre-flight of round {verdict.get('round')}: {verdict.get('summary', '')}"]
    for node in verdict.get("nodes") or []:
        if isinstance(node, dict):
            lines.append(f"  {node.get('host')}: {node.get('line', '')}")
    return lines


def fill_from_slurm(endpoint: str | None, run_id: str | None, step: int) -> tuple[str | HostPort, str]:
    """What is missing of endpoint and run id, taken from SLURM as the agent of `step` takes it."""
    if endpoint and run_id:
        return endpoint, run_id
    from rally.launcher.slurm import SlurmJob

    job_env = {k: v for k, v in os.environ.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    try:
        job = SlurmJob.from_env(job_env)
    except ValueError as exc:
        raise click.UsageError(
            f"cannot read the SLURM environment: {exc}; give --rdzv-endpoint and --rdzv-id"
        ) from None
    if job is None:
        raise click.UsageError(
            "give --rdzv-endpoint HOST:PORT and --rdzv-id ID (only inside a SLURM job step are they taken from SLURM)"
        )
    job = dataclasses.replace(job, step_id=step)
    return endpoint or job.store_address, run_id or job.run_id


def status_table(run_id: str, where: str, status: dict, now: float) -> Table:
    """Every node's workers, one row each (agent/display/worker_table.py), the node's columns first."""
    return worker_table(status["nodes"], f"job {run_id} at {where}: round {status['round']}", per_node=True, now=now)
