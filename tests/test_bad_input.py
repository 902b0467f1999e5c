"""Specification: bad input gets exit status 2 and one clear line, never a traceback.

    $ rally --nnodes 3:1 train.py
    rally: error: --nnodes '3:1': MIN (3) is larger than MAX (1); write --nnodes 1:3
    $ echo $?
    2

Input that is wrong on its face (flags, config file) is rejected before anything starts, so
stderr holds exactly that one line. A rendezvous that cannot form (no store, missing nodes)
is found out only at run time: rally's progress lines may come first, but the failure is
still one `rally: error:` line naming the endpoint, exit 2, and nothing else (no traceback,
no C++ log dump).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

import rally
from support.helpers import Result, clean_env, free_port, run_rally, write_probe

# rally's own lines; off a terminal, messages from a running agent carry a timestamp.
RALLY_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3} )?rally: ")
# join_timeout=2 plus rally's start-up (importing torch, ~2-3 s here) and slack for a busy machine.
JOIN_TIMEOUT_BUDGET = 15
RALLY_ERROR = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3} )?rally: error: ")


def rally_fails(tmp_path: Path, *args: str, timeout: float = 45) -> Result:
    write_probe(tmp_path / "train.py", "print('the job must not start')")
    return run_rally(list(args), cwd=tmp_path, timeout=timeout)


def the_error_line(result: Result) -> str:
    """Assert the bad-input contract and return the one error line."""
    assert result.returncode == 2, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert "the job must not start" not in result.stdout + result.stderr
    errors = [line for line in result.stderr_lines if RALLY_ERROR.match(line)]
    assert len(errors) == 1, f"expected one 'rally: error:' line\n{result.describe()}"
    return errors[0]


def assert_one_line_only(result: Result) -> str:
    """Rejected before anything ran: stderr is exactly the error line, stdout is empty."""
    line = the_error_line(result)
    assert line.startswith("rally: error: "), line
    assert result.stderr_lines == [line], result.describe()
    assert result.stdout == "", result.describe()
    return line


BAD_FLAGS = [
    pytest.param(["--nnodes", "3:1", "train.py"], "--nnodes", id="nnodes-min-above-max"),
    pytest.param(["--nnodes", "0", "train.py"], "--nnodes", id="nnodes-zero"),
    pytest.param(["--nnodes", "x", "train.py"], "--nnodes", id="nnodes-not-a-number"),
    pytest.param(["--nnodes", "2:20:30", "train.py"], "2:20:30", id="nnodes-three-parts"),
    pytest.param(["--nproc-per-node", "unknown", "train.py"], "unknown", id="nproc-unknown-word"),
    pytest.param(["--nproc-per-node", "-1", "train.py"], "--nproc-per-node", id="nproc-negative"),
    pytest.param(["--nproc-per-node", "gpu", "train.py"], "gpu", id="nproc-gpu-without-gpus"),
    pytest.param(["--max-restarts", "-1", "train.py"], "--max-restarts", id="max-restarts-negative"),
    pytest.param(
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "a:b:c", "train.py"],
        "a:b:c",
        id="endpoint-malformed-c10d",
    ),
    pytest.param(
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:99999", "train.py"],
        "99999",
        id="endpoint-port-out-of-range-c10d",
    ),
    # torchrun's default (static) backend takes its store address from --rdzv-endpoint too.
    pytest.param(["--rdzv-endpoint", "a:b:c", "train.py"], "a:b:c", id="endpoint-malformed-default-backend"),
    pytest.param(
        ["--rdzv-endpoint", "host:99999", "train.py"], "99999", id="endpoint-port-out-of-range-default-backend"
    ),
    pytest.param(["missing_script.py"], "missing_script.py", id="script-missing"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "named"), BAD_FLAGS)
def test_bad_flag_exits_2_with_one_line_naming_the_problem(tmp_path: Path, args: list[str], named: str) -> None:
    line = assert_one_line_only(rally_fails(tmp_path, *args))
    assert named in line, line


# Inputs that used to end in a traceback, a hang or a silently wrong job. "{tmp}" is the
# test's directory, which holds train.py, noexec.sh (a script without the x bit), adir/ and afile.
MORE_BAD_FLAGS = [
    pytest.param(["--signals-to-handle", "SIGKILL", "train.py"], "SIGKILL", id="handle-sigkill"),
    pytest.param(["--signals-to-handle", "SIGTERM,SIGSTOP", "train.py"], "SIGSTOP", id="handle-sigstop"),
    pytest.param(["--signals-to-handle", "SIGCHLD", "train.py"], "SIGCHLD", id="handle-sigchld"),
    pytest.param(["--signals-to-handle", "SIGNOPE", "train.py"], "SIGNOPE", id="handle-unknown-signal"),
    pytest.param(["--preemption-signals", "SIGKILL", "train.py"], "--preemption-signals", id="preempt-sigkill"),
    pytest.param(["--preemption-signals", "STOP", "train.py"], "SIGSTOP", id="preempt-sigstop"),
    pytest.param(["--preemption-signals", "SIGWHAT", "train.py"], "--preemption-signals", id="preempt-unknown-signal"),
    pytest.param(["--log-dir", "/proc/rally-test-logs", "train.py"], "--log-dir", id="log-dir-unwritable"),
    pytest.param(["--log-dir", "{tmp}/afile", "train.py"], "--log-dir", id="log-dir-is-a-file"),
    pytest.param(["--log-dir", "", "train.py"], "--log-dir", id="log-dir-empty"),
    pytest.param(
        ["--checkpoint-dir", "/proc/rally-test-ckpt", "train.py"], "--checkpoint-dir", id="checkpoint-dir-unwritable"
    ),
    pytest.param(
        ["--checkpoint-dir", "{tmp}/afile/sub", "train.py"], "--checkpoint-dir", id="checkpoint-dir-under-a-file"
    ),
    pytest.param(["--checkpoint-dir", "", "train.py"], "--checkpoint-dir", id="checkpoint-dir-empty"),
    *[
        pytest.param([option, value, "train.py"], option, id=f"{option[2:]}-{value}")
        for option in (
            "--shutdown-timeout",
            "--heartbeat-timeout",
            "--silence-timeout",
            "--preemption-grace",
            "--resource-interval",
        )
        for value in ("inf", "nan", "-1", "1e300")
    ],
    pytest.param(["--resource-interval", "1e-9", "train.py"], "--resource-interval", id="resource-interval-tiny"),
    pytest.param(["--monitor-interval", "nan", "train.py"], "--monitor-interval", id="monitor-interval-nan"),
    *[
        pytest.param(["--rdzv-conf", f"{key}={value}", "train.py"], key, id=f"rdzv-conf-{key}-{value}")
        for key, value in [
            ("join_timeout", "inf"),
            ("read_timeout", "nan"),
            ("last_call_timeout", "1e300"),
            ("timeout", "inf"),
            ("keep_alive_interval", "nan"),
            ("keep_alive_timeout", "-3"),
            ("keep_alive_max_attempt", "0.5"),
        ]
    ],
    pytest.param(["--rdzv-conf", "is_host=maybe", "train.py"], "is_host", id="rdzv-conf-is-host-not-a-boolean"),
    pytest.param(
        ["--rdzv-conf", "timeout=5,join_timeout=6", "train.py"],
        "timeout=5 and join_timeout=6",
        id="rdzv-conf-timeout-and-join-timeout-disagree",
    ),
    pytest.param(["--no-python", "{tmp}/noexec.sh"], "noexec.sh", id="no-python-not-executable"),
    pytest.param(["--no-python", "{tmp}/adir"], "adir", id="no-python-a-directory"),
    pytest.param(["{tmp}/adir"], "adir", id="script-is-a-directory"),
    pytest.param(["-m", "no.such..module"], "no.such..module", id="module-name-malformed"),
    pytest.param(["--master-port", "70000", "train.py"], "--master-port", id="master-port-70000"),
    pytest.param(["--master-port", "-1", "train.py"], "--master-port", id="master-port-negative"),
    pytest.param(
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:70000", "train.py"],
        "70000",
        id="c10d-endpoint-port-70000",
    ),
    pytest.param(
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29400", "train.py"],
        "no-such-host.invalid",
        id="c10d-endpoint-unresolvable",
    ),
    pytest.param(
        ["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400", "train.py"],
        "--rdzv-endpoint",
        id="static-endpoint-unresolvable",
    ),
    pytest.param(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "no-such-host.invalid",
            "--master-port",
            "29999",
            "train.py",
        ],
        "--master-addr",
        id="master-addr-unresolvable",
    ),
    pytest.param(
        [
            "--rdzv-backend",
            "c10d",
            "--rdzv-conf",
            "store_type=file",
            "--rdzv-endpoint",
            "/nonexistent-rally/store",
            "train.py",
        ],
        "--rdzv-endpoint",
        id="file-store-directory-missing",
    ),
    pytest.param(["--nproc-per-node", "100000", "train.py"], "--nproc-per-node", id="nproc-huge"),
    pytest.param(["--nproc-per-node", "0", "train.py"], "--nproc-per-node", id="nproc-zero"),
    pytest.param(["--nnodes", "0:0", "train.py"], "--nnodes", id="nnodes-0-0"),
    pytest.param(["--nnodes", "99999999999999999999", "train.py"], "--nnodes", id="nnodes-huge"),
    pytest.param(["--node-rank", "5", "train.py"], "--node-rank", id="node-rank-not-below-nnodes"),
    pytest.param(["--rdzv-id", "", "train.py"], "--rdzv-id", id="rdzv-id-empty"),
    pytest.param(["store", "--port", "70000"], "--port", id="store-port-70000"),
    *[
        pytest.param(["store", "--port", "0", "--timeout", value], "--timeout", id=f"store-timeout-{value}")
        for value in ("inf", "nan", "-1", "1e300")
    ],
    pytest.param(
        ["status", "--rdzv-endpoint", "no-such-host.invalid:29400", "--rdzv-id", "x"],
        "no-such-host.invalid",
        id="status-endpoint-unresolvable",
    ),
    *[
        pytest.param(
            ["status", "--timeout", value, "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x"],
            "--timeout",
            id=f"status-timeout-{value}",
        )
        for value in ("-1", "nan", "inf")
    ],
    # Learned timeouts, GPU reclaim, quarantine, pre-flight
    pytest.param(["--heartbeat-timeout", "sometimes", "train.py"], "or 'auto'", id="heartbeat-timeout-word"),
    pytest.param(["--heartbeat-timeout", "0", "train.py"], "--heartbeat-timeout", id="heartbeat-timeout-zero"),
    pytest.param(
        ["--heartbeat-timeout", "auto", "--timeout-safety-factor", "0.5", "train.py"],
        "--timeout-safety-factor",
        id="safety-factor-below-1",
    ),
    pytest.param(
        ["--heartbeat-timeout", "auto", "--timeout-samples", "1", "train.py"],
        "--timeout-samples",
        id="timeout-samples-1",
    ),
    pytest.param(["--gpu-reclaim-timeout", "-1", "train.py"], "--gpu-reclaim-timeout", id="gpu-reclaim-negative"),
    pytest.param(["--quarantine-after", "-1", "train.py"], "--quarantine-after", id="quarantine-after-negative"),
    pytest.param(["--quarantine-window", "0", "train.py"], "--quarantine-window", id="quarantine-window-zero"),
    pytest.param(["--preflight-factor", "1", "train.py"], "--preflight-factor", id="preflight-factor-1"),
    pytest.param(["--preflight", "--no-preflight", "train.py"], "--no-preflight", id="preflight-both"),
]


def bad_input_dir(tmp_path: Path) -> None:
    write_probe(tmp_path / "noexec.sh", "#!/bin/sh\necho the job must not start\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("not a directory")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "named"), MORE_BAD_FLAGS)
def test_more_bad_flags_exit_2_with_one_line_naming_the_option(tmp_path: Path, args: list[str], named: str) -> None:
    bad_input_dir(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = assert_one_line_only(rally_fails(tmp_path, *args))
    assert named in line, line


@pytest.mark.timeout(60)
def test_bad_environment_timeout_exits_2_naming_the_variable(tmp_path: Path) -> None:
    write_probe(tmp_path / "train.py", "print('the job must not start')")
    result = run_rally(["train.py"], cwd=tmp_path, env=clean_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="forever"))
    line = assert_one_line_only(result)
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["1Q", "lots", "0", "-5G"])
def test_bad_checkpoint_memory_limit_exits_2_naming_the_variable(tmp_path: Path, value: str) -> None:
    """Before: the checkpoint holder died of int('1Q') with a traceback, and the tier was off."""
    write_probe(tmp_path / "train.py", "print('the job must not start')")
    result = run_rally(["train.py"], cwd=tmp_path, env=clean_env(RALLY_CKPT_MEMORY_LIMIT=value))
    line = assert_one_line_only(result)
    assert "RALLY_CKPT_MEMORY_LIMIT" in line, line


BAD_CONFIG_FILES = [
    pytest.param(b"nproc_per_node: 1\nscript: tr\xe9in.py\n", "UTF-8", id="not-utf8"),
    pytest.param(b"script: 123\n", "'script'", id="script-a-number"),
    pytest.param(b"script: [train.py, other.py]\n", "'script'", id="script-a-list"),
    pytest.param(b"script: ''\n", "'script'", id="script-empty"),
    pytest.param(b"script: train.py\nargs: [{lr: 1}]\n", "'args'", id="args-item-a-mapping"),
    pytest.param(b"script: train.py\nmax_restarts: [1]\n", "'max_restarts'", id="max-restarts-a-list"),
    pytest.param(b"script: train.py\nheartbeat_timeout: {s: 1}\n", "'heartbeat_timeout'", id="timeout-a-mapping"),
    pytest.param(b"script: train.py\nlog-dir: [logs]\n", "'log_dir'", id="log-dir-a-list"),
    pytest.param(b"script: train.py\nrdzv_conf: {join_timeout: 5}\n", "'rdzv_conf'", id="rdzv-conf-a-mapping"),
    pytest.param(b"script: train.py\nshutdown_timeout: .inf\n", "--shutdown-timeout", id="timeout-yaml-infinity"),
    pytest.param(b"script: train.py\nsignals_to_handle: SIGKILL\n", "SIGKILL", id="signal-sigkill"),
    pytest.param(b"script: train.py\nmax_restarts: " + b"9" * 5000 + b"\n", "'max_restarts'", id="5000-digit-int"),
    pytest.param(b"script: train.py\nrdzv_id: 2001-13-45\n", "'rdzv_id'", id="impossible-date"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("content", "named"), BAD_CONFIG_FILES)
def test_bad_config_file_value_exits_2_with_one_line_naming_it(tmp_path: Path, content: bytes, named: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_bytes(content)
    line = assert_one_line_only(rally_fails(tmp_path, "--config", str(config)))
    assert named in line, line


@pytest.mark.timeout(60)
def test_misspelled_option_suggests_the_right_one_once(tmp_path: Path) -> None:
    line = assert_one_line_only(rally_fails(tmp_path, "--nprocs-per-node", "2", "train.py"))
    assert "--nprocs-per-node" in line and "--nproc-per-node" in line, line
    assert line.lower().count("did you mean") == 1, f"the suggestion is made once: {line}"


@pytest.mark.timeout(60)
def test_config_file_with_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("nproc_per_node: 2\nscript: train.py\nargs: [--lr, 0.1\nmax_restarts: 1\n")
    line = assert_one_line_only(rally_fails(tmp_path, "--config", str(config)))
    assert str(config) in line and re.search(r"\bline [34]\b", line), line


@pytest.mark.timeout(60)
def test_config_file_with_unknown_key_suggests_the_nearest_valid_key(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("nproc_per_node: 2\nmax_restart: 1\nscript: train.py\n")
    line = assert_one_line_only(rally_fails(tmp_path, "--config", str(config)))
    assert "max_restart" in line and "max_restarts" in line.replace("max-restarts", "max_restarts"), line


def assert_only_rally_lines(result: Result) -> None:
    """Runtime failures: every stderr line is one of rally's own (no C++ log dump, no traceback)."""
    other = [line for line in result.stderr_lines if not RALLY_LINE.match(line) and line.strip()]
    assert not other, "stderr has lines that are not rally's:\n" + "\n".join(other[:15]) + f"\n{result.describe()}"


