"""Every command and script of the README and the documentation pages that a user would copy
runs here, as written, so no snippet can drift from the code.

A fenced block is marked on the line before it:

    <!-- snippet: file NAME -->     the block is written to NAME in the page's directory
    <!-- snippet: run -->           the block runs there (bash with -euo pipefail, or python)
    <!-- snippet: run TEXT -->      ... and TEXT must be in what it printed (stdout or stderr)
    <!-- snippet: skip REASON -->   it cannot run in a test (another machine, the network, minutes)
    <!-- snippet: output -->        a `text` block: what the run block before it printed
    <!-- snippet: printed WHERE --> a `text` block of lines a run elsewhere printed (a SLURM job on
                                    the dev cluster); the test named in WHERE checks each line

An `output` block is real output, so it cannot drift: each of its lines must be a line that the
run block before it printed (stdout or stderr), compared after `shown_as` (the time stamp at the
start of rally's lines dropped, a decimal number read as any decimal number), where `…` in the page stands
for any text (a run id, a path). A page may show a few lines of a long output.

Each page runs in a fresh directory holding the README's `train.py` and the page's own `file`
blocks, with the installed `rally` first on PATH; its `run` blocks run in order and must exit 0
without a traceback. The pages run side by side (PAGES_AT_ONCE at a time, each in its own
directory and sessions), so the suite waits for the slowest page, not for the sum of them.
A `bash`, `sh`, `python` or `yaml` block without a marker fails
`test_every_block_a_user_would_copy_is_marked`: output belongs in `text` blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.helpers import clean_env, kill_group

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COPYABLE = {"bash", "sh", "shell", "console", "python", "py", "yaml", "yml"}
FENCE = re.compile(r"^(\s*)```(\S*)")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(\w+)\s*(.*?)\s*-->\s*$")
PAGE_TIMEOUT = 120.0


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    kind: str  # run, file, skip; "" when unmarked
    arg: str
    body: str

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.group(1), opening.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        kind, arg = (marker.group(1), marker.group(2)) if marker else ("", "")
        found.append(Block(page, i + 1, lang, kind, arg, body))
        i = end + 1
    return found


def _run_before(block: Block) -> Block | None:
    """The run block whose output `block` (an output block) shows: the nearest run block above it."""
    above = [b for b in blocks_of(block.page) if b.line < block.line and b.kind == "run"]
    return above[-1] if above else None


STAMP = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} ")  # rally's lines off a terminal (agent/display/console.py)


def shown_as(line: str) -> str:
    """A line of output as an output block may show it: no time stamp, each decimal number (a
    duration, a loss) as `0.0`; whole numbers (ranks, steps, restarts) stay as they are."""
    return re.sub(r"\d+\.\d+", "0.0", STAMP.sub("", line.rstrip()))


def missing_lines(shown: str, printed: str) -> list[str]:
    """The lines of an output block that the run did not print (`…` stands for any text)."""
    printed_lines = {shown_as(line) for line in printed.splitlines()}
    missing = []
    for line in shown.splitlines():
        if not line.strip():
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in shown_as(line).split("…")))
        if not any(pattern.fullmatch(p) for p in printed_lines):
            missing.append(line)
    return missing


@pytest.mark.timeout(30)
def test_an_output_block_is_checked_line_by_line() -> None:
    printed = "12:01:02.345 rally: round 0: node 0 of 1, ranks 0-1 of 2\n[0] done at step 49, loss 0.0555\n"
    assert not missing_lines("rally: round 0: node 0 of 1, ranks 0-1 of 2\n[0] done at step 49, loss 0.0781\n", printed)
    assert not missing_lines("rally: round 0: node 0 of 1, ranks … of 2\n", printed)
    assert missing_lines("rally: round 3: node 0 of 1, ranks 0-1 of 2\n", printed)
    assert missing_lines("rally: round 0: node 0 of 1, ranks 0-1 of 4 nodes\n", printed)
    assert missing_lines("[1] done at step 49, loss 0.0555\n", printed)


def readme_train_py() -> str:
    (block,) = [b for b in blocks_of(REPO / "README.md") if b.kind == "file" and b.arg == "train.py"]
    return block.body


@pytest.mark.timeout(30)
def test_every_block_a_user_would_copy_is_marked() -> None:
    problems = []
    for page in PAGES:
        for block in blocks_of(page):
            if block.lang in COPYABLE and block.kind not in ("run", "file", "skip"):
                problems.append(f"{block.where()}: a {block.lang} block without <!-- snippet: run|file|skip -->")
            elif block.kind == "skip" and not block.arg:
                problems.append(f"{block.where()}: skip without a reason")
            elif block.kind == "file" and not re.fullmatch(r"[\w.-]+", block.arg):
                problems.append(f"{block.where()}: file needs a plain file name, not {block.arg!r}")
            elif block.kind == "run" and block.lang not in ("bash", "sh", "python"):
                problems.append(f"{block.where()}: only bash and python blocks run, not {block.lang!r}")
            elif block.kind == "output" and (block.lang != "text" or not _run_before(block)):
                problems.append(f"{block.where()}: an output block is a text block after a run block")
            elif block.kind == "printed" and (block.lang != "text" or ".py" not in block.arg):
                problems.append(f"{block.where()}: a printed block is a text block naming the test that checks it")
    assert not problems, "\n".join(problems)


RUNNABLE = [page for page in PAGES if any(b.kind == "run" for b in blocks_of(page))]
# Pages run side by side, this many at a time: each page's run blocks are rally jobs that spend
# much of their time waiting (the store, the workers' start, the exit barrier), so on two cores
# three pages overlap what one page alone leaves idle; more would only queue for the CPUs.
PAGES_AT_ONCE = 3


@dataclass
class Ran:
    """A run block as it ran: what it printed, or that it did not finish within PAGE_TIMEOUT."""

    block: Block
    returncode: int | None  # None: killed after PAGE_TIMEOUT
    stdout: str
    stderr: str


INSTALLS_TORCH = re.compile(r"^\s*pip3? install\b.*\btorch\b(?!-rally)", re.MULTILINE)


@pytest.mark.timeout(30)
def test_no_copy_block_holds_alternatives_to_install_torch() -> None:
    """A block is copied whole and every line of it runs: alternatives (the CPU build, the CUDA build,
    a pinned version) each get a block of their own. Getting started had all three in one block, and
    pasting it installed three torches in turn and ended on the last (2.10.0)."""
    crowded = [
        f"{block.where()}: {len(INSTALLS_TORCH.findall(block.body))} torch installs in one block"
        for page in PAGES
        for block in blocks_of(page)
        if block.lang in COPYABLE and len(INSTALLS_TORCH.findall(block.body)) > 1
    ]
    assert not crowded, "\n".join(crowded)


def run_page(page: Path, directory: Path) -> list[Ran]:
    """The page's run blocks, in order, in `directory` (holding the README's train.py and the
    page's file blocks), up to the first that fails or does not finish."""
    (directory / "train.py").write_text(readme_train_py())
    blocks = blocks_of(page)
    for block in blocks:
        if block.kind == "file":
            (directory / block.arg).write_text(block.body)
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    ran: list[Ran] = []
    for block in (b for b in blocks if b.kind == "run"):
        argv = (
            [sys.executable, "-c", block.body]
            if block.lang == "python"
            else ["bash", "-euo", "pipefail", "-c", block.body]
        )
        proc = subprocess.Popen(
            argv, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=PAGE_TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            stdout, stderr = proc.communicate()
            ran.append(Ran(block, None, stdout, stderr))
            return ran
        ran.append(Ran(block, proc.returncode, stdout, stderr))
        if proc.returncode != 0:
            return ran
    return ran


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Future[list[Ran]]]]:
    """Every runnable page started at once (PAGES_AT_ONCE at a time), each in a fresh directory of
    its own; each page's test waits for its own."""
    with ThreadPoolExecutor(max_workers=PAGES_AT_ONCE, thread_name_prefix="snippets") as pool:
        futures = {page: pool.submit(run_page, page, tmp_path_factory.mktemp("page")) for page in RUNNABLE}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.torch
