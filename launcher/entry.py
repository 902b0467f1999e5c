"""The `rally` command's entry point.

`rally status` is what a user types while a job runs, often many times: it loads its own
command only (launcher/status_command.py), never the run command's options, config and SLURM
modules (launcher/cli.py), which it does not need. Everything else goes to launcher/cli.py.
"""

from __future__ import annotations

import io
import sys

STATUS = "status"


def whole_standard_streams() -> None:
    """Put a buffer between sys.stdout/sys.stderr and their file descriptors when Python runs
    unbuffered (PYTHONUNBUFFERED=1 or `python -u`, common in training images and sbatch scripts).

    Unbuffered, each stream's text layer writes straight to a raw FileIO, and a raw write to a
    full pipe returns short when a signal arrives (the agent gets one per worker exit): the text
    layer drops the rest without a word, so the end of a long failure report could vanish from a
    piped log. A BufferedWriter finishes short writes; line buffering and write-through keep
    every line going out when it is written, as unbuffered output does."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, io.TextIOWrapper) or not isinstance(stream.buffer, io.FileIO):
            continue
        encoding, errors = stream.encoding, stream.errors
        raw = stream.detach()  # the old wrapper no longer closes the descriptor when collected
        buffered = io.BufferedWriter(raw)
        whole = io.TextIOWrapper(buffered, encoding=encoding, errors=errors, line_buffering=True, write_through=True)
        if getattr(sys, f"__{name}__") is stream:  # code that restores sys.__stdout__ gets a live stream
            setattr(sys, f"__{name}__", whole)
        setattr(sys, name, whole)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `rally` and `python -m rally`."""
    whole_standard_streams()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [STATUS]:
        from rally.launcher.command_errors import run_click
        from rally.launcher.status_command import status_command

        sys.exit(run_click(status_command, args[1:], prog_name=f"rally {STATUS}"))
    from rally.launcher.cli import main as run_main

    run_main(args)
