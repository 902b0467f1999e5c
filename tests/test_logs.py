"""Specification: where worker output goes, and what it looks like on the console.

torchrun's layout and flags:
    --log-dir D   per-rank files  D/<run-id>_<suffix>/attempt_<n>/<local_rank>/{stdout,stderr}.log
    --redirects B streams (1 stdout, 2 stderr, 3 both) go to those files only
    --tee B       streams go to the files AND to the console, each console line with torchrun's
                  header, byte for byte: "[<role><local_rank>]:", or
                  $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with ${role_name}, ${rank}, ${local_rank}
    --local-ranks-filter R,...   only these local ranks reach the console; files are unaffected
rally's addition, on the streams torchrun does not tee (which it passes through bare): every
console line is a whole line prefixed "[<rank>] ", so the lines of concurrent workers never mix;
--no-prefix passes those bytes through raw, which is then torchrun's console exactly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from support.helpers import clean_env, console_lines, run_rally, write_probe

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
    assert "root cause" not in result.stderr, result.describe()  # every worker succeeded: nothing to blame
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
def test_tee_3_writes_the_files_and_prints_torchrun_s_header_on_the_console(tmp_path: Path) -> None:
    """--tee's console lines are torchrun's by default ("[default0]:out one ..."): log scrapers
    written against torchrun's output find them; rally's "[0] " is on no worker line."""
    logs = tmp_path / "logs"
    result = run_two_streams(tmp_path, "--log-dir", str(logs), "--tee", "3")
    attempt = run_dir(logs) / "attempt_0"
    rally_prefixed = [line for line in worker_lines(result.stdout + result.stderr) if re.match(r"\[\d\] ", line)]
    assert rally_prefixed == [], result.describe()
    for rank in (0, 1):
        assert (attempt / str(rank) / "stdout.log").read_text() == expected_stdout(rank)
        assert (attempt / str(rank) / "stderr.log").read_text() == expected_stderr(rank)
        header = f"[default{rank}]:"
        assert console_lines(result.stdout, header) == expected_stdout(rank).splitlines()
        assert console_lines(result.stderr, header) == expected_stderr(rank).splitlines()


@pytest.mark.timeout(120)
def test_tee_1_with_role_rank_heads_stdout_as_torchrun_and_keeps_rally_s_prefix_on_stderr(tmp_path: Path) -> None:
    """`--role rank --tee 1` (torchtitan's run_train.sh): stdout lines are "[rank0]:...", as
    torchrun prints them; stderr, which torchrun does not tee, keeps rally's "[0] "."""
    logs = tmp_path / "logs"
    result = run_two_streams(tmp_path, "--log-dir", str(logs), "--role", "rank", "--tee", "1")
    attempt = run_dir(logs) / "attempt_0"
    for rank in (0, 1):
        header = f"[rank{rank}]:"
        assert console_lines(result.stdout, header) == expected_stdout(rank).splitlines()
        assert (attempt / str(rank) / "stdout.log").read_text() == expected_stdout(rank)
        assert not (attempt / str(rank) / "stderr.log").exists(), "--tee 1 copies stdout only"
        assert f"[{rank}] err one from rank {rank}" in result.stderr.splitlines(), result.describe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("template", "role", "header"),
    [
        ("[rank${rank}]: ", "default", "[rank{rank}]: "),  # PyTorch's own launcher test's template
        # Not in the parity pass (.ci/run): the agent renders the prefix as it reads the workers'
        # pipes, whichever way they started; "rank" runs there and shows a forked worker's lines headed.
        pytest.param(
            "${role_name}/${local_rank}|$rank|${unknown} ",
            "trainer",
            "trainer/{rank}|{rank}|${{unknown}} ",
            marks=pytest.mark.same_start_as_a_sibling,
        ),
    ],
    ids=["rank", "every-name"],
)
def test_log_line_prefix_template_heads_tee_d_lines_and_filtered_files(
    tmp_path: Path, template: str, role: str, header: str
) -> None:
    """TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE is read as torchrun reads it: string.Template's
    safe_substitute with role_name, rank and local_rank (an unknown name stays as written), on
    the tee'd console lines and the --duplicate-*-filters files."""
    logs = tmp_path / "logs"
    write_probe(tmp_path / "two_streams.py", TWO_STREAMS)
    flags = ["--log-dir", str(logs), "--role", role, "--tee", "3", "--duplicate-stdout-filters", "two"]
    result = run_rally(
        ["--standalone", "--nproc-per-node", "2", *flags, "two_streams.py"],
        cwd=tmp_path,
        env=clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=template),
    )
    assert result.returncode == 0, result.describe()
    filtered = (run_dir(logs) / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    for rank in (0, 1):
        head = header.format(rank=rank)
        assert console_lines(result.stdout, head) == expected_stdout(rank).splitlines()
        assert console_lines(result.stderr, head) == expected_stderr(rank).splitlines()
        assert f"{head}out two from rank {rank}" in filtered, filtered


# Every line ends with a newline: torchrun's tailer prints an unterminated last line without
# one, glued to whatever comes next, which rally does not imitate.
WHOLE_LINES = """
    import os, sys
    rank = os.environ["RANK"]
    print(f"out one from rank {rank}")
    print(f"err one from rank {rank}", file=sys.stderr)
    print(f"out two from rank {rank}")
"""


# Not in the parity pass (.ci/run): rally's workers here start as
# test_log_line_prefix_template_heads_tee_d_lines_and_filtered_files[rank]'s (--tee 3 and a prefix
# template: both streams to a file and a pipe), which that pass runs; the torchrun job it compares
# with starts the same in either pass.
@pytest.mark.same_start_as_a_sibling
@pytest.mark.torch
@pytest.mark.timeout(180)
def test_tee_d_console_lines_are_byte_for_byte_torchrun_s(tmp_path: Path) -> None:
    """The same job under torchrun and under rally, --tee 3 --role rank with a prefix template:
    the worker lines on each console stream are the same bytes (order between workers aside)."""
    write_probe(tmp_path / "whole_lines.py", WHOLE_LINES)
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${role_name} ${rank}/${local_rank}]: ")
    args = ["--standalone", "--nproc-per-node", "2", "--role", "rank", "--tee", "3", "whole_lines.py"]
    torchrun = run_rally([], argv=[sys.executable, "-m", "torch.distributed.run", *args], cwd=tmp_path, env=env)
    rally = run_rally(args, cwd=tmp_path, env=env)
    for result in (torchrun, rally):
        assert result.returncode == 0, result.describe()
    for stream in ("stdout", "stderr"):
        seen = {
            name: sorted(line for line in getattr(result, stream).splitlines() if line.startswith("[rank "))
            for name, result in (("torchrun", torchrun), ("rally", rally))
        }
        assert len(seen["torchrun"]) == (4 if stream == "stdout" else 2), torchrun.describe()
        assert seen["rally"] == seen["torchrun"], f"{stream}: {seen}"


