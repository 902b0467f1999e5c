"""`rally status`: the job as its rendezvous store sees it, from any machine that can reach it.

Every agent keeps a small record in the store (node, round, restart count, each worker's state,
CPU, memory, heartbeat age, step and step time, stragglers, GPU problems), refreshed every couple
of seconds by its keep-alive thread.

Inside a SLURM job (a batch shell, or `srun --overlap --jobid ID rally status`), the endpoint
and the run id are computed from SLURM exactly as the agent computes them (launcher/schedulers/slurm.py),
for the step that runs rally: `--slurm-step`, 0 by default, the first `srun` of the job, which
is what the templates in slurm/ run. The current step's own id is not used: `rally status` run
through `srun` is a step of its own. The store host is the first host of the job's node list.

`rally status RUN_DIR` finds the job from what its agent wrote in its run directory
(agent/observe/run_info.py), and shows that directory's report and last restart once the store is gone.
`--json` prints one JSON object instead of the table. Either way the last restart's cause is
shown (each node's status record keeps the newest round end it went round again after).

What it reads, anyone who reaches a store without a job token, or writes into a shared --log-dir,
may have written: so it reads as the agent reads its workers' files. Every record is checked
against its writer's types (rendezvous/status/schema.py), every file opened without following a
link or blocking and read up to a cap (agent/base/untrusted_files.py), every string escaped before
it reaches the terminal (agent/display/untrusted_text.py) and rich markup in it never
interpreted. A store that refuses the connection (the job has ended: its store went with it) is
said at once, with where the job's run directory is.

It never imports torch for a c10d or etcd store: a c10d store is read through
rendezvous/c10d/wire.py (c10d's wire protocol, standard library only), and the command is
loaded without the run command's modules (launcher/entry.py). Only a FileStore, whose format
is torch's, is read through torch.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from rally.agent.display import console
from rally.agent.display.untrusted_text import printable
from rally.agent.display.worker_table import hang_line, straggler_line, worker_table
from rally.agent.observe import job_view, run_info
from rally.launcher.checks.validate import ConfigError, seconds
from rally.launcher.schedulers.slurm import inside_a_job
from rally.rendezvous.backends import BACKENDS, EndpointError, HostPort, backend_named, open_endpoint
from rally.rendezvous.base.keys import job_prefix
from rally.rendezvous.base.kv import StoreReader
from rally.rendezvous.c10d.store import StoreEndpoint
from rally.rendezvous.status.schema import MAX_ITEMS, VERDICT, checked

if TYPE_CHECKING:  # imported where a store is opened: `rally status` loads no more than it needs
    from rally.rendezvous.base.token import Signer

# How long the first connect to a c10d store may take before the ordinary (retrying) connect
# takes over; a refusal comes back at once and ends the command.
PROBE_SECONDS = 2.0


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
    help="c10d, etcd, etcd-v2, static, or an installed package's (rally.rendezvous_backends); "
    "etcd: --rdzv-endpoint lists etcd client endpoints HOST[:PORT],...",
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
    what its agent wrote there, and once it is over, its outcome, root cause and last restart are
    shown. With nothing named (outside a SLURM job): your recent runs on this machine."""
    from rally.rendezvous.c10d.connect import NoStoreThere
    from rally.rendezvous.c10d.store import StoreUnavailable, quiet_torch_logs

    quiet_torch_logs()
    timeout = seconds(timeout, "--timeout", zero_ok=False)  # -1, nan, inf: one line, exit 2 (socket would raise)
    token = job_token()  # bad input first, before any store or file is looked at
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
        if _report_outcome(run_dir) != "running":  # over: no store to ask
            return _show_finished(run_dir, str(run_id), as_json, f"job {run_id} has ended", str(found or file_store))
        seen = job_view.read_job_view(run_dir, str(run_id))
        if seen is not None:  # node 0 runs here: its view of the job, seconds old, without a store
            view, age = seen
            note = f"as of {age:.1f} s ago: node 0's view in {run_dir / job_view.VIEW_FILE} (the store was not asked)"
            return _show_status(str(run_id), str(found or file_store), view, as_json, "view", age, note)
    elif endpoint is None and run_id is None and not inside_a_job(os.environ):
        return _list_runs(as_json)  # nothing named and not in a SLURM job: this user's recent runs
    else:
        found, run_id = fill_from_slurm(endpoint, run_id, slurm_step)
    where = _where(found, backend, file_store, rdzv_conf)
    if _refused(where, timeout):  # nothing listens: a job's own store ends with it
        if run_dir is None:
            raise ConfigError(printable(ended_line(str(where), str(run_id)), limit=2000))  # one line, exit 2
        heading = f"job {run_id}: nothing listens at {where} (its store is gone)"
        return _show_finished(run_dir, str(run_id), as_json, heading, str(where))
    try:
        status = read_status(where, str(run_id), timeout, token)
    except (StoreUnavailable, NoStoreThere) as exc:
        if run_dir is None:
            raise ConfigError(printable(exc, limit=2000)) from None  # one line, exit 2 (launcher/cli.py)
        return _show_finished(
            run_dir, str(run_id), as_json, f"job {run_id}: its store is not answering ({exc})", str(where)
        )
    if status is None:
        if run_dir is not None:
            return _show_finished(
                run_dir, str(run_id), as_json, f"job {run_id}: no agent has registered at {where}", str(where)
            )
        raise click.ClickException(
            printable(f"no job with run id '{run_id}' at {where} (no agent has registered there)", limit=2000)
        )
    return _show_status(str(run_id), str(where), status, as_json, "store")


