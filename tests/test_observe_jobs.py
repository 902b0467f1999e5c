"""Seeing a running job from outside: a straggler named across nodes (events, `rally status`),
/metrics scraped over HTTP while a job fails and restarts, `rally status` inside a SLURM step
with no flags, and the live view naming a straggler under a real pseudo-terminal.

Workers are stdlib probes (--no-preload); each agent is a real rally process on loopback.
"""

from __future__ import annotations

import os
import platform
import random
import re
import socket
import subprocess
import urllib.error
import urllib.request
from importlib import metadata

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import rally
from support.agents import c10d_args, start_agent, stop_all, write_script
from support.helpers import OnTerminal, clean_env, eventually, free_port, rally_status, read_events, run_rally

# Each rank steps at its own pace (STEP_SECONDS_<rank>, default 0.05 s) until the file `stop`
# appears; with FAIL_ON_FILE set, rank 1 of the first attempt exits 3 once the file `fail` appears.
PACED = """
import os, sys, time
from pathlib import Path
from rally import job
rank = os.environ["RANK"]
pause = float(os.environ.get("STEP_SECONDS_" + rank, "0.05"))
first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
step = 0
while not Path("stop").exists():
    time.sleep(pause)
    job.heartbeat(step=step)
    step += 1
    if os.environ.get("FAIL_ON_FILE") and rank == "1" and first_attempt and Path("fail").exists():
        sys.exit(3)
print("rank", rank, "stopped at step", step, flush=True)
"""


@pytest.mark.timeout(180)
def test_a_rank_slower_than_the_rest_of_the_job_is_named_though_alone_on_its_node(tmp_path):
    """Two nodes, one rank each: only the job-wide median (node 0's summary) can name rank 1."""
    port = free_port()
    script = write_script(tmp_path, "paced.py", PACED)
    common = [
        *c10d_args(port, "2", run_id="stragglerjob"),
        "--nproc-per-node",
        "1",
        "--no-preload",
        "--resource-interval",
        "0.2",
    ]
    env = {"STEP_SECONDS_0": "0.04", "STEP_SECONDS_1": "0.16"}
    agents = [
        start_agent(f"n{i}", tmp_path, [*common, "--log-dir", str(tmp_path / f"logs{i}"), str(script)], env)
        for i in range(2)
    ]
    try:
        assert eventually(lambda: "straggler: rank 1" in agents[1].output(), 90), agents[1].output()
        line = next(x for x in agents[1].output().splitlines() if "straggler: rank 1" in x)
        assert "median of the job's other ranks" in line, line
        (event,) = [e for e in read_events(tmp_path / "logs1") if e["event"] == "straggler"]
        assert event["rank"] == 1 and event["node"] == socket.gethostname() and event["node_rank"] in (0, 1)
        assert event["scope"] == "job" and event["factor"] == 1.5
        assert 0.14 < event["step_time"] < 0.4 and 0.03 < event["median"] < 0.1, event  # loaded machines are slow

        # The node's status record is republished every STATUS_INTERVAL (2 s): the console may name
        # the straggler before the record a fast `rally status` reads does.
        def named_in_status() -> bool:
            nonlocal status
            status = rally_status(["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stragglerjob"])
            return status.returncode == 0 and "straggler: rank 1" in status.stdout

        status = None
        eventually(named_in_status, 15)
        assert status is not None and status.returncode == 0, status and status.stderr
        assert "s/step" in status.stdout and re.search(
            r"straggler: rank 1 on \S+ takes 0\.\d+ s per step", status.stdout
        ), status.stdout
        assert re.search(r"0\.\d{3} slow", status.stdout), status.stdout
        (tmp_path / "stop").touch()
        assert [a.wait(60) for a in agents] == [0, 0]
        assert not [e for e in read_events(tmp_path / "logs0") if e["event"] == "straggler"]  # rank 0 is the fast one
    finally:
        stop_all(agents)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics with a real HTTP client; {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    run_ids = {sample.labels.get("run_id") for sample in samples}
    assert len(run_ids) == 1 and None not in run_ids and "" not in run_ids, run_ids  # every metric names its job
    found = {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "run_id"))): sample.value
        for sample in samples
    }
    found[("run_id", ())] = run_ids.pop()
    return found


