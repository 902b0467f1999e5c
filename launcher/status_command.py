"""`rally status`: the job as its rendezvous store sees it, from any machine that can reach it.

Every agent keeps a small record in the store (node, round, restart count, each worker's state,
CPU, memory and heartbeat age), refreshed every couple of seconds by its keep-alive thread.
"""

from __future__ import annotations

import os
import time

import click
from rich.table import Table

from rally.launcher import console
from rally.launcher.config import DEFAULT_C10D_PORT, ConfigError, parse_endpoint

MIB = 1024 * 1024


@click.command(name="rally status", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "endpoint", required=True, metavar="HOST[:PORT]", help="The job's rendezvous store.")
@click.option("--rdzv-id", "--rdzv_id", "run_id", required=True, help="The job's run id.")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the store.")
def status_command(endpoint: str, run_id: str, timeout: float) -> int:
    """Show the nodes, round, restart count and workers of a running job."""
    from rally.rendezvous.protocol import read_job_status
    from rally.rendezvous.store import StoreEndpoint, StoreUnavailable, open_store, quiet_torch_logs
    from rally.rendezvous.token import ENV_TOKEN, Signer

    quiet_torch_logs()
    try:
        host, port = parse_endpoint(endpoint, DEFAULT_C10D_PORT)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        token = os.environ.get(ENV_TOKEN, "")  # without it, records are shown unverified
        signer = Signer(token, verify=bool(token))
        store, _ = open_store(StoreEndpoint(host, port, host_here=False), f"rally/{run_id}/", timeout, timeout, signer)
    except StoreUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    status = read_job_status(store)
    if status is None:
        raise click.ClickException(f"no job with run id '{run_id}' at {host}:{port} (no agent has registered there)")
    now = time.time()
    table = Table(title=f"job {run_id} at {host}:{port}: round {status['round']}", title_justify="left")
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