@pytest.mark.timeout(PAGE_TIMEOUT * len(RUNNABLE) + 30)  # the pages ahead of this one in the pool come first
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(REPO)) for p in RUNNABLE])
def test_the_snippets_of_a_page_run_as_written(page: Path, page_runs: dict[Path, Future[list[Ran]]]) -> None:
    for ran in page_runs[page].result():
        block = ran.block
        if ran.returncode is None:
            printed = f"{ran.stdout}\n{ran.stderr}"[-4000:]
            pytest.fail(f"{block.where()} did not finish within {PAGE_TIMEOUT:g} s:\n{block.body}\n{printed}")
        shown = f"{block.where()}:\n{block.body}\nexit {ran.returncode}\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
        assert ran.returncode == 0, shown
        assert "Traceback" not in ran.stderr, shown
        assert block.arg in ran.stdout + ran.stderr, f"expected {block.arg!r} in the output of {shown}"
    ran_by_line = {ran.block.line: ran for ran in page_runs[page].result()}
    for block in blocks_of(page):
        if block.kind == "output":
            run = _run_before(block)
            assert run is not None and run.line in ran_by_line, f"{block.where()}: its run block did not run"
            ran = ran_by_line[run.line]
            missing = missing_lines(block.body, ran.stdout + ran.stderr)
            printed = f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
            lines = "\n".join(missing)
            assert not missing, f"{block.where()} shows lines the run did not print:\n{lines}\n\nit printed:\n{printed}"
