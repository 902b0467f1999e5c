"""`rally store`: a rendezvous store and nothing else, so no compute node is a single point of failure.

With torchrun the store lives inside the agent of one compute node; when that node dies, every
other node loses the job. Run `rally store --port P` on a login or service node and point every
agent's `--rdzv-endpoint` at it: the job then survives the loss of any compute node.

An agent on the same host that finds the endpoint's port taken joins it only when the store's
listening socket is its own user's or root's, or when the store's marker is signed with the job's
token: run with RALLY_JOB_TOKEN set, `rally store` signs it (rendezvous/c10d/store.py).
"""

from __future__ import annotations

import signal

import click

from rally.agent.display import console
from rally.launcher.checks import validate


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
    from rally.rendezvous.base.token import Signer, TokenError, env_token
    from rally.rendezvous.c10d.store import SERVICE_MARKER_KEY, SERVICE_MARKER_VALUE, host_tcp_store, quiet_torch_logs

    try:
        token = env_token()
    except TokenError as exc:
        raise validate.ConfigError(str(exc)) from None
    quiet_torch_logs()
    try:
        server = host_tcp_store(port, timeout)
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError
        raise validate.ConfigError(  # one line, exit 2 (launcher/cli.py): a taken port is the user's to change
            f"cannot serve a store on port {port}: {str(exc).splitlines()[0]}; pick a free --port (0: any)"
        ) from None
    # Agents on this host may share it (store.open_tcp_store): plain, when it runs as their user or
    # root; signed with the job's token, whoever runs it.
    marker = Signer(token).seal(SERVICE_MARKER_KEY, SERVICE_MARKER_VALUE).decode() if token else SERVICE_MARKER_VALUE
    server.set(SERVICE_MARKER_KEY, marker)
    console.say(f"rendezvous store listening on port {server.port}; point agents at --rdzv-endpoint HOST:{server.port}")
    received: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: received.append(s))
    while not received:
        signal.pause()
    console.say(f"stopping the store ({signal.Signals(received[0]).name})")
    del server
    return 0
