"""`rally store`: a rendezvous store and nothing else, so no compute node is a single point of failure.

With torchrun the store lives inside the agent of one compute node; when that node dies, every
other node loses the job. Run `rally store --port P` on a login or service node and point every
agent's `--rdzv-endpoint` at it: the job then survives the loss of any compute node.
"""

from __future__ import annotations

import signal

import click

from rally.agent.display import console
from rally.launcher import validate


def _timeout(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    try:
        return validate.seconds(value, "--timeout", zero_ok=False)
    except validate.ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"--timeout {value}: ")) from None


@click.command(name="store", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--port", type=click.IntRange(0, 65535), required=True, help="TCP port to listen on (0: a free port, printed)."
)
@click.option(
    "--timeout",
    type=float,
    default=60.0,
    show_default=True,
    callback=_timeout,
    help="Per-operation timeout of the store, seconds.",
)
def store_command(port: int, timeout: float) -> int:
    """A rendezvous store alone, to outlive any compute node (until SIGINT/SIGTERM)."""
    from rally.rendezvous.c10d.store import SERVICE_MARKER_KEY, host_tcp_store, quiet_torch_logs

    quiet_torch_logs()
    try:
        server = host_tcp_store(port, timeout)
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError
        raise validate.ConfigError(  # one line, exit 2 (launcher/cli.py): a taken port is the user's to change
            f"cannot serve a store on port {port}: {str(exc).splitlines()[0]}; pick a free --port (0: any)"
        ) from None
    server.set(SERVICE_MARKER_KEY, "rally store")  # agents on this host may share it (store.open_tcp_store)
    console.say(f"rendezvous store listening on port {server.port}; point agents at --rdzv-endpoint HOST:{server.port}")
    received: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: received.append(s))
    while not received:
        signal.pause()
    console.say(f"stopping the store ({signal.Signals(received[0]).name})")
    del server
    return 0
