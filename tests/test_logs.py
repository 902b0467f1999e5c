"""Specification: where worker output goes, and what it looks like on the console.

torchrun's layout and flags:
    --log-dir D   per-rank files  D/<run-id>_<suffix>/attempt_<n>/<local_rank>/{stdout,stderr}.log
    --redirects B streams (1 stdout, 2 stderr, 3 both) go to those files only
    --tee B       streams go to the files AND to the console (rally's prefix "[<rank>] " on the
                  console; with --torchrun-prefix, torchrun's "[<role><local_rank>]:" on tee'd
                  streams and none on the others)
    --local-ranks-filter R,...   only these local ranks reach the console; files are unaffected
rally's default (no flags): every console line is a whole line prefixed "[<rank>] ", so the
lines of concurrent workers never mix; --no-prefix passes the bytes through raw.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.helpers import run_rally, write_probe

# Each rank writes a distinctive stdout and stderr; the last stdout line has no newline.
TWO_STREAMS = """
    import os, sys
    rank = os.environ["RANK"]
    print(f"out one from rank {rank}")
    print(f"err one from rank {rank}", file=sys.stderr)
    print(f"out two from rank {rank}")
    sys.stdout.write(f"unterminated from rank {rank}")
"""


def expected_stdout(rank: int) -> str:
    return f"out one from rank {rank}\nout two from rank {rank}\nunterminated from rank {rank}"


def expected_stderr(rank: int) -> str:
    return f"err one from rank {rank}\n"


def worker_lines(text: str) -> list[str]:
    """Console lines that are not rally's own messages."""
    return [line for line in text.splitlines() if "rally:" not in line]