@pytest.mark.timeout(60)
def test_rendezvous_that_never_completes_exits_2_within_seconds_naming_the_endpoint(tmp_path: Path) -> None:
    # 127.0.0.1 is this host, so rally hosts the store there (as torchrun would) and waits
    # for a second node that never comes.
    endpoint = f"127.0.0.1:{free_port()}"
    result = rally_fails(
        tmp_path, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-conf", "join_timeout=2", "train.py",
    )  # fmt: skip
    line = the_error_line(result)
    assert endpoint in line, line
    assert result.elapsed < JOIN_TIMEOUT_BUDGET, f"join_timeout=2 but rally took {result.elapsed:.1f} s"
    assert_only_rally_lines(result)


@pytest.mark.timeout(60)
def test_unreachable_store_exits_2_within_seconds_naming_the_endpoint(tmp_path: Path) -> None:
    # is_host=0: this node must connect to a store someone else hosts; nobody listens there.
    endpoint = f"127.0.0.1:{free_port()}"
    result = rally_fails(
        tmp_path, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-conf", "join_timeout=2,is_host=0", "train.py",
    )  # fmt: skip
    line = the_error_line(result)
    assert endpoint in line, line
    assert result.elapsed < JOIN_TIMEOUT_BUDGET, f"join_timeout=2 but rally took {result.elapsed:.1f} s"
    assert_only_rally_lines(result)


