"""Carriage-return progress (tqdm, rich) reaches the console as it happens, and output that
never ends a line keeps the agent's memory bounded.

The progress probe prints a tqdm-style redraw ("\\r step k") and then waits until the test has
seen that redraw on rally's console (the test creates a file); only after the last one does it
end the line. Without live '\\r' handling the probe would wait forever.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from support.helpers import OnTerminal, clean_env, kill_group, start_rally, write_probe

PROGRESS = """
    import os, sys, time
    go = sys.argv[1]
    for step in range(1, 4):
        sys.stdout.write(f"\\rstep {step}/3")
        sys.stdout.flush()
        while not os.path.exists(f"{go}.{step}"):  # the test has seen this redraw
            time.sleep(0.01)
    sys.stdout.write("\\rstep 3/3 done\\n")
"""

FLOOD = """
    import os, sys, time
    chunk = "x" * 65536
    for _ in range(160):  # 10 MiB, no newline
        sys.stdout.write(chunk)
    sys.stdout.flush()
    while not os.path.exists(sys.argv[1]):  # until the test has measured the agent
        time.sleep(0.01)
"""


def start(tmp_path: Path, args: list[str]) -> subprocess.Popen:
    """rally with plain worker starts, its output read as bytes (the pieces are what is tested)."""
    env = clean_env(RALLY_NO_PRELOAD=None, RALLY_PRELOAD=None)
    return start_rally(["--standalone", "--no-preload", *args], cwd=tmp_path, env=env, text=False)


def read_until(proc: subprocess.Popen, seen: bytearray, done, timeout: float) -> None:
    """Read rally's stdout into `seen` until `done(seen)` (fail after `timeout`)."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while not done(seen):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; console so far: {bytes(seen[-300:])!r}"
        if selector.select(left):
            chunk = os.read(proc.stdout.fileno(), 1 << 20)
            assert chunk, f"rally closed stdout early: {bytes(seen[-300:])!r}"
            seen += chunk
    selector.close()


@pytest.mark.timeout(120)
def test_each_progress_redraw_reaches_the_console_before_the_line_ends(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "progress.py", PROGRESS)
    go = tmp_path / "go"
    proc = start(tmp_path, [str(probe), str(go)])
    seen = bytearray()
    try:
        for step in (1, 2, 3):
            read_until(proc, seen, lambda s, step=step: f"[0] step {step}/3\r".encode() in s, 60)
            assert b"done" not in seen
            Path(f"{go}.{step}").touch()
        read_until(proc, seen, lambda s: b"[0] step 3/3 done\n" in s, 60)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        kill_group(proc.pid)
        proc.wait()
    console = bytes(seen)
    first, second = console.index(b"[0] step 1/3\r"), console.index(b"[0] step 2/3\r")
    assert first < second < console.index(b"[0] step 3/3 done\n"), console


@pytest.mark.timeout(120)
def test_ten_megabytes_without_a_newline_keep_the_agent_memory_bounded(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "flood.py", FLOOD)
    go = tmp_path / "measured"
    proc = start(tmp_path, [str(probe), str(go)])
    seen = bytearray()
    try:
        read_until(proc, seen, lambda s: b"[0] x" in s, 60)  # the worker is writing
        agent = psutil.Process(proc.pid)
        before = agent.memory_info().rss
        read_until(proc, seen, lambda s: s.count(b"x") >= 10 * 1024 * 1024 - 65536, 60)  # the last piece waits for more
        grown = agent.memory_info().rss - before
        go.touch()
        rest, _ = proc.communicate(timeout=60)
        seen += rest
        assert proc.returncode == 0
    finally:
        kill_group(proc.pid)
        proc.wait()
    assert grown < 8 * 1024 * 1024, f"the agent grew by {grown / 2**20:.1f} MiB for 10 MiB of output without a newline"
    pieces = [line for line in bytes(seen).split(b"\n") if line.startswith(b"[0] x")]
    assert len(pieces) >= 150 and all(len(p) <= 65536 + 4 for p in pieces)  # written in bounded, prefixed pieces


@pytest.mark.timeout(120)
def test_under_the_live_view_the_latest_redraw_shows_below_the_table(tmp_path: Path) -> None:
    """On a real pseudo-terminal the redraw cannot overwrite a line above the live table, so
    it is shown under the table until the worker ends the line."""
    import re

    probe = write_probe(
        tmp_path / "bar.py",
        """
        import sys, time
        for step in range(1, 16):
            sys.stdout.write(f"\\rbar {step}/15")
            sys.stdout.flush()
            time.sleep(0.2)  # a slow loop, as in training; the live view refreshes twice a second
        print()
        print("finished")
        """,
    )
    env = {**clean_env(RALLY_NO_PRELOAD=None, RALLY_PRELOAD=None), "TERM": "xterm", "COLUMNS": "120", "LINES": "40"}
    terminal = OnTerminal(["--standalone", "--no-preload", str(probe)], cwd=tmp_path, env=env)
    try:
        terminal.read(90)
        assert terminal.proc.wait(timeout=30) == 0
    finally:
        terminal.close()
    text = terminal.text()
    assert "rally · node 0" in text, text[-2000:]
    shown = set(re.findall(r"\[0\] bar (\d+)/15", text))
    assert len(shown) >= 3, f"progress redraws seen under the live table: {sorted(shown)}\n{text[-2000:]}"
    assert "[0] finished" in text