def run_dir(log_dir: Path) -> Path:
    """The one `<run-id>_<suffix>` directory rally made under --log-dir."""
    runs = [p for p in log_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected one run directory in {log_dir}, found {runs}"
    assert re.fullmatch(r"[0-9a-f-]{36}_\w+", runs[0].name), runs[0].name
    return runs[0]


def run_two_streams(tmp_path: Path, *flags: str, nproc: int = 2):
    write_probe(tmp_path / "two_streams.py", TWO_STREAMS)
    result = run_rally(["--standalone", "--nproc-per-node", str(nproc), *flags, "two_streams.py"], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    return result


@pytest.mark.timeout(120)
def test_redirects_3_puts_each_stream_in_its_file_and_nothing_on_the_console(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = run_two_streams(tmp_path, "--log-dir", str(logs), "--redirects", "3")
    attempt = run_dir(logs) / "attempt_0"
    for rank in (0, 1):
        assert (attempt / str(rank) / "stdout.log").read_text() == expected_stdout(rank)
        assert (attempt / str(rank) / "stderr.log").read_text() == expected_stderr(rank)
    assert worker_lines(result.stdout) == []
    assert worker_lines(result.stderr) == []


@pytest.mark.timeout(120)
def test_tee_3_writes_the_files_and_keeps_rally_s_prefix_on_the_console(tmp_path: Path) -> None:
    """--tee adds the files; the console is rally's as without it (it turned into
    torchrun's "[default0]:"), and one line says how to get torchrun's."""
    logs = tmp_path / "logs"
    result = run_two_streams(tmp_path, "--log-dir", str(logs), "--tee", "3")
    attempt = run_dir(logs) / "attempt_0"
    notes = [line for line in result.stderr.splitlines() if "--tee:" in line]
    assert len(notes) == 1 and "--torchrun-prefix" in notes[0] and "[default0]:" in notes[0], result.describe()
    assert "[default" not in "\n".join(worker_lines(result.stdout + result.stderr)), result.describe()
    for rank in (0, 1):
        assert (attempt / str(rank) / "stdout.log").read_text() == expected_stdout(rank)
        assert (attempt / str(rank) / "stderr.log").read_text() == expected_stderr(rank)
        prefix = f"[{rank}] "
        assert [line for line in result.stdout.splitlines() if line.startswith(prefix)] == [
            prefix + line for line in expected_stdout(rank).splitlines()
        ]
        assert [line for line in result.stderr.splitlines() if line.startswith(prefix)] == [
            prefix + line for line in expected_stderr(rank).splitlines()
        ]


@pytest.mark.timeout(120)
def test_torchrun_prefix_shows_torchrun_s_console_with_the_role_name(tmp_path: Path) -> None:
    """Asked for (--torchrun-prefix), the console is torchrun's: "[role<local rank>]:" on the
    tee'd stream, the other stream untouched."""
    logs = tmp_path / "logs"
    flags = ("--log-dir", str(logs), "--role", "trainer", "--tee", "1", "--torchrun-prefix")
    result = run_two_streams(tmp_path, *flags)
    assert "--tee:" not in result.stderr, result.describe()  # asked for: no note
    attempt = run_dir(logs) / "attempt_0"
    for rank in (0, 1):
        prefix = f"[trainer{rank}]:"
        assert [line for line in result.stdout.splitlines() if line.startswith(prefix)] == [
            prefix + line for line in expected_stdout(rank).splitlines()
        ]
        assert (attempt / str(rank) / "stdout.log").read_text() == expected_stdout(rank)
        assert not (attempt / str(rank) / "stderr.log").exists(), "--tee 1 copies stdout only"
        assert f"err one from rank {rank}" in result.stderr, "stderr still reaches the console"
        assert f"\nerr one from rank {rank}\n" in "\n" + result.stderr, "unprefixed, as torchrun shows it"


@pytest.mark.timeout(120)
def test_local_ranks_filter_hides_other_ranks_on_the_console_but_keeps_their_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = run_two_streams(tmp_path, "--log-dir", str(logs), "--tee", "3", "--local-ranks-filter", "0")
    console = result.stdout + result.stderr
    assert "from rank 0" in console
    assert "from rank 1" not in console, result.describe()
    attempt = run_dir(logs) / "attempt_0"
    assert (attempt / "1" / "stdout.log").read_text() == expected_stdout(1)
    assert (attempt / "1" / "stderr.log").read_text() == expected_stderr(1)


LINES_PER_RANK = 2000
# Each line is written in three pieces with no flush between them (python -u: one write(2)
# per piece), so the agent sees partial lines from four workers at once.
CHATTY = f"""
    import os, sys
    rank = os.environ["RANK"]
    pad = rank * 150
    for i in range({LINES_PER_RANK}):
        sys.stdout.write(f"rank={{rank}} line={{i}} ")
        sys.stdout.write(pad)
        sys.stdout.write(f" end={{rank}}\\n")
    sys.stdout.write(f"rank={{rank}} last line without newline")
"""


@pytest.mark.timeout(150)
def test_default_console_lines_are_whole_and_prefixed_with_the_rank_even_when_four_workers_race(tmp_path: Path) -> None:
    write_probe(tmp_path / "chatty.py", CHATTY)
    result = run_rally(["--standalone", "--nproc-per-node", "4", "chatty.py"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.describe()
    line_re = re.compile(r"\[(\d)\] rank=(\d) line=(\d+) (\d{150}) end=(\d)")
    seen: dict[int, list[int]] = {rank: [] for rank in range(4)}
    last: dict[int, int] = {}
    for number, line in enumerate(worker_lines(result.stdout)):
        match = line_re.fullmatch(line)
        if match is None:
            final = re.fullmatch(r"\[(\d)\] rank=(\d) last line without newline", line)
            assert final and final.group(1) == final.group(2), f"console line {number} is mixed or cut: {line[:300]!r}"
            last[int(final.group(1))] = number
            continue
        prefix, rank, index, pad, end = match.groups()
        assert prefix == rank == end and set(pad) == {rank}, f"console line {number} mixes ranks: {line[:300]!r}"
        seen[int(rank)].append(int(index))
    for rank in range(4):
        assert seen[rank] == list(range(LINES_PER_RANK)), f"rank {rank}: lines lost, repeated or reordered"
        assert rank in last, f"rank {rank}: the final line without a newline did not appear"


@pytest.mark.timeout(120)
def test_no_prefix_passes_worker_output_through_raw(tmp_path: Path) -> None:
    result = run_two_streams(tmp_path, "--no-prefix", nproc=1)
    assert worker_lines(result.stdout) == expected_stdout(0).splitlines()
    assert result.stdout.endswith(expected_stdout(0)), "raw mode adds nothing, not even a final newline"
    assert expected_stderr(0) in result.stderr


@pytest.mark.timeout(120)
def test_final_line_without_newline_is_shown_with_its_prefix(tmp_path: Path) -> None:
    result = run_two_streams(tmp_path, nproc=1)
    assert worker_lines(result.stdout) == ["[0] " + line for line in expected_stdout(0).splitlines()]
    assert "[0] err one from rank 0" in result.stderr.splitlines()