def _show_status(
    run_id: str, where: str, status: dict, as_json: bool, source: str, age: float | None = None, note: str = ""
) -> int:
    """The running job's table (or --json), read from its store or, `age` seconds old, from node 0's view."""
    status["last_restart"] = last_restart(status["nodes"])
    if as_json:
        record = as_record(run_id, where, status, source)
        if age is not None:
            record["age"] = round(age, 3)
        click.echo(json.dumps(record, default=str))
        return 0
    show_running(run_id, where, status, note)
    return 0


def _list_runs(as_json: bool) -> int:
    """`rally status` with nothing named: this user's recent runs on this machine, newest first,
    each with the command that shows it."""
    runs = run_info.recent_runs()
    rows = [
        {
            "run_id": record["run_id"],
            "started": record["started"],
            "outcome": _report_outcome(run_dir),
            "run_dir": str(run_dir),
        }
        for run_dir, record in runs
    ]
    if as_json:
        click.echo(json.dumps({"runs": rows}))
        return 0
    where = f"{Path(tempfile.gettempdir()) / 'rally_*'} and {run_info.run_index()}"
    if not rows:
        click.echo(
            printable(
                f"no runs of yours on this machine (looked in {where}); give RUN_DIR, or --rdzv-endpoint "
                "HOST:PORT and --rdzv-id ID",
                limit=2000,
            )
        )
        return 0
    click.echo(printable(f"your recent runs on this machine, newest first (from {where}):", limit=2000))
    for row in rows:  # the command that shows each, whole on its own line, to copy
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["started"]))
        click.echo(printable(f"{started}  {row['outcome']:<10} {row['run_id']}", limit=2000))
        click.echo(printable(f"    rally status {shlex.quote(row['run_dir'])}", limit=4000))
    return 0


def _refused(where: StoreEndpoint, timeout: float) -> bool:
    """Whether a c10d store's port refuses a connection (nothing listens: a job's own store ends
    with it). Anything else (it accepts, a name that does not resolve yet, a host that does not
    answer) is left to the store's own connect, which waits up to --timeout."""
    if where.etcd or where.file_path:
        return False
    try:
        socket.create_connection((where.host, where.port), timeout=min(timeout, PROBE_SECONDS)).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass
    return False