# Not in the parity pass (.ci/run): its workers start as test_tee_1_with_role_rank_...'s (stdout to
# a file and a pipe, stderr to a pipe); only the role's name and how the agent heads the lines it
# reads differ, which is the agent's, whichever way the workers started.
@pytest.mark.same_start_as_a_sibling
@pytest.mark.timeout(120)
def test_no_prefix_with_tee_is_torchrun_s_console_and_torchrun_prefix_is_its_deprecated_name(tmp_path: Path) -> None:
    """--no-prefix drops rally's "[0] " from the untee'd stream; the tee'd one keeps torchrun's
    header. --torchrun-prefix, which asked for exactly that console before it was the default,
    still runs (config files give it) and says in one line that it now means --no-prefix."""
    for flag in ("--no-prefix", "--torchrun-prefix"):
        result = run_two_streams(tmp_path, "--role", "trainer", "--tee", "1", flag, nproc=1)
        header = "[trainer0]:"
        assert console_lines(result.stdout, header) == expected_stdout(0).splitlines()
        assert "err one from rank 0" in result.stderr.splitlines(), "bare, as torchrun shows it: " + result.describe()
        notes = [line for line in result.stderr_lines if "--torchrun-prefix is deprecated" in line]
        assert len(notes) == (1 if flag == "--torchrun-prefix" else 0), result.describe()


# Not in the parity pass (.ci/run): its workers start as test_tee_3_...'s (both streams to a file and
# a pipe); the filter is the agent's, which reads every rank's pipe and shows only rank 0's
# (agent/rounds/workers.py: JobSpec.shows_on_console).
@pytest.mark.same_start_as_a_sibling
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


# Not in the parity pass (.ci/run): its workers start as test_final_line_without_newline_...'s (the
# default: both streams to pipes the agent reads); how the agent assembles the pieces it reads into
# whole lines is the agent's, whichever way the workers started.
@pytest.mark.same_start_as_a_sibling
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


# Not in the parity pass (.ci/run): its worker starts as test_final_line_without_newline_...'s (the
# default pipes); with --no-prefix the agent passes what it reads through as it is.
@pytest.mark.same_start_as_a_sibling
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
