"""The documentation renders as written: the mistakes below turn into literal text on
the site without making `mkdocs build --strict` fail, so they are caught here.

- A list that follows a paragraph (or a code block) without a blank line is not a list in
  Python-Markdown: its items run into the paragraph above as literal "- **Events**" text.
- A code block in a list item needs 4 spaces of indent; with 2 it ends the list, and the rest
  of the item and the items after it become a paragraph and a new list.
- A line ending in `::` is reStructuredText's code-block marker; Markdown shows it as is.
- A line of a block a user copies (bash, python, yaml) longer than CODE_COLUMNS is cut off at
  the code box's edge on a laptop screen; output (`text` blocks) wraps instead, by extra.css.

The first three are checked in the Markdown sources (with the line to fix); the built site is
checked too, which also covers the API page's docstrings (mkdocstrings renders them).
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a 1280-pixel-wide screen shows of a code box on the site (measured in headless Chromium
# with docs/screenshot.py: about 88 columns on a 1280-pixel screen, 104 on a 1600-pixel one).
CODE_COLUMNS = 88
COPYABLE = {"bash", "sh", "shell", "console", "python", "py", "yaml", "yml"}
FENCE = re.compile(r"^\s*(```|~~~)(\S*)")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d{1,3}[.)])\s+\S")
DIRECTIVE = re.compile(r"^:::\s")  # mkdocstrings' `::: module.name` and its indented YAML options


def source_problems(page: Path) -> list[str]:
    """Each mistake as `page:line: what`, read from the Markdown source."""
    lines = page.read_text().split("\n")
    where = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    problems: list[str] = []
    fence_lang: str | None = None  # inside a fenced block: its language
    paragraph_start: int | None = None  # the first line of the run of non-blank lines we are in
    after_fence = False  # the previous line closed a fenced block
    in_directive = False
    for i, line in enumerate(lines):
        fence = FENCE.match(line)
        if fence_lang is not None:
            if fence and not fence.group(2):
                fence_lang, after_fence = None, True
            elif fence_lang in COPYABLE and len(line) > CODE_COLUMNS:
                problems.append(f"{where}:{i + 1}: a {fence_lang} line of {len(line)} columns (at most {CODE_COLUMNS})")
            continue
        if fence:
            fence_lang, paragraph_start = fence.group(2), None
            if 0 < len(line) - len(line.lstrip()) < 4:
                problems.append(
                    f"{where}:{i + 1}: a code block indented by fewer than 4 spaces breaks the list it is in; "
                    "indent it (and what follows it in the item) by 4"
                )
            continue
        if not line.strip():
            paragraph_start, after_fence, in_directive = None, False, False
            continue
        if DIRECTIVE.match(line):
            in_directive = True
        if in_directive:
            continue
        if LIST_ITEM.match(line):
            if after_fence:
                problems.append(f"{where}:{i + 1}: a list item right after a code block; put a blank line between")
            elif paragraph_start is not None and paragraph_start != i:
                first = lines[paragraph_start].lstrip()
                if not LIST_ITEM.match(first) and not first.startswith(("|", "<!--", "#")):
                    problems.append(
                        f"{where}:{i + 1}: a list item runs into the paragraph of line {paragraph_start + 1}; "
                        "put a blank line before the list"
                    )
        if line.rstrip().endswith("::"):
            problems.append(f"{where}:{i + 1}: ends in reStructuredText's '::'; Markdown shows it as is")
        if paragraph_start is None:
            paragraph_start = i
        after_fence = False
    return problems


@pytest.mark.timeout(30)
def test_the_markdown_sources_render_as_written() -> None:
    problems = [problem for page in PAGES for problem in source_problems(page)]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(30)
def test_the_checks_find_each_mistake(tmp_path: Path) -> None:
    """Each rule fires on the mistake it is for, and not on its correct form."""
    page = tmp_path / "page.md"
    cases = {
        "Some text:\n- **Events**: a list run into the paragraph\n": "runs into the paragraph",
        "```text\nout\n```\n- an item right after a code block\n": "right after a code block",
        "- an item\n\n  ```text\n  out\n  ```\n\n  More of it.\n- **Events**: the next item\n": "runs into",
        "Environment (all optional)::\n\n    X=1\n": "'::'",
        "- an item:\n\n  ```text\n  out\n  ```\n": "fewer than 4 spaces",
        "<!-- snippet: skip x -->\n```bash\n" + "x" * (CODE_COLUMNS + 1) + "\n```\n": "a bash line",
    }
    fine = [
        "Some text:\n\n- a list\n- after a blank line\n",
        "- an item\n  still the item\n- the next item\n  - nested\n",
        "```text\n" + "x" * 300 + "\n```\n",
        "- an item:\n\n    ```text\n    out\n    ```\n\n    More of it.\n",
        "::: rally.job\n    options:\n      members:\n        - save\n",
    ]
    for text, expected in cases.items():
        page.write_text(text)
        found = source_problems(page)
        assert any(expected in p for p in found), (text, found)
    for text in fine:
        page.write_text(text)
        assert not source_problems(page), text


@pytest.mark.timeout(30)
def test_output_blocks_wrap_instead_of_being_cut_off() -> None:
    css = (REPO / "docs" / "stylesheets" / "extra.css").read_text()
    assert re.search(r"\.language-text[^{]*\{[^}]*white-space:\s*pre-wrap", css), "extra.css must wrap text blocks"


PARAGRAPH = re.compile(r"<p>((?:(?!</p>).)*)</p>", re.S)


@pytest.mark.timeout(180)
def test_the_built_site_shows_no_markup_as_text(tmp_path: Path) -> None:
    """The site as mkdocs builds it: no paragraph holds a list marker at the start of a line or
    ends in `::` (this covers the API page, whose text comes from the docstrings)."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, check=True, capture_output=True, timeout=170, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    problems = []
    for built in sorted(site.glob("**/index.html")):
        for match in PARAGRAPH.finditer(built.read_text()):
            text = html.unescape(re.sub(r"<[^>]+>", "", match.group(1)))
            if re.search(r"\n\s*(?:[-*+]|\d{1,3}\.)\s", text) or text.rstrip().endswith("::"):
                problems.append(f"{built.parent.relative_to(site)}/: ...{text[-100:]!r}")
    assert not problems, "\n".join(problems)


