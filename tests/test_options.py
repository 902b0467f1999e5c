"""The options model (launcher/options.py): one declaration per option, from which the flags,
the environment variables, the YAML keys and `rally.launch`'s keyword arguments come; YAML
values of the wrong type and mistyped flags are one line each, as a newcomer expects."""

from __future__ import annotations

import datetime
import re
import sys
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from support.helpers import clean_env, run_rally, write_probe
from test_bad_input import assert_one_line_only, rally_fails


# ------------------------------------------------------------------ YAML types
def fails_with_file(tmp_path: Path, content: str) -> str:
    config = tmp_path / "job.yaml"
    config.write_text(content + "script: train.py\n")
    return assert_one_line_only(rally_fails(tmp_path, "--config", str(config)))


@pytest.mark.timeout(60)
def test_a_flag_given_a_number_in_yaml_is_one_line_naming_file_line_and_key(tmp_path: Path) -> None:
    line = fails_with_file(tmp_path, "nnodes: 1\nstandalone: 1\n")
    assert f"{tmp_path / 'job.yaml'}, line 2" in line and "'standalone'" in line and "true" in line, line


@pytest.mark.timeout(60)
def test_a_fractional_count_in_yaml_is_refused_not_rounded_down(tmp_path: Path) -> None:
    line = fails_with_file(tmp_path, "max-restarts: 2.9\n")
    assert "job.yaml, line 1" in line and "'max-restarts'" in line and "2.9" in line, line


@pytest.mark.timeout(60)
def test_a_bad_value_from_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    line = fails_with_file(tmp_path, "role: trainer\nnproc-per-node: two\n")
    assert "job.yaml, line 2" in line and "nproc-per-node" in line and "'two'" in line, line


@pytest.mark.timeout(60)
def test_a_key_given_in_both_spellings_is_refused_naming_both_lines(tmp_path: Path) -> None:
    line = fails_with_file(tmp_path, "nproc-per-node: 2\nmax_restarts: 1\nnproc_per_node: 3\n")
    assert "job.yaml, line 3" in line and "line 1" in line and "nproc-per-node" in line and "nproc_per_node" in line, (
        line
    )


@pytest.mark.timeout(90)
def test_a_bad_yaml_value_overridden_by_a_flag_is_not_blamed_on_the_file(tmp_path: Path) -> None:
    """The flag wins (click's precedence); the file's line is named only for values it gave."""
    config = tmp_path / "job.yaml"
    config.write_text("nproc-per-node: 0\nscript: train.py\n")
    line = assert_one_line_only(rally_fails(tmp_path, "--config", str(config), "--nproc-per-node", "-3"))
    assert "job.yaml" not in line and "-3" in line, line


@pytest.mark.same_under_load  # a check of the config file, before anything starts
@pytest.mark.timeout(60)
def test_mistakes_in_options_checked_together_are_told_in_one_run_each_naming_its_own_line(tmp_path: Path) -> None:
    """--redirects needs --nproc-per-node, --heartbeat-timeout auto reads --timeout-samples, --preflight
    reads --no-preflight: checked with every other option, each mistake at the line of its value."""
    config = tmp_path / "job.yaml"
    config.write_text(
        "redirects: 9\nheartbeat-timeout: auto\ntimeout-samples: 1\npreflight: true\nno-preflight: true\n"
        "quarantine-after: -3\nscript: train.py\n"
    )
    result = rally_fails(tmp_path, "--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.describe()
    first, *others = result.stderr_lines
    assert "(4 mistakes, the others below)" in first, result.describe()
    where = [line.removeprefix("rally: error: ").split(": ")[0].strip() for line in [first, *others]]
    assert where == [
        f"--config {config}, line 1, 'redirects'",
        f"--config {config}, line 3, 'timeout-samples'",
        f"--config {config}, line 6, 'quarantine-after'",
        f"--config {config}, line 4, 'preflight'",
    ], result.describe()


# ------------------------------------------------------------------ flags as typed
@pytest.mark.timeout(120)
def test_an_unambiguous_prefix_of_a_flag_runs_as_torchrun_accepts_it(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "hello.py", "import os\nprint('hello from', os.environ['LOCAL_RANK'])\n")
    result = run_rally(
        ["--standalone", "--no-prel", "--nproc-per-nod", "2", "--max-restart=1", str(probe)],
        cwd=tmp_path,
        env=clean_env(),
        timeout=90,
    )
    assert result.returncode == 0, result.describe()
    assert sorted(re.findall(r"hello from (\d)", result.stdout)) == ["0", "1"], result.describe()


@pytest.mark.timeout(60)
def test_the_scripts_own_arguments_are_never_expanded(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "args.py", "import sys\nprint('ARGS', sys.argv[1:])\n")
    result = run_rally(
        ["--standalone", "--no-preload", str(probe), "--nproc-per-nod", "7", "--std"],
        cwd=tmp_path,
        env=clean_env(),
        timeout=90,
    )
    assert result.returncode == 0, result.describe()
    assert "ARGS ['--nproc-per-nod', '7', '--std']" in result.stdout, result.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("typed", "suggested"),
    [
        pytest.param("--nprocs-per-node", "--nproc-per-node", id="extra-letter"),
        pytest.param("--rdzv-endpont", "--rdzv-endpoint", id="missing-letter"),
        pytest.param("--max-restrats", "--max-restarts", id="swapped-letters"),
        pytest.param("--nproc_per_nodes", "--nproc_per_node", id="underscored"),
    ],
)
def test_a_misspelled_flag_suggests_the_closest_one(tmp_path: Path, typed: str, suggested: str) -> None:
    line = assert_one_line_only(rally_fails(tmp_path, typed, "2", "train.py"))
    assert line == f"rally: error: no such option {typed}; did you mean {suggested}?", line


