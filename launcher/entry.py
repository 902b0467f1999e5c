"""The `rally` command's entry point.

`rally status` is what a user types while a job runs, often many times: it loads its own
command only (launcher/status_command.py), never the run command's options, config and SLURM
modules (launcher/cli.py), which it does not need. Everything else goes to launcher/cli.py.
"""

from __future__ import annotations

import sys

STATUS = "status"


def main(argv: list[str] | None = None) -> None:
    """Entry point of `rally` and `python -m rally`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [STATUS]:
        from rally.launcher.command_errors import run_click
        from rally.launcher.status_command import status_command

        sys.exit(run_click(status_command, args[1:], prog_name=f"rally {STATUS}"))
    from rally.launcher.cli import main as run_main

    run_main(args)
