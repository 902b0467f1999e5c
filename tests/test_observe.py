"""Seeing a running job, the worker side and the judgement: heartbeat(step=N) and sections in the
heartbeat file, step times and the straggler rule, the median of the other ranks, GPU health over
NVML readings, and hangs during start-up or inside a named section (real rally runs, stdlib probes).

Job-level checks (stragglers across nodes, /metrics scraped over HTTP, `rally status` under
SLURM, the live view) are in tests/test_observe_jobs.py.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rally.agent.observe import gpu
from rally.agent.observe.gpu import DeviceReading
from rally.agent.observe.stragglers import CentralValues, StepClock, StragglerWatch, job_step_times
from rally.agent.worker_side import heartbeat_file, job
from support.helpers import read_events, read_jsonl, run_rally

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", job.HEARTBEAT_FILE_ENV)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("PET_", "RALLY_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_worker_code(code: str, heartbeat: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=child_env(RALLY_HEARTBEAT_FILE=str(heartbeat)),
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


def rally(tmp: Path, script: str, *args: str, timeout: float = 90) -> tuple[int, str]:
    """Run rally on a stdlib probe (no template: nothing to preload) and return (code, output)."""
    path = tmp / "w.py"
    path.write_text(textwrap.dedent(script))
    done = run_rally(
        ["--standalone", "--no-preload", "--log-dir", str(tmp / "logs"), *args, str(path)],
        cwd=tmp,
        env=child_env(),
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr


# --- the heartbeat file: steps and sections ------------------------------------------------------


@pytest.mark.timeout(30)
def test_heartbeat_with_a_step_and_sections_reach_the_file_from_another_process(tmp_path):
    path = heartbeat_file.create(tmp_path / "hb")
    assert heartbeat_file.read_record(path) == heartbeat_file.HeartbeatRecord()
    before = time.monotonic_ns()
    done = run_worker_code(
        """
        import json, os, sys
        from rally import job
        from rally.agent.worker_side import heartbeat_file
        path = os.environ["RALLY_HEARTBEAT_FILE"]
        seen = {}
        job.heartbeat()                                   # the no-argument form still works
        seen["plain"] = heartbeat_file.read_record(path).step
        job.heartbeat(step=41)
        seen["step"] = heartbeat_file.read_record(path).step
        with job.section("checkpoint", timeout=600):
            r = heartbeat_file.read_record(path)
            seen["in"] = [r.section, r.section_timeout]
            with job.section("upload"):                   # no timeout of its own: keeps the outer deadline
                inner = heartbeat_file.read_record(path)
                same_start = inner.section_entered_ns == r.section_entered_ns
                seen["nested"] = [inner.section, inner.section_timeout, same_start]
            with job.section("verify", timeout=5):
                seen["own"] = heartbeat_file.read_record(path).section_timeout
            seen["back"] = heartbeat_file.read_record(path).section
        seen["out"] = heartbeat_file.read_record(path).section
        try:
            with job.section("bad", timeout=-1):
                pass
        except ValueError as exc:
            seen["bad"] = str(exc)
        print(json.dumps(seen))
        """,
        path,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["plain"] is None and seen["step"] == 41
    assert seen["in"] == ["checkpoint", 600.0]
    assert seen["nested"] == ["checkpoint/upload", 600.0, True]
    assert seen["own"] == 5.0 and seen["back"] == "checkpoint" and seen["out"] == ""
    assert "timeout must be a positive number" in seen["bad"]
    record = heartbeat_file.read_record(path)
    assert (
        record.count == 2
        and record.step == 41
        and before < record.ns < record.section_changed_ns <= time.monotonic_ns()
    )
    assert os.path.getsize(path) == heartbeat_file.SIZE == 224  # fixed size, shared by both sides


@pytest.mark.timeout(30)
def test_a_beat_with_a_step_still_costs_microseconds_and_section_names_are_cut_safely(tmp_path):
    path = heartbeat_file.create(tmp_path / "hb")
    done = run_worker_code(
        """
        import time
        from rally import job
        start = time.process_time()
        for step in range(10_000):
            job.heartbeat(step=step)
        print(time.process_time() - start)
        with job.section("é" * 40):
            pass
        """,
        path,
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.0, f"10,000 beats with a step took {done.stdout.strip()} s of CPU"
    assert heartbeat_file.read_record(path).step == 9999
    assert heartbeat_file.encode_section_name("é" * 40).decode() == "é" * 32  # 64 bytes, whole characters


@pytest.mark.timeout(30)
def test_sections_outside_rally_do_nothing_and_rally_job_imports_without_torch():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom rally import job\nwith job.section('setup', timeout=1):\n    "
            "job.heartbeat(step=3)\nprint('torch' in sys.modules)",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# --- step times and the straggler rule -----------------------------------------------------------


def test_step_clock_averages_over_at_least_the_window_and_restarts_on_a_new_count():
    clock = StepClock(window=4)
    for step in range(4):
        clock.add(step, (step + 1) * 100_000_000)  # 0.1 s per step
    assert clock.step_time() is None  # 3 steps seen: the window is not spanned yet
    assert clock.add(4, 500_000_000) and not clock.add(4, 600_000_000)
    assert clock.step_time() == pytest.approx(0.1)
    clock.add(10, 1_700_000_000)  # sampled coarsely: 6 steps in 1.2 s
    assert clock.step_time() == pytest.approx((1.7 - 0.5) / 6)
    clock.add(2, 1_800_000_000)  # the script counts from a new start
    assert clock.step_time() is None and clock.step == 2


@pytest.mark.parametrize("seed", range(6))
def test_the_median_of_all_other_ranks_comes_from_three_published_numbers(seed):
    rng = random.Random(seed)
    for n in range(1, 40):
        times = [round(rng.uniform(0.05, 2.0), 2) for _ in range(n)]  # rounded: ties happen
        summary = CentralValues.from_json(CentralValues.of(times).to_json())
        assert summary is not None and len(summary.values) <= 3
        for i, x in enumerate(times):
            others = times[:i] + times[i + 1 :]
            expected = statistics.median(others) if others else None
            assert summary.median_without(x) == (pytest.approx(expected) if others else None)


@pytest.mark.parametrize(
    "text",
    [
        '{"count": 5, "offset": 1, "values": [1, 2]}',
        "[]",
        "not json",
        '{"count": 3, "offset": 0, "values": [3, 2, 1]}',
        '{"count": 2, "offset": 0, "values": [1, NaN]}',
    ],
)
def test_a_malformed_published_summary_is_ignored(text):
    assert CentralValues.from_json(text) is None


def _feed(watch: StragglerWatch, seconds_per_step: dict[int, list[float]]) -> list:
    """Beat every rank step by step with the given step durations; collect stragglers as named."""
    named = []
    clocks = {rank: 0 for rank in seconds_per_step}
    for step in range(max(len(v) for v in seconds_per_step.values())):
        for rank, durations in seconds_per_step.items():
            clocks[rank] += int(durations[step] * 1e9)
            watch.observe(rank, step, clocks[rank])
        new, _ = watch.judge()
        named += [(step, s) for s in new]
    return named


def test_a_rank_persistently_slower_is_named_and_one_long_step_is_not():
    watch = StragglerWatch(factor=1.5, window=5)
    steady = [0.1] * 40
    slow = [0.1] * 5 + [0.3] * 35
    spike = [0.1] * 12 + [2.0] + [0.1] * 27  # one long step (a checkpoint): not a straggler
    named = _feed(watch, {0: steady, 1: slow, 2: steady, 3: spike})
    assert [s.rank for _, s in named] == [1]
    step, straggler = named[0]
    assert (
        straggler.step_time == pytest.approx(0.3)
        and straggler.median == pytest.approx(0.1)
        and straggler.scope == "node"
    )
    # Its 5-step mean passes 1.5x the others' at step 6 (0.18 s); it is named after staying slow
    # for a further window. The spike's window stays slow for steps 12-16 only: never a whole window.
    assert step == 6 + 5
    assert set(watch.stragglers) == {1}


def test_the_job_median_from_node_0_names_a_rank_that_its_own_node_cannot():
    watch = StragglerWatch(factor=1.5, window=3)
    assert _feed(watch, {7: [0.4] * 20}) == []  # alone on its node: nobody to compare with
    watch.job = CentralValues.of([0.1, 0.1, 0.12, 0.4])  # node 0's summary of the whole job
    named = _feed(watch, {7: [0.4] * 20})
    assert named and named[0][1].scope == "job" and named[0][1].median == pytest.approx(0.1)


def test_node_0_reads_step_times_only_from_this_rounds_records():
    records = [
        {"round": 3, "workers": [{"step_time": 0.1}, {"step_time": None}, {"step_time": 0.2}]},
        {"round": 2, "workers": [{"step_time": 9.0}]},
        {"round": 3, "workers": [{"step_time": "junk"}, {"step_time": float("nan")}, "junk"]},
        "junk",
    ]
    assert job_step_times(records, 3) == [0.1, 0.2]


# --- GPU health over NVML readings ---------------------------------------------------------------


def test_gpu_problems_are_named_from_nvml_readings():
    healthy = DeviceReading(0, "GPU-aaa", ecc_uncorrected=0, xids=(13, 43))  # application XIDs: not the GPU's fault
    sick = DeviceReading(
        1, "GPU-bbb", ecc_uncorrected=2, retired_pages_pending=True, remapping_failed=True, xids=(79, 79, 48)
    )
    assert gpu.device_problems(healthy) == []
    assert gpu.node_problems([healthy, sick]) == [
        "GPU 1 (GPU-bbb): 2 uncorrected ECC errors",
        "GPU 1 (GPU-bbb): memory pages waiting to be retired (reset the GPU)",
        "GPU 1 (GPU-bbb): a memory row remapping failed (the GPU needs service)",
        "GPU 1 (GPU-bbb): XID 48, 79",
    ]
    assert gpu.device_problems(DeviceReading(2, ecc_uncorrected=None)) == []  # no ECC on this board


@pytest.mark.timeout(60)
def test_gpu_memory_and_utilisation_of_a_worker_count_its_children_from_nvml_readings():
    """Replaces the nvidia-smi stand-in: the per-process numbers NVML reports for the worker tree."""
    from rally.agent.observe.health import HealthMonitor, HealthSettings

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = os.getpid()
        devices = [
            DeviceReading(0, utilization=90, processes={me: 1200 * MIB, 999999: 5 * MIB}),
            DeviceReading(1, utilization=40, processes={child.pid: 300 * MIB}, process_utilization={child.pid: 35}),
        ]
        assert gpu.worker_usage(devices, {me, child.pid}) == gpu.WorkerGpu(1500 * MIB, 35)
        assert gpu.worker_usage(devices[:1], {me}) == gpu.WorkerGpu(1200 * MIB, 90)  # no per-process sample
        assert gpu.worker_usage(devices, {4242424}).utilization is None
        without = HealthMonitor(HealthSettings())
        without.watch(0, me, None, time.monotonic())
        without.sample()
        assert without.resources(0).gpu_memory is None  # no NVML: nothing shown at all
        monitor = HealthMonitor(HealthSettings(), gpu=lambda: devices)
        monitor.watch(0, me, None, time.monotonic())
        monitor.sample()
        assert monitor.resources(0).gpu_memory == 1500 * MIB  # this process and its child
    finally:
        child.kill()
        child.wait()


def test_without_nvidia_ml_py_gpu_health_is_skipped_with_a_reason():
    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monitor, reason = gpu.open_monitor(import_module=missing)
    assert monitor is None and reason == "nvidia-ml-py is not installed (pip install 'torch-rally[gpu]' to check GPUs)"


def test_without_a_driver_gpu_health_is_skipped_with_nvmls_reason():
    pytest.importorskip(
        "pynvml", reason="nvidia-ml-py is not installed here (the gpu extra): the driver path cannot be tried"
    )
    monitor, reason = gpu.open_monitor()
    if monitor is not None:
        monitor.close()
        pytest.skip("this machine has a working NVIDIA driver")
    assert reason.startswith("NVML cannot start (") and "no NVIDIA driver on this node" in reason


@pytest.mark.timeout(30)
def test_a_node_with_unhealthy_gpus_is_named_before_it_joins_a_round(tmp_path, capsys):
    """The observer's check before each rendezvous, fed by readings in NVML's shape (no GPU here)."""
    from rally.agent.base.event_log import EventLog
    from rally.agent.base.spec import JobSpec
    from rally.agent.observe.observer import Observer

    class Readings:  # what NvmlMonitor.read returns on a node whose GPU 1 has failed
        def read(self) -> list[DeviceReading]:
            return [DeviceReading(0, "GPU-aaa"), DeviceReading(1, "GPU-bbb", ecc_uncorrected=3, xids=(79,))]

    log = EventLog(tmp_path / "events.jsonl")

    class Agent:  # what the observer reads of its agent (agent/base/collaborator.py's AgentContext) here
        spec, events, host, base_env, run_dir = JobSpec("x.py"), log, "node7", {}, tmp_path

    observer = Observer(Agent())  # type: ignore[arg-type]
    observer.gpu = Readings()  # type: ignore[assignment]
    observer.before_round()
    log.close()
    err = capsys.readouterr().err
    assert (
        "node node7 has unhealthy GPUs before joining the next round: GPU 1 (GPU-bbb): 3 uncorrected ECC "
        "errors; GPU 1 (GPU-bbb): XID 79" in err
    )
    (event,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "gpu_unhealthy"]
    assert event["node"] == "node7" and len(event["problems"]) == 2


def skip_where_nvml_works() -> None:
    monitor, _ = gpu.open_monitor()
    if monitor is not None:
        monitor.close()
        pytest.skip("this node has working NVIDIA GPUs: GPU health is not skipped here")


@pytest.mark.timeout(120)
def test_on_a_node_without_gpus_the_skip_reason_is_logged_and_the_job_runs(tmp_path):
    skip_where_nvml_works()
    code, out = rally(tmp_path, "print('ok')\n")
    assert code == 0, out
    skipped = [e for e in read_events(tmp_path / "logs") if e["event"] == "gpu_health_skipped"]
    assert len(skipped) == 1 and ("not installed" in skipped[0]["reason"] or "no NVIDIA driver" in skipped[0]["reason"])
    assert "GPU health checks skipped" not in out  # no GPU expected here: the console stays quiet


@pytest.mark.timeout(120)
def test_where_gpus_are_expected_the_skip_reason_is_shown_on_the_console(tmp_path):
    skip_where_nvml_works()
    (tmp_path / "w.py").write_text("print('ok')\n")
    done = run_rally(
        ["--standalone", "--no-preload", str(tmp_path / "w.py")], cwd=tmp_path, env=child_env(CUDA_VISIBLE_DEVICES="0")
    )
    assert done.returncode == 0, done.stderr
    assert "rally: warning: GPU health checks skipped: " in done.stderr and "Traceback" not in done.stderr


# --- hangs during start-up and inside sections ---------------------------------------------------

NEVER_BEATS = """
import os, time
from rally import job
def stuck_in_setup():
    while True:
        time.sleep(0.05)
