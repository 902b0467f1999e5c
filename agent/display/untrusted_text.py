"""Text that someone else wrote, made safe to print on an operator's terminal.

`rally status` shows what nodes, workers and run directories say about themselves: host names,
worker states, restart causes, report outcomes. Where another user can write those (a store
without a token, a shared log directory), a plain print lets them drive the operator's terminal:
ESC sequences retitle the window, clear the screen, move the cursor over earlier lines or, on
some terminals, answer back as typed input; bidirectional overrides make text read otherwise
than it is. So every such string goes through `printable` first: control and format characters
become visible escapes (`\\x1b`, `\\u202e`, `\\n`) and the text is cut at a length, saying how
much was left out. rich markup in such text is never interpreted either: the status command's
console has markup and emoji off. Standard library only: either side may use it.
"""

from __future__ import annotations

import unicodedata

# Beyond this, a value says how much more there was: no message or cell grows without bound.
MAX_SHOWN = 200

# Unicode categories a terminal may act on instead of showing: controls (C0, DEL, C1), formats
# (bidirectional overrides, zero-width characters), line and paragraph separators, surrogates.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(value: object, limit: int = MAX_SHOWN) -> str:
    """`value` as one line a terminal shows as it is: at most `limit` characters of it, every
    control or format character written as its escape (ESC as `\\x1b`)."""
    text = value if isinstance(value, str) else str(value)
    cut = ""
    if len(text) > limit:
        cut = f"... ({len(text) - limit} more characters)"
        text = text[:limit]
    if text.isprintable():  # the usual case, in one C call; isprintable is stricter than needed
        return text + cut
    return "".join(_escaped(ch) for ch in text) + cut


def _escaped(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    if unicodedata.category(ch) not in _HIDDEN_CATEGORIES:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