@pytest.mark.timeout(60)
def test_help_shows_grouped_options_and_examples(tmp_path: Path) -> None:
    result = run_rally(["--help"], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    for heading in (
        "Job options:",
        "Rendezvous options:",
        "Restarts and shutdown options:",
        "Logs and output options:",
        "Entry point options:",
    ):
        assert heading in result.stdout, heading
    assert "Examples:" in result.stdout
    assert "rally --standalone --nproc-per-node" in result.stdout
    for flag in ("--nproc-per-node", "--nproc_per_node", "--rdzv-endpoint", "--max-restarts", "--tee", "--no-python"):
        assert flag in result.stdout, flag
    assert result.stderr == ""


@pytest.mark.timeout(60)
def test_version_names_rally_torch_and_python(tmp_path: Path) -> None:
    """What a bug report needs, in one line, without importing torch."""
    import platform
    from importlib import metadata

    result = run_rally(["--version"], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    expected = f"rally {rally.__version__} (torch {metadata.version('torch')}, Python {platform.python_version()})\n"
    assert result.stdout == expected and result.stderr == ""


# ------------------------------------------------------------------ what once crashed with a traceback
LONG_NAME = "x" * 300


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", ["--log-dir", "--checkpoint-dir"])
def test_a_path_component_longer_than_255_bytes_exits_2_with_one_line(tmp_path: Path, option: str) -> None:
    line = assert_one_line_only(
        rally_fails(tmp_path, "--standalone", option, str(tmp_path / LONG_NAME / "run"), "train.py")
    )
    assert option in line and "at most 255" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_config_that_is_not_a_regular_file_exits_2_at_once(tmp_path: Path, kind: str) -> None:
    config = tmp_path / "job.yaml"
    if kind == "fifo":
        os.mkfifo(config)  # reading it would block for ever
    else:
        config.symlink_to("/dev/zero")  # reading it would fill memory
    result = rally_fails(tmp_path, "--config", str(config), "--standalone", "train.py", timeout=30)
    line = assert_one_line_only(result)
    assert "--config" in line and "not a regular file" in line, line


@pytest.mark.timeout(60)
def test_module_with_no_python_exits_2_before_anything_starts(tmp_path: Path) -> None:
    line = assert_one_line_only(rally_fails(tmp_path, "--standalone", "-m", "--no-python", "train"))
    assert "-m/--module" in line and "--no-python" in line, line


@pytest.mark.timeout(60)
def test_rally_store_on_a_taken_port_exits_2_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_rally(["store", "--port", str(port)], cwd=tmp_path, timeout=40)
    line = assert_one_line_only(result)
    assert f"port {port}" in line and "--port" in line, line


@pytest.mark.timeout(60)
def test_rally_status_against_an_unreachable_endpoint_exits_2_with_one_line(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    result = run_rally(
        ["status", "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--timeout", "1"], cwd=tmp_path, timeout=40
    )
    line = assert_one_line_only(result)
    assert endpoint in line, line