def ended_line(where: str, run_id: str) -> str:
    """What to say when nothing listens at the job's store: it has ended (or not yet started),
    and what the job left behind is in its run directory, named where it is on this machine."""
    runs = run_info.run_dirs_of(run_id)
    if runs:
        shown = f"rally status {runs[0]}" + (f" (the newest of {len(runs)} with that run id)" if len(runs) > 1 else "")
    else:
        shown = (
            "rally status RUN_DIR (the run directory the job printed at start: <--log-dir>/<run id>_*, "
            f"by default {Path(tempfile.gettempdir()) / 'rally_*'}/<run id>_*, on the node that ran it)"
        )
    return (
        f"nothing listens at {where} (connection refused): job {run_id} has ended, or its store is not up yet; "
        f"what a job leaves behind is in its run directory: {shown}"
    )


def _report_outcome(run_dir: Path) -> str:
    """report.json's outcome: "running" while there is none yet (the agent writes it last), or
    none that the agent wrote."""
    try:
        report = run_info.read_report(run_dir)
    except run_info.Unreadable:
        return "running"  # not a report the agent wrote: ask the store, then say what was wrong
    outcome = (report or {}).get("outcome", "running")
    return outcome if isinstance(outcome, str) else "unknown"


def _where(endpoint: str | HostPort | None, backend: str, file_store: str | None, rdzv_conf: str) -> StoreEndpoint:
    """Where the job's store is, from the registry's backend (a file store: its path)."""
    try:
        if file_store:
            return BACKENDS["file"].locate(file_store)
        from rally.launcher.checks.values import parse_rdzv_conf  # its import pulls in the run options' modules

        return backend_named(backend).locate(endpoint or "", parse_rdzv_conf(rdzv_conf) if rdzv_conf else {})
    except (EndpointError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None


def job_token() -> str:
    """RALLY_JOB_TOKEN, to verify records with ("" without it: records are shown unverified)."""
    from rally.rendezvous.base.token import TokenError, env_token

    try:
        return env_token()
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None


def read_status(where: StoreEndpoint, run_id: str, timeout: float, token: str) -> dict | None:
    """The job's status from its store (StoreUnavailable or NoStoreThere when it cannot be read)."""
    from rally.rendezvous.base.token import Signer
    from rally.rendezvous.c10d.connect import bounded
    from rally.rendezvous.status.reader import read_job_status

    signer = Signer(token, verify=bool(token))
    # Bounded as a whole: a store that freezes after the connect must not hang the command.
    return bounded(
        lambda: read_job_status(open_reader(where, job_prefix(run_id), timeout, signer)),
        timeout,
        f"reading job {run_id} from {where}",
    )


def open_reader(where: StoreEndpoint, prefix: str, timeout: float, signer: Signer) -> StoreReader:
    """A reader of the job's keys: a c10d TCPStore through rendezvous/c10d/wire.py (no torch:
    its import would be most of the command's time), once the endpoint has answered as a c10d
    store; etcd through its own client (no torch either); a FileStore, whose format is torch's,
    through torch."""
    if where.etcd or where.file_path:
        if where.file_path:
            _import_store_client()
        return open_endpoint(where, prefix, timeout, timeout, signer).store
    from rally.rendezvous.c10d.connect import wait_for_store
    from rally.rendezvous.c10d.wire import WireStore

    describe = f"the rendezvous store at {where}"
    # wait: bounded, said by rendezvous/c10d/connect.py _connect: `timeout` (--timeout), with a line
    # every few seconds while the port does not answer
    wait_for_store(where.host, where.port, describe, timeout, timeout)  # NoStoreThere: one line
    return WireStore(where.host, where.port, prefix, timeout, signer)


def _import_store_client() -> None:
    """torch, for its FileStore, without the warning it prints where NumPy is missing or of
    another ABI ("Failed to initialize NumPy"): `rally status` never touches a tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy")
        import torch.distributed  # noqa: F401


def last_restart(nodes: list[dict]) -> dict | None:
    """Why the job last went round again: the newest round end any node recorded."""
    seen = [n["last_restart"] for n in nodes if isinstance(n.get("last_restart"), dict)]
    return max(seen, key=lambda r: r.get("round") if isinstance(r.get("round"), int) else -1, default=None)


def restart_line(restart: dict | None, ended: bool = False) -> str:
    """The last restart's cause; without one, "no restart so far" while the job runs, and "the
    job never restarted" once it has ended (nothing is "so far" of a job that is over)."""
    if not restart:
        return "the job never restarted" if ended else "no restart so far"
    return printable(
        f"last restart: round {restart.get('round')} ended ({restart.get('kind')}): {restart.get('detail')}",
        limit=1000,
    )


def as_record(run_id: str, where: str, status: dict, source: str) -> dict:
    """`rally status --json`: the same facts as the table, as one JSON object."""
    closed = status.get("closed")
    if closed is not None and not isinstance(closed, dict):
        closed = {"kind": str(closed.kind), "detail": closed.detail}
    return {
        "run_id": run_id,
        "endpoint": where,
        # "store": the running job; "view": node 0's view of it in RUN_DIR, `age` seconds old;
        # "run_dir": what its agent left behind
        "source": source,
        "round": status.get("round"),
        "closed": closed,
        "last_restart": status.get("last_restart"),
        "nodes": status.get("nodes", []),
        **{k: status[k] for k in ("outcome", "exit_code", "report") if k in status},
    }


def terminal_safe(value: object) -> Any:
    """A checked record (rendezvous/status/schema.py) with every string made printable."""
    if isinstance(value, dict):
        return {k: terminal_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [terminal_safe(v) for v in value]
    return printable(value) if isinstance(value, str) else value


def show_running(run_id: str, where: str, status: dict, note: str = "") -> None:
    # No markup, emoji or highlighting: nothing in a record is read as a rich instruction.
    out = Console(markup=False, emoji=False, highlight=False)
    if not out.is_terminal:
        out = Console(width=160, markup=False, emoji=False, highlight=False)
    nodes = terminal_safe(status["nodes"])
    shown = {**status, "nodes": nodes, "round": "-" if status["round"] is None else status["round"]}
    out.print(status_table(printable(run_id), printable(where), shown, time.time()))
    if note:
        out.print(printable(note, limit=2000))
    for node in nodes:
        for w in node.get("workers") or []:
            if w.get("straggler") and _straggler_complete(w):
                out.print(straggler_line(w, node.get("host")))
        if node.get("gpu_problems"):
            out.print(f"unhealthy GPUs on {node.get('host')}: " + "; ".join(node["gpu_problems"]))
        hang = hang_line(node, time.time())
        if hang:
            out.print(hang)
    for node in nodes:
        if node.get("waiting"):  # what it waits for (rendezvous/status/waiting.py, agent/rounds/node_waits.py)
            updated = node.get("updated")
            age = f" ({time.time() - updated:.0f} s ago)" if isinstance(updated, (int, float)) else ""
            out.print(f"{node.get('host')}: {node['waiting']}{age}")
    closed = status["closed"]
    out.print(restart_line(status["last_restart"], ended=closed is not None))
    for host, reason in list((status.get("quarantined") or {}).items())[:MAX_ITEMS]:
        out.print(f"quarantined: {printable(host)} ({printable(reason)})")
    for line in preflight_lines(status.get("preflight")):
        out.print(line)
    if closed is not None:
        kind, detail = (
            (closed.get("kind"), closed.get("detail")) if isinstance(closed, dict) else (closed.kind, closed.detail)
        )
        console.say(printable(f"the job has ended ({kind}): {detail}", limit=1000))


def _straggler_complete(worker: dict) -> bool:
    """A straggler entry with the fields its line formats (a checked record may lack some)."""
    s = worker["straggler"]
    return worker.get("rank") is not None and s.get("step_time") is not None and s.get("median") is not None


def _show_finished(run_dir: Path, run_id: str, as_json: bool, heading: str, where: str) -> int:
    """The store is gone (the job ended, or its host did): what the agent left in RUN_DIR. A file
    there that is not what the agent writes (a FIFO, a link, too large, not JSON) is not read:
    one line says so, and what it would have told is "unknown"."""
    report_problem = events_problem = None
    try:
        report = run_info.read_report(run_dir)
    except run_info.Unreadable as exc:
        report, report_problem = None, str(exc)
    try:
        restart = run_info.last_restart_from_events(run_dir)
    except run_info.Unreadable as exc:
        restart, events_problem = None, str(exc)
    problems = [p for p in (report_problem, events_problem) if p]
    outcome, exit_code = (report or {}).get("outcome"), (report or {}).get("exit_code")
    if not isinstance(outcome, str):
        if report_problem:
            outcome = "unknown (report.json was not read)"
        elif report is not None:
            outcome = "unknown (report.json has no outcome)"
        else:
            outcome = "unknown (no report.json: the agent may have been killed)"
    status: dict[str, Any] = {
        "round": None,
        "closed": None,
        "nodes": [],
        "last_restart": restart,
        "outcome": outcome[: run_info.MAX_TEXT],
        "exit_code": exit_code if type(exit_code) is int else None,
        "report": str(run_dir / run_info.REPORT_FILE) if report is not None else None,
    }
    if as_json:
        record = {**as_record(run_id, where, status, "run_dir"), "run_dir": str(run_dir), "not_read": problems}
        record["root_cause"] = run_info.root_cause(report) if status["outcome"] != "succeeded" else None
        click.echo(json.dumps(record, default=str))
        return 0
    click.echo(printable(f"{heading}; from {run_dir}:", limit=2000))
    code = "" if status["exit_code"] is None else f", exit code {status['exit_code']}"
    click.echo(printable(f"outcome: {status['outcome']}{code}", limit=1000))
    cause = run_info.root_cause(report) if status["outcome"] != "succeeded" else None
    if cause:
        click.echo(f"root cause: {cause}")
    unknown = "last restart: unknown (events.jsonl was not read)"
    click.echo(unknown if events_problem else restart_line(restart, ended=True))
    for line in problems:
        click.echo(line)
    if status["report"]:
        click.echo(printable(f"report: {status['report']}", limit=2000))
    return 0


def preflight_lines(record: object) -> list[str]:
    """The last pre-flight check (agent/checks/preflight.py): each node's numbers, and who was left out."""
    verdict = checked(record, VERDICT)
    if not verdict:
        return []
    lines = [printable(f"pre-flight of round {verdict.get('round')}: {verdict.get('summary', '')}", limit=1000)]
    for node in verdict.get("nodes") or []:
        lines.append(printable(f"  {node.get('host')}: {node.get('line', '')}", limit=1000))
    return lines


def fill_from_slurm(endpoint: str | None, run_id: str | None, step: int) -> tuple[str | HostPort, str]:
    """What is missing of endpoint and run id, taken from SLURM as the agent of `step` takes it."""
    if endpoint and run_id:
        return endpoint, run_id
    from rally.launcher.schedulers.slurm import SlurmJob

    try:
        job = SlurmJob.of_step(os.environ, step)
    except ValueError as exc:
        raise click.UsageError(
            f"cannot read the SLURM environment: {exc}; give --rdzv-endpoint and --rdzv-id"
        ) from None
    if job is None:
        raise click.UsageError(
            "give --rdzv-endpoint HOST:PORT and --rdzv-id ID (only inside a SLURM job step are they taken from SLURM)"
        )
    return endpoint or job.store_address, run_id or job.run_id


def status_table(run_id: str, where: str, status: dict, now: float) -> Table:
    """Every node's workers, one row each (agent/display/worker_table.py), the node's columns first."""
    return worker_table(status["nodes"], f"job {run_id} at {where}: round {status['round']}", per_node=True, now=now)