@pytest.mark.timeout(60)
def test_an_ambiguous_prefix_names_every_flag_it_could_be(tmp_path: Path) -> None:
    line = assert_one_line_only(rally_fails(tmp_path, "--no-p", "train.py"))
    assert "--no-p is ambiguous" in line, line
    for flag in ("--no-prefix", "--no-preload", "--no-python"):
        assert flag in line, line


# ------------------------------------------------------------------ one model, every surface
@pytest.mark.timeout(30)
def test_every_option_of_the_model_is_a_flag_in_both_spellings_with_its_variables() -> None:
    from rally.launcher import options
    from rally.launcher.cli import run_command

    params = {p.name: p for p in run_command.params}
    for name in options.names():
        param = params[name]
        assert f"--{name.replace('_', '-')}" in param.opts and f"--{name}" in param.opts, param.opts
        assert param.envvar == [f"PET_{name.upper()}", f"RALLY_{name.upper()}"]
        assert param.default == options.Options.__dataclass_fields__[name].default


@pytest.mark.timeout(30)
def test_defaults_the_agent_also_needs_come_from_the_agents_own_types() -> None:
    from rally.agent.base.spec import DEFAULT_FACTOR, JobSpec
    from rally.agent.observe.health import HealthSettings
    from rally.launcher.checks.values import RDZV_CONF_DEFAULTS
    from rally.launcher.options import Options
    from rally.rendezvous.protocol import RendezvousSettings

    o = Options()
    assert o.straggler_factor == JobSpec.straggler_factor == DEFAULT_FACTOR
    assert o.resource_interval == JobSpec.resource_interval == HealthSettings.resource_interval
    assert (o.max_restarts, o.crash_loop_limit, o.preemption_grace) == (
        JobSpec.max_restarts,
        JobSpec.crash_loop_limit,
        JobSpec.preemption_grace,
    )
    assert RDZV_CONF_DEFAULTS["join_timeout"] == RendezvousSettings.join_timeout


@pytest.mark.timeout(30)
def test_launch_takes_the_models_names_and_refuses_an_unknown_one_with_the_nearest() -> None:
    import rally
    from rally.launcher.options import Options

    assert Options.of({"nproc-per-node": 2, "max_restarts": 1}) == Options(nproc_per_node=2, max_restarts=1)
    with pytest.raises(
        rally.LaunchError, match=r"unknown option 'nproc_per_nod'; did you mean 'nproc_per_node'\?"
    ) as caught:
        rally.launch({"nproc_per_nod": 2}, print)
    assert caught.value.exit_code == 2


@pytest.mark.timeout(30)
def test_a_launch_value_of_the_wrong_type_is_one_line_not_a_traceback() -> None:
    from rally.launcher.config import ConfigError
    from rally.launcher.options import Options

    with pytest.raises(ConfigError, match="--max-restarts 'three'"):
        Options(max_restarts="three").parse()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


