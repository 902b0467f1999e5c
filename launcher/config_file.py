"""A `--config` YAML job file: its keys are the options of launcher/options.py (either spelling)
plus `script` and `args`, and every value must have its option's type.

Every mistake is one line naming the file, the line and the key, and every key is checked, so
all of a file's mistakes are told in one run: an unknown key (with the
nearest valid one), a key given twice (also as `nproc-per-node` and `nproc_per_node`), a flag
that is not true/false (`standalone: 1`), a count that is not a whole number
(`max-restarts: 2.9`, which would otherwise silently become 2). Values that have the right
type but a bad value (`nproc-per-node: two`) are checked with the other options, and their
message names the file and line too (`Options.origins`).
"""

from __future__ import annotations

import difflib
from typing import Any

import yaml

from rally.agent.display.untrusted_text import printable
from rally.launcher import options
from rally.launcher.checks import validate
from rally.launcher.checks.validate import ConfigError

EXTRA_KEYS = ("script", "args")
# A job file's values are scalars or lists of scalars (a mapping holding lists: depth 3).
MAX_DEPTH = 10
# Its keys are option names: the longest is under 40 characters.
MAX_KEY = 100


class BoundedLoader(yaml.SafeLoader):
    """A SafeLoader for job files that refuses what only a bomb needs: aliases (`*name`: nine
    levels of nine references each, a few hundred bytes, expand to 387 million strings when anything
    walks or formats the value), nesting past MAX_DEPTH (PyYAML composes recursively: 50 000
    `[` are a RecursionError) and keys that cannot be option names (longer than MAX_KEY, or not
    text), which every message about a key would quote. Each is a YAMLError with the line and
    column, so one line."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"an alias (*{printable(event.anchor, limit=40)}) is not accepted in a job file: write the value out",
                event.start_mark,
            )
        if self.depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"values nested more than {MAX_DEPTH} deep are not accepted in a job file",
                self.peek_event().start_mark,
            )
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if isinstance(node, yaml.MappingNode):
            check_keys(node)
        return node


def check_keys(node: yaml.MappingNode) -> None:
    """A mapping's keys are text no longer than MAX_KEY (see BoundedLoader)."""
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or len(key.value) > MAX_KEY:
            what = (
                f"a key of {len(key.value)} characters"
                if isinstance(key, yaml.ScalarNode)
                else "a key that is not text"
            )
            raise yaml.composer.ComposerError(
                None, None, f"{what} is not an option name; write option: value", key.start_mark
            )


def load_config_file(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's values by option name, and where each came from ("--config F, line N, 'key'")."""
    try:
        text = validate.config_text(path)  # a regular file only: a FIFO must not hang us
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); save "
            "it as UTF-8"
        ) from None
    try:
        root = yaml.compose(text, Loader=BoundedLoader)  # no alias, no deep nesting: constructing is then cheap
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--config {path}: invalid YAML{where}: {problem}") from None
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag.endswith(":null")):
        return {}, {}
    if not isinstance(root, yaml.MappingNode):
        got = "list" if isinstance(root, yaml.SequenceNode) else "str"
        if isinstance(root, yaml.ScalarNode):  # what YAML makes of it (an int, a date): never a traceback
            got = type(_construct(yaml.SafeLoader(""), root, path, root.start_mark.line + 1, "")).__name__
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {got}")
    valid = [*options.names(), *EXTRA_KEYS]
    result: dict[str, Any] = {}
    origins: dict[str, str] = {}
    lines: dict[str, tuple[int, str]] = {}
    constructor = yaml.SafeLoader("")
    mistakes: list[str] = []  # every key is checked: all of a file's mistakes are told in one run
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        try:
            raw_key = _construct(constructor, key_node, path, line, "")
            value = _construct(constructor, value_node, path, line, raw_key)
            key, value = checked_entry(path, line, raw_key, value, valid, lines)
        except ConfigError as exc:
            mistakes.append(str(exc))
            continue
        if key not in EXTRA_KEYS:
            origins[key] = f"--config {path}, line {line}, '{raw_key}'"
        result[key] = value
    if mistakes:
        raise FileMistakes(mistakes, result, origins)
    return result, origins


def _construct(constructor: yaml.SafeLoader, node: yaml.Node, path: str, line: int, key: object) -> Any:
    """A node's value as safe_load makes it; a value YAML itself cannot make (a 5000-digit integer,
    the date 2001-13-45) is one mistake naming its key, never a traceback."""
    try:
        return constructor.construct_object(node, deep=True)
    except (ValueError, OverflowError, yaml.YAMLError) as exc:
        what = f", '{key}'" if key != "" else ""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--config {path}, line {line}{what}: a value YAML cannot read ({reason[:120]})") from None


class FileMistakes(validate.Mistakes):
    """Keys of the file that are wrong in themselves (unknown, twice, of the wrong type), with the
    file's other values: the command checks those too, with the flags that may override them
    (a value a flag replaces is not blamed on the file), and tells every mistake in one run."""

    def __init__(self, mistakes: list[str], values: dict[str, Any], origins: dict[str, str]) -> None:
        super().__init__(mistakes)
        self.values, self.origins = values, origins


def checked_entry(
    path: str, line: int, raw_key: object, value: object, valid: list[str], lines: dict[str, tuple[int, str]]
) -> tuple[str, Any]:
    """One `key: value` of the file as (option name, typed value), or a ConfigError naming its line."""
    key = str(raw_key).replace("-", "_")
    here = f"--config {path}, line {line}"
    if key not in valid:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        raise ConfigError(f"{here}: unknown key '{raw_key}'" + (f"; did you mean '{close[0]}'?" if close else ""))
    if key in lines:
        first_line, first_key = lines[key]
        raise ConfigError(f"{here}: '{raw_key}' is given again (line {first_line} has '{first_key}'); keep one of them")
    lines[key] = (line, str(raw_key))
    validate.check_config_values(f"{path}, line {line}", {key: value})
    if key == "args":
        if not isinstance(value, list):
            raise ConfigError(f"{here}: 'args' must be a list, e.g. args: [--lr, '0.1']")
        return key, [str(v) for v in value]
    if key == "script":
        return key, value
    return key, typed(value, key, str(raw_key), here)


def typed(value: object, name: str, key: str, here: str) -> Any:
    """`value` as option `name`'s type takes it, or one line saying what the key (as written) needs."""
    kind = options.info(options.Options.__dataclass_fields__[name]).kind
    if value is None or isinstance(value, list):  # null: the default; a list: --preload's modules
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(
                f"{here}: '{key}' is a flag: write {key}: true or {key}: false, not {validate.quoted(value)}"
            )
        return value
    if isinstance(value, bool):
        raise ConfigError(
            f"{here}: '{key}' takes a value, not {validate.quoted(value)}; write e.g. {key}: "
            f"{options.Options.__dataclass_fields__[name].default!r}"
        )
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(value) if isinstance(value, (int, str)) else int("not a number")
        except ValueError:
            raise ConfigError(f"{here}: '{key}' must be a whole number, not {validate.quoted(value)}") from None
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{here}: '{key}' must be a number, not {validate.quoted(value)}") from None
    if kind is str:
        return value if isinstance(value, str) else str(value)
    return value
