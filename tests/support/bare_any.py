"""Parameters typed bare `Any` in launcher/, agent/ and rendezvous/ (at most 40), read from
the AST: a parameter (also *args and **kwargs) annotated exactly `Any`. `Callable[..., Any]`,
`dict[str, Any]` and a return type of `Any` do not count.

    python tests/support/bare_any.py        # the count, then the count per top-level room
    python tests/support/bare_any.py -v     # and every one, as path:line function(parameter)
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "agent", "rendezvous")


def is_bare_any(annotation: ast.expr | None) -> bool:
    return (
        (isinstance(annotation, ast.Name) and annotation.id == "Any")
        or (isinstance(annotation, ast.Attribute) and annotation.attr == "Any")
        or (isinstance(annotation, ast.Constant) and annotation.value == "Any")
    )


def bare_any_parameters(repo: Path = REPO) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    every = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
                    found += [
                        f"{path.relative_to(repo)}:{node.lineno} {node.name}({p.arg})"
                        for p in every
                        if is_bare_any(p.annotation)
                    ]
    return found


def room(entry: str) -> str:
    parts = entry.split(":")[0].split("/")
    return "/".join(parts[:2]) if parts[0] == "agent" and len(parts) > 2 else parts[0]


if __name__ == "__main__":
    found = bare_any_parameters()
    print(len(found))
    for name, count in Counter(room(e) for e in found).most_common():
        print(f"  {count:4d} {name}")
    if "-v" in sys.argv[1:]:
        print("\n".join(found))
