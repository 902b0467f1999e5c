"""An MkDocs hook: the docstrings' reST roles (:func:`save`, :class:`Checkpoint`) and literal-block
colons (``Typical loop::``) shown as a reader expects them in the API reference, without
rewriting the docstrings, which stay as the code and `help()` read them."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):(?=<code>)")
LITERAL_COLONS = re.compile(r"::(?=</p>)")


def on_page_content(html: str, **_: Any) -> str:
    return LITERAL_COLONS.sub(":", ROLE.sub("", html))
