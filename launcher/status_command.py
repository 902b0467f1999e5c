"""`rally status`: the job as its rendezvous store sees it, from any machine that can reach it.

Every agent keeps a small record in the store (node, round, restart count, each worker's state,
CPU, memory and heartbeat age), refreshed every couple of seconds by its keep-alive thread.
"""

from __future__ import annotations

import time

import click
from rich.table import Table

from rally.launcher import console
from rally.launcher import validate
from rally.launcher.config import DEFAULT_C10D_PORT, ConfigError, parse_endpoint, parse_etcd_endpoints

MIB = 1024 * 1024


@click.command(name="rally status", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "endpoint", required=True, metavar="HOST[:PORT]", help="The job's rendezvous store.")
@click.option("--rdzv-id", "--rdzv_id", "run_id", required=True, help="The job's run id.")
@click.option(
    "--rdzv-backend", "--rdzv_backend", "backend", default="c10d", show_default=True,
    type=click.Choice(["c10d", "etcd", "etcd-v2"], case_sensitive=False),
    help="etcd: --rdzv-endpoint lists etcd client endpoints HOST[:PORT],...",
)
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the store.")
def status_command(endpoint: str, run_id: str, backend: str, timeout: float) -> int:
    """Show the nodes, round, restart count and workers of a running job."""
    from rally.rendezvous.protocol import read_job_status
    from rally.rendezvous.store import StoreEndpoint, StoreUnavailable, open_store, quiet_torch_logs

    quiet_torch_logs()
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
        store, _ = open_store(where, f"rally/{run_id}/", timeout, timeout)
        status = read_job_status(store)
    except StoreUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    if status is None:
        raise click.ClickException(f"no job with run id '{run_id}' at {where} (no agent has registered there)")
    now = time.time()
    table = Table(title=f"job {run_id} at {where}: round {status['round']}", title_justify="left")
    with_gpu = any(w.get("gpu_memory") is not None for n in status["nodes"] for w in n["workers"])
    columns = ["node", "host", "round", "restarts", "keep-alive", "rank", "pid", "state", "cpu %", "rss MiB"]
    for column in [*columns, *(["gpu MiB"] if with_gpu else []), "heartbeat"]:
        table.add_column(column)
    for node in sorted(status["nodes"], key=lambda n: (n.get("group_rank", 0), n["host"])):
        age = f"{now - node['updated']:.1f} s ago"
        for i, w in enumerate(node["workers"] or [{}]):
            heartbeat = w.get("heartbeat_age")
            table.add_row(
                str(node["group_rank"]) if i == 0 else "",
                node["host"] if i == 0 else "",
                str(node["round"]) if i == 0 else "",
                str(node["restart_count"]) if i == 0 else "",
                age if i == 0 else "",
                str(w.get("rank", "")),
                str(w.get("pid", "")),
                w.get("state", "-"),
                f"{w.get('cpu', 0):.0f}" if w else "",
                f"{w.get('rss', 0) / MIB:.0f}" if w else "",
                *([f"{(w.get('gpu_memory') or 0) / MIB:.0f}" if w else ""] if with_gpu else []),
                "-" if heartbeat is None else f"{heartbeat:.1f} s ago",
            )
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    out.print(table)
    closed = status["closed"]
    if closed is not None:
        console.say(f"the job has ended ({closed.kind}): {closed.detail}")
    return 0
