"""Flags as argparse users type them: an unambiguous prefix of a long flag is that flag.

torchrun parses with argparse, which accepts `--nproc-per-nod 2` for `--nproc-per-node 2`
(`allow_abbrev`); click does not. `expand_prefixes` rewrites the arguments before click sees
them, up to the script (everything after it belongs to the script). A prefix that fits several
flags is one line naming them, as argparse's "ambiguous option" is; a flag that fits none is left
for click, whose error the launcher turns into "did you mean" the closest flag (difflib).
"""

from __future__ import annotations

import click


def expand_prefixes(args: list[str], params: list[click.Parameter]) -> list[str]:
    """`args` with every unambiguous prefix of a long option written out in full."""
    known: dict[str, click.Option] = {}
    for param in params:
        if isinstance(param, click.Option):
            for name in (*param.opts, *param.secondary_opts):
                known[name] = param
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return out + args[i:]  # the script and its arguments: never rewritten
        name, eq, value = arg.partition("=")
        if name.startswith("--") and name not in known:
            name = _complete(name, known)
            arg = name + eq + value
        out.append(arg)
        i += 1
        option = known.get(name)
        if option is not None and not eq and _takes_value(option) and i < len(args):
            out.append(args[i])  # the option's value, whatever it looks like
            i += 1
    return out


def _complete(prefix: str, known: dict[str, click.Option]) -> str:
    """The one long flag `prefix` starts, in the spelling it was typed in; else `prefix` as is."""
    matches: dict[int, list[str]] = {}
    for name, option in known.items():
        if name.startswith("--") and name.startswith(prefix):
            matches.setdefault(id(option), []).append(name)
    if len(matches) == 1:
        return min(next(iter(matches.values())), key=len)
    if len(matches) > 1:
        flags = sorted(min(names, key=len) for names in matches.values())
        raise click.UsageError(f"option {prefix} is ambiguous: it could be {', '.join(flags)}; write more of it")
    return prefix


def _takes_value(option: click.Option) -> bool:
    return not option.is_flag and not option.count and option.nargs != 0