def value(metrics: dict, name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def worker(metrics: dict, name: str, rank: int, **labels: str) -> float | None:
    return value(metrics, name, rank=str(rank), local_rank=str(rank), host=socket.gethostname(), **labels)


@pytest.mark.timeout(180)
def test_metrics_are_served_in_prometheus_format_and_follow_the_job_through_a_restart(tmp_path):
    script = write_script(tmp_path, "paced.py", PACED)
    args = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-preload",
        "--max-restarts",
        "1",
        "--resource-interval",
        "0.2",
        "--metrics-port",
        "0",
        str(script),
    ]
    agent = start_agent("metrics", tmp_path, args, {"FAIL_ON_FILE": "1"})
    try:
        found = eventually(lambda: re.search(r"Prometheus metrics at http://\S+:(\d+)/metrics", agent.output()), 60)
        assert found, agent.output()
        port = int(re.search(r"Prometheus metrics at http://\S+:(\d+)/metrics", agent.output()).group(1))
        assert port > 0

        def steps_known() -> dict | None:
            m = scrape(port)
            known = all(  # both ranks: the test compares rank 0's step below
                worker(m, "rally_worker_step", rank) is not None
                and worker(m, "rally_worker_cpu_seconds_total", rank) is not None
                for rank in (0, 1)
            )
            return m if known else None

        assert eventually(steps_known, 60), agent.output()
        before = scrape(port)
        assert value(before, "rally_round") == 0 and value(before, "rally_restarts_total") == 0
        # Prometheus' conventions: CPU as a seconds counter, a build_info gauge, the job's run id.
        run_id = value(before, "run_id")
        assert re.fullmatch(r"[0-9a-f-]{36}", run_id) and "rally status --rdzv-endpoint localhost:" in agent.output()
        assert run_id in agent.output()  # the run id `rally status` needs is the label's
        assert (
            value(
                before,
                "rally_build_info",
                version=rally.__version__,
                torch=metadata.version("torch"),
                python=platform.python_version(),
            )
            == 1
        )
        assert not [name for name, _ in before if name in ("rally_worker_cpu_percent", "rally_gpu_problems")]
        assert value(before, "rally_world_size") == 2 and value(before, "rally_nodes") == 1
        assert value(before, "rally_failures_total", kind="worker_failed") == 0
        for rank in (0, 1):
            assert worker(before, "rally_worker_state", rank, state="running") == 1
            assert worker(before, "rally_worker_state", rank, state="failed") == 0
            assert worker(before, "rally_worker_rss_bytes", rank) > 1024 * 1024
            assert 0 <= worker(before, "rally_worker_heartbeat_age_seconds", rank) < 5
            assert worker(before, "rally_worker_straggler", rank) == 0
        assert eventually(
            lambda: worker(scrape(port), "rally_worker_step", 0) > worker(before, "rally_worker_step", 0), 30
        )
        assert eventually(lambda: worker(scrape(port), "rally_worker_step_seconds", 0) is not None, 30)
        assert eventually(
            lambda: (
                worker(scrape(port), "rally_worker_cpu_seconds_total", 0)
                > worker(before, "rally_worker_cpu_seconds_total", 0)
            ),
            30,
        )

        (tmp_path / "fail").touch()  # rank 1 of the first attempt exits 3: one restart
        assert eventually(lambda: value(scrape(port), "rally_restarts_total") == 1, 60), agent.output()
        after = scrape(port)
        assert value(after, "rally_round") == 1
        assert value(after, "rally_failures_total", kind="worker_failed") == 1
        assert value(after, "rally_failures_total", kind="worker_hung") == 0
        assert eventually(lambda: worker(scrape(port), "rally_worker_state", 1, state="running") == 1, 30)

        (tmp_path / "stop").touch()
        assert agent.wait(60) == 0, agent.output()
        with pytest.raises(urllib.error.URLError):  # the server went away with the agent
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        stop_all([agent])


