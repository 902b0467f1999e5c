"""How any of rally's click commands turns an error into one line: the run command
(launcher/cli.py) and `rally status`, which launcher/entry.py runs without loading the former."""

from __future__ import annotations

import difflib

import click

from rally.agent.base.exit_codes import EXIT_BAD_INPUT
from rally.agent.display import console
from rally.launcher.checks.validate import ConfigError


def run_click(command: click.Command, args: list[str], prog_name: str = "rally") -> int:
    """Run a click command; bad input is one line and exit 2 (EXIT_BAD_INPUT), never a traceback."""
    try:
        code = command.main(args, prog_name=prog_name, standalone_mode=False)
    except ConfigError as exc:
        console.plain_error(str(exc))
        return EXIT_BAD_INPUT
    except click.UsageError as exc:
        message = exc.format_message()
        if isinstance(exc, click.NoSuchOption):
            message = f"no such option {exc.option_name}; see rally --help"
            closest = difflib.get_close_matches(exc.option_name, list(exc.possibilities or ()), n=1, cutoff=0)
            if closest:
                message = f"no such option {exc.option_name}; did you mean {closest[0]}?"
        console.plain_error(message)
        return EXIT_BAD_INPUT
    except click.ClickException as exc:
        console.plain_error(exc.format_message())
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    return code if isinstance(code, int) else 0