print("starting", flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    stuck_in_setup()
for step in range(5):
    job.heartbeat(step=step)
"""


@pytest.mark.timeout(120)
def test_a_worker_that_never_sends_its_first_heartbeat_is_hung_with_its_stack(tmp_path):
    code, out = rally(tmp_path, NEVER_BEATS, "--nproc-per-node", "2", "--startup-timeout", "1.5", "--max-restarts", "1")
    assert code == 0, out
    assert (
        "rank 1 (local rank 1" in out
        and "is hung: it sent no first heartbeat in 1." in out
        and "since starting (--startup-timeout 1.5)" in out
    )
    assert "stuck_in_setup" in out  # its stack, collected before it was killed
    hung = [e for e in read_events(tmp_path / "logs") if e["event"] == "worker_hung"]
    assert len(hung) == 1 and hung[0]["rank"] == 1


SECTIONS = """
import os, time
from rally import job
def stuck_saving():
    while True:
        time.sleep(0.05)
with job.section("setup", timeout=30):
    time.sleep(2.0)                      # longer than --startup-timeout: fine inside its section
for step in range(3):
    job.heartbeat(step=step)
with job.section("checkpoint", timeout=float(os.environ.get("CKPT_TIMEOUT", "3"))):
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        stuck_saving()
    time.sleep(2.0)                      # a long save: longer than --heartbeat-timeout, within its own
job.heartbeat(step=3)
print("done", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_long_section_is_not_a_hang_and_a_stuck_one_is_named_with_its_stack(tmp_path):
    code, out = rally(
        tmp_path, SECTIONS, "--startup-timeout", "1", "--heartbeat-timeout", "1", "--silence-timeout", "1.5",
        "--resource-interval", "0.2", "--max-restarts", "1",
    )  # fmt: skip
    assert code == 0, out
    assert "is hung: it hung in section 'checkpoint' for 3." in out and "(its timeout is 3 s)" in out, out
    assert "stuck_saving" in out
    hung = [e for e in read_events(tmp_path / "logs") if e["event"] == "worker_hung"]
    assert len(hung) == 1 and "section 'checkpoint'" in hung[0]["reason"]  # the second attempt's long save was fine
    assert "done" in out


@pytest.mark.timeout(60)
def test_startup_and_straggler_settings_are_checked(tmp_path):
    (tmp_path / "w.py").write_text("pass\n")
    for args, message in [
        (["--startup-timeout", "0"], "--startup-timeout 0.0: must be a positive number of seconds"),
        (["--straggler-factor", "1"], "--straggler-factor 1.0: must be a number above 1"),
        (["--straggler-window", "1"], "--straggler-window 1: must be at least 2 steps"),
        (["--metrics-port", "70000"], "--metrics-port 70000: must be a port number 0-65535"),
    ]:
        done = run_rally(["--standalone", *args, str(tmp_path / "w.py")], cwd=tmp_path, env=child_env(), timeout=30)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