@pytest.mark.timeout(120)
def test_a_metrics_port_in_use_is_one_line_and_exit_2(tmp_path):
    script = write_script(tmp_path, "w.py", "print('never runs')\n")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_rally(["--standalone", "--no-preload", "--metrics-port", str(port), str(script)], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"--metrics-port {port}: cannot listen" in done.stderr and "Traceback" not in done.stderr
    assert "never runs" not in done.stdout


@pytest.mark.timeout(120)
def test_metrics_addr_keeps_the_endpoint_on_loopback(tmp_path):
    """--metrics-addr 127.0.0.1: the socket listens on loopback only (read back from the
    kernel's own table of listening sockets), and the printed address is the one to scrape."""
    script = write_script(tmp_path, "paced.py", PACED)
    args = [
        "--standalone",
        "--nproc-per-node",
        "1",
        "--no-preload",
        "--metrics-port",
        "0",
        "--metrics-addr",
        "127.0.0.1",
        str(script),
    ]
    agent = start_agent("loopback", tmp_path, args)
    try:
        printed = r"Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics"
        assert eventually(lambda: re.search(printed, agent.output()), 60), agent.output()
        port = int(re.search(printed, agent.output()).group(1))
        listening = [
            c.laddr.ip
            for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert listening == ["127.0.0.1"], listening
        assert value(scrape(port), "rally_failures_total", kind="worker_failed") == 0
        (tmp_path / "stop").touch()
        assert agent.wait(60) == 0, agent.output()
    finally:
        stop_all([agent])
    done = run_rally(
        ["--standalone", "--no-preload", "--metrics-port", "0", "--metrics-addr", "192.0.2.1", str(script)],
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "--metrics-addr 192.0.2.1 --metrics-port 0: cannot listen" in done.stderr, (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def slurm_step_env(job_id: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
    }  # fmt: skip


def job_id_with_a_free_store_port() -> tuple[str, int]:
    """A SLURM job id whose derived store port (launcher/schedulers/slurm.py) is free here right now."""
    from rally.launcher.schedulers.slurm import SlurmJob, expand_hostlist

    rng = random.Random()
    for _ in range(50):
        job_id = str(rng.randrange(100_000, 10_000_000))
        port = SlurmJob.from_env(slurm_step_env(job_id), expand=expand_hostlist).store_port
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job_id, port
    pytest.fail("no SLURM job id with a free store port")


@pytest.mark.timeout(150)
def test_rally_status_inside_a_slurm_step_needs_no_endpoint_or_id(tmp_path):
    """No SLURM cluster: a real rally job started with SLURM's variables hosts the store that
    SLURM's variables point at, and `rally status` finds it from the same variables."""
    job_id, port = job_id_with_a_free_store_port()
    script = write_script(tmp_path, "paced.py", PACED)
    slurm = slurm_step_env(job_id)
    agent = start_agent("slurm", tmp_path, ["--nproc-per-node", "2", "--no-preload", str(script)], slurm)
    try:
        assert eventually(lambda: "round 0:" in agent.output(), 60), agent.output()
        assert f"store 127.0.0.1:{port}" in agent.output()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        last: list[subprocess.CompletedProcess[str]] = []

        # As `srun --overlap --jobid ID rally status` runs it: a step of its own, on some node of
        # the job; the job's rally runs in step 0 (the default of --slurm-step).
        own_step = {**slurm, "SLURM_STEP_ID": "7", "SLURM_STEP_NODELIST": "somewhere-else"}

        def both_running() -> bool:
            last[:] = [rally_status([], env={**env, **own_step})]
            return last[0].returncode == 0 and last[0].stdout.count("running") == 2

        assert eventually(both_running, 30), last[0].stdout + last[0].stderr
        assert f"job {job_id}.0 at 127.0.0.1:{port}: round 0" in last[0].stdout, last[0].stdout
        outside = rally_status([], env=env)  # outside SLURM, nothing named: this user's recent runs
        assert outside.returncode == 0 and "your recent runs on this machine" in outside.stdout, outside.stderr
        assert "Traceback" not in outside.stderr
        (tmp_path / "stop").touch()
        assert agent.wait(60) == 0, agent.output()
    finally:
        stop_all([agent])


@pytest.mark.timeout(150)
def test_the_live_view_names_a_straggler_under_a_real_terminal(tmp_path):
    script = write_script(tmp_path, "paced.py", PACED)
    env = {**clean_env(), "TERM": "xterm", "COLUMNS": "120", "LINES": "40", "STEP_SECONDS_1": "0.2"}
    args = ["--standalone", "--nproc-per-node", "3", "--no-preload", "--resource-interval", "0.2"]
    args += ["--straggler-window", "4", str(script)]  # named after 2 x 4 slow steps, not 2 x 10
    terminal = OnTerminal(args, cwd=tmp_path, env=env)
    try:
        terminal.read(120, until=lambda seen: b"slow" in seen)  # until the table marks a straggler
        (tmp_path / "stop").touch()
        terminal.read(60)
        assert terminal.proc.wait(timeout=30) == 0
    finally:
        terminal.close()
    text = terminal.text()
    assert re.search(r"┃ rank\s+┃ pid\s+┃ state.*┃\s+step ┃\s+s/step ┃", text), text[-3000:]
    assert re.search(r"│ 1\s+│ \d+\s+│ running.*│\s+0\.\d{3} slow │", text), text[-3000:]
    assert re.search(
        r"straggler: rank 1 on \S+ takes 0\.\d+ s per step, \d+\.\dx the median of this node's other ranks", text
    ), text[-3000:]