# ------------------------------------------------------------------ SLURM fills in, as one object
@pytest.mark.timeout(30)
def test_slurm_fills_only_what_the_user_left_unset() -> None:
    from rally.launcher.options import Options
    from rally.rendezvous.backends import HostPort
    from test_slurm_env import SRUN_TASK0, job

    slurm = job(SRUN_TASK0)
    changes, taken = slurm.overrides(Options(), given=set())
    assert changes["rdzv_backend"] == "c10d" and changes["rdzv_endpoint"] == HostPort(
        slurm.store_host, slurm.store_port
    )
    assert changes["nnodes"] == str(slurm.nnodes) and changes["rdzv_id"] == slurm.run_id
    assert changes["nproc_per_node"] == str(slurm.nproc_auto())
    assert set(taken) == {"nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "nproc_per_node"}

    mine = Options(rdzv_backend="etcd", rdzv_endpoint="e1:2379", nnodes="3", rdzv_id="job7", nproc_per_node="2")
    changes, taken = slurm.overrides(
        mine, given={"rdzv_backend", "rdzv_endpoint", "nnodes", "rdzv_id", "nproc_per_node"}
    )
    assert changes == {} and taken == []

    changes, _ = slurm.overrides(Options(rdzv_backend="etcd"), given={"rdzv_backend"})
    assert "rdzv_endpoint" not in changes, "an explicitly chosen etcd keeps its own endpoint"
    changes, _ = slurm.overrides(Options(standalone=True), given={"standalone"})
    assert "rdzv_endpoint" not in changes


@pytest.mark.same_under_load  # declarations read at import, no process
@pytest.mark.timeout(30)
def test_every_option_lands_in_the_agents_inputs_or_is_read_by_another_options_check() -> None:
    """One path into JobSpec: each option fills fields of JobSpec or RendezvousOptions, or names
    the option whose check reads it; every such field is filled by exactly one option."""
    import dataclasses

    from rally.agent.base.spec import JobSpec
    from rally.launcher import options

    filled: dict[tuple[type, str], str] = {}
    for name in options.names():
        about = options.info(options.Options.__dataclass_fields__[name])
        assert bool(about.fills) != bool(about.read_by), f"{name}: fills {about.fills}, read by {about.read_by}"
        if about.read_by:
            assert about.read_by in (*options.names(), options.TORCHRUN_ONLY, options.THE_COMMAND), name
        for target in options.targets(name):
            assert target not in filled, f"{name} and {filled.get(target)} both fill {target}"
            filled[target] = name
    wanted = {(JobSpec, f.name) for f in dataclasses.fields(JobSpec) if f.name not in options.NOT_AN_OPTION}
    wanted |= {(options.RendezvousOptions, f.name) for f in dataclasses.fields(options.RendezvousOptions)}
    assert set(filled) == wanted, set(filled) ^ wanted


@pytest.mark.same_under_load  # a parse, no process
@pytest.mark.timeout(30)
def test_parsing_fills_the_agents_job_from_the_options_alone(tmp_path: Path, monkeypatch) -> None:
    from rally.agent.base.spec import LearningSettings
    from rally.launcher.options import Options

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    script = write_probe(tmp_path / "train.py", "print('hi')\n")
    parsed = Options(
        nnodes="2",
        nproc_per_node="2",
        rdzv_id="job7",
        tee="1",
        no_prefix=True,
        heartbeat_timeout="auto",
        timeout_samples=3,
        duplicate_stdout_filters="a,,b,c",
    ).parse(str(script), ["--lr", "1"])
    spec = parsed.spec
    assert (spec.entrypoint, spec.args, spec.run_id, spec.nproc_per_node) == (str(script), ("--lr", "1"), "job7", 2)
    assert spec.tee == {0: 1, 1: 1} and spec.prefix_output is False and spec.preflight is True
    assert spec.heartbeat_timeout is None and spec.timeout_learning == LearningSettings(samples=3)
    assert spec.duplicate_stdout_filters == ("a,b", "c") and spec.preload is None  # a stdlib-only script
    assert parsed.rendezvous.nnodes == (2, 2) and parsed.rendezvous.rdzv_conf["store_type"] == "tcp"


class _Plain:
    """A class defined in Python (the interpreter quotes its name without a module)."""


# What rally.launch or a YAML file can hand a check: text, numbers, bytes, dates, containers, objects.
RAW_VALUES = ["7", " 2 ", "2.5", "x", "", 3, 2.5, float("nan"), True, None, b"4", bytearray(b"5"), memoryview(b"6")]
RAW_VALUES += [[1], {"a": 1}, (1,), 1j, datetime.date(2024, 1, 1), Path("/x"), _Plain(), Decimal("2.5"), Fraction(5, 2)]


def outcome(convert: Callable[[object], object], value: object) -> str:
    try:
        return repr(convert(value))
    except (TypeError, ValueError, OverflowError) as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.same_under_load  # conversions in this process
@pytest.mark.timeout(30)
def test_a_raw_value_is_read_as_int_and_float_read_it_and_refused_in_their_words() -> None:
    """The checks take a raw value as `object` and narrow it (validate.whole_number, real_number):
    what int() and float() read gives their number, anything else their own TypeError, which
    Options.parse shows as `--flag value: ...` (so a message from rally.launch or a YAML date is
    the one it was when the checks called int() and float() on an untyped value)."""
    from rally.launcher.checks import validate
    from rally.launcher.checks.validate import ConfigError
    from rally.launcher.options import Options

    for value in RAW_VALUES:
        assert outcome(validate.whole_number, value) == outcome(int, value), value
        assert outcome(validate.real_number, value) == outcome(float, value), value
    with pytest.raises(ConfigError, match=r"^--max-restarts \[1\]: int\(\) argument must be .*not 'list'$"):
        Options(max_restarts=[1]).parse("train.py", act=False)


@pytest.mark.timeout(30)
def test_launch_reads_the_same_variables_as_the_command_converted_as_click_converts_them() -> None:
    from rally.launcher.config import ConfigError
    from rally.launcher.options import from_environment

    environ = {
        "PET_NPROC_PER_NODE": "4",
        "RALLY_NO_PRELOAD": "1",
        "RALLY_MAX_RESTARTS": "2",
        "PET_STANDALONE": "",
        "RALLY_STANDALONE": "yes",
    }
    assert from_environment(environ) == {
        "nproc_per_node": "4",
        "no_preload": True,
        "max_restarts": 2,
        "standalone": True,
    }
    with pytest.raises(ConfigError, match="RALLY_MAX_RESTARTS='x'"):
        from_environment({"RALLY_MAX_RESTARTS": "x"})


@pytest.mark.timeout(30)
@pytest.mark.same_under_load
def test_an_infinite_count_from_rally_launch_is_one_line_not_an_overflow_traceback() -> None:
    """float('inf') for a whole-number option (only rally.launch can pass it: click refuses it
    first) is a mistake told in one line, as any other value of the wrong kind."""
    from rally.launcher.config import ConfigError
    from rally.launcher.options import Options

    with pytest.raises(ConfigError, match=r"^--max-restarts inf: cannot convert float infinity to integer$"):
        Options(max_restarts=float("inf")).parse("train.py", act=False)


# ------------------------------------------------------------------ --rdzv-conf as torchrun takes it
@pytest.mark.timeout(90)
def test_an_unknown_rdzv_conf_key_is_one_warning_with_the_closest_key_and_the_job_runs(tmp_path: Path) -> None:
    """torchrun ignores keys its backend does not read; a command that runs under torchrun runs
    under rally, and the typo is named once with the key it is closest to."""
    write_probe(tmp_path / "train.py", "print('the job ran')")
    result = run_rally(["--standalone", "--rdzv-conf", "join_timout=60,read_timeout=30", "train.py"], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    assert "[0] the job ran" in result.stdout.splitlines(), result.describe()
    warnings = [line for line in result.stderr_lines if "rally: warning:" in line and "--rdzv-conf" in line]
    assert len(warnings) == 1, result.describe()
    assert "'join_timout'" in warnings[0] and "did you mean 'join_timeout'?" in warnings[0], warnings[0]


@pytest.mark.timeout(90)
def test_quotes_around_the_rdzv_conf_value_or_a_key_are_taken_off(tmp_path: Path) -> None:
    """`--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'` with the quotes inside the
    value (PyTorch's own launcher test passes it so; shells and YAML-to-argv tools do) runs, with
    the values as written, and so does a quoted key or value."""
    from rally.launcher.options import Options

    for text in ("'join_timeout=5,last_call_timeout=1,timeout=5'", '"join_timeout"=5,last_call_timeout="1"'):
        conf = Options(rdzv_conf=text).parse("train.py").rendezvous.rdzv_conf
        assert (conf["join_timeout"], conf["last_call_timeout"]) == (5, 1), (text, conf)
    write_probe(tmp_path / "train.py", "print('the job ran')")
    quoted = "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"
    result = run_rally(["--standalone", quoted, "train.py"], cwd=tmp_path)
    assert result.returncode == 0 and "[0] the job ran" in result.stdout, result.describe()
    assert "warning" not in result.stderr, result.describe()


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
@pytest.mark.parametrize("conf", ["join_timeout=soon", "'last_call_timeout=-1'", "is_host=maybe", "join_timeout"])
def test_a_bad_value_of_a_known_rdzv_conf_key_is_still_one_line_and_exit_2(tmp_path: Path, conf: str) -> None:
    line = assert_one_line_only(rally_fails(tmp_path, "--rdzv-conf", conf, "train.py"))
    assert "--rdzv-conf" in line and conf.strip("'").split("=")[0] in line, line