# Every page shows before it tells: no paragraph (or list item) runs longer than this many source
# lines, so a reader finds the point without wading. A longer one is split, or made a list.
PARAGRAPH_LINES = 6


def nav_pages() -> list[Path]:
    """Every page in mkdocs.yml's nav: the pages the site shows, so the pages held to the rule."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [REPO / "docs" / name for entry in nav for name in entry.values()]


def long_paragraphs(page: Path) -> list[str]:
    """`page:line: N lines` for each paragraph or list item longer than PARAGRAPH_LINES."""
    found, run, fence = [], [], False
    for i, line in enumerate([*page.read_text().split("\n"), ""]):
        if FENCE.match(line):
            fence, run = not fence, []
            continue
        if fence:
            continue
        item = LIST_ITEM.match(line)
        if not line.strip() or item or line.lstrip().startswith(("|", "#", "<!--", ":::", "!!!")):
            if len(run) > PARAGRAPH_LINES:
                found.append(f"{page.name}:{run[0] + 1}: {len(run)} lines")
            run = [i] if item else []
            continue
        run.append(i)
    return found


@pytest.mark.timeout(30)
def test_paragraphs_are_short_on_every_page() -> None:
    pages = nav_pages()
    assert {page.name for page in pages} == {page.name for page in REPO.glob("docs/*.md")}, "a page not in the nav"
    found = [p for page in pages for p in long_paragraphs(page)]
    assert not found, f"paragraphs over {PARAGRAPH_LINES} lines (split them, or make a list):\n" + "\n".join(found)
