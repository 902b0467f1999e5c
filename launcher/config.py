"""Turn the raw option values into a validated launch: every user error becomes one clear line.

Raw values come from click (flags, then PET_*/RALLY_* environment variables, then the YAML
file, then defaults — click's own precedence, with the file as its `default_map`). This
module checks them and builds the agent's `JobSpec` and `RendezvousPlan`. Every check raises
`ConfigError` with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shutil
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from rally.rendezvous.plan import RendezvousPlan
from rally.agent.spec import JobSpec
from rally.rendezvous.etcd_client import DEFAULT_ETCD_PORT, Member
from rally.rendezvous.protocol import RendezvousSettings
from rally.launcher import validate
from rally.launcher.node_checks_options import node_check_fields
from rally.launcher.preload import parse_preload
from rally.launcher.validate import ConfigError
from rally.rendezvous.store import StoreEndpoint, is_local_host
from rally.rendezvous.token import TokenError, resolve_token

DEFAULT_C10D_PORT = 29400
# torchrun's etcd backends; rally runs both over the etcd v3 API (rendezvous/etcd_store.py).
ETCD_BACKENDS = ("etcd", "etcd-v2")
BACKENDS = ("c10d", "static", *ETCD_BACKENDS)
DEFAULT_MASTER_PORT = 29500

# torchrun's --rdzv-conf keys (c10d), plus rally's keep_alive_timeout.
RDZV_CONF_DEFAULTS: dict[str, Any] = {
    "join_timeout": 600.0,
    "last_call_timeout": 30.0,
    "close_timeout": 30.0,
    "read_timeout": 60.0,
    "timeout": None,  # torch's static and etcd backends: how long the job may take to form (= join_timeout)
    "is_host": None,
    "keep_alive_interval": 1.0,
    "keep_alive_max_attempt": 5,
    "keep_alive_timeout": None,  # default: interval x max_attempt
    "heartbeat_timeout": None,  # torch's name for the same idea; accepted as an alias
    "store_type": "tcp",
    "token": None,  # the job's secret (rendezvous/token.py); prefer token_file or RALLY_JOB_TOKEN
    "token_file": None,
}


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


# ------------------------------------------------------------------ individual values
def parse_nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` with 0 < MIN <= MAX."""
    parts = str(text).split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--nnodes '{text}' is not a number; write N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4") from None
    if len(numbers) == 1:
        numbers *= 2
    if len(numbers) != 2:
        raise ConfigError(f"--nnodes '{text}' has too many parts; write N or MIN:MAX, e.g. --nnodes 1:4")
    low, high = numbers
    if low < 1:
        raise ConfigError(f"--nnodes '{text}': the number of nodes must be at least 1")
    if low > high:
        raise ConfigError(f"--nnodes '{text}': MIN ({low}) is larger than MAX ({high}); write --nnodes {high}:{low}")
    return low, high


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch when the answer is obvious."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not shutil.which("nvidia-smi") and not Path("/dev/nvidiactl").exists():
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken driver means no usable GPU
        return 0


def parse_nproc(text: str) -> int:
    """int, `cpu`, `gpu` (error without GPUs), or `auto` (GPUs if any, else CPUs)."""
    value = str(text).strip().lower()
    if value == "cpu":
        return os.cpu_count() or 1
    if value == "gpu":
        count = visible_gpu_count()
        if count == 0:
            raise ConfigError("--nproc-per-node gpu: no GPU is visible on this node; use a number, 'cpu' or 'auto'")
        return count
    if value == "xpu":
        from rally.launcher.torchrun_extras import xpu_count

        count = xpu_count()
        if count == 0:
            raise ConfigError("--nproc-per-node xpu: no XPU is available on this node (torch.xpu); use a number, 'cpu' or 'auto'")
        return count
    if value == "auto":
        return visible_gpu_count() or os.cpu_count() or 1
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"--nproc-per-node '{text}' is not valid; use a number, 'auto', 'cpu', 'gpu' or 'xpu'") from None
    if number < 1:
        raise ConfigError(f"--nproc-per-node {number}: must be at least 1")
    return number


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]:port`."""
    text = str(text).strip()
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?", text) or re.fullmatch(r"([^:\[\]\s]+)(?::(\d+))?", text)
    if not match or not match.group(1):
        raise ConfigError(f"--rdzv-endpoint '{text}' is malformed; write HOST or HOST:PORT, e.g. node1:29400")
    port = int(match.group(2)) if match.group(2) else default_port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--rdzv-endpoint '{text}': port {port} is out of range (0-65535)")
    return match.group(1), port


def parse_etcd_endpoints(text: str) -> tuple[Member, ...]:
    """`HOST[:PORT][,HOST[:PORT]...]` (an `http://` scheme is allowed); default port 2379."""
    members = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower().startswith("https://"):
            raise ConfigError(f"--rdzv-endpoint '{item}': rally talks to etcd over plain HTTP only; give an http:// client endpoint")
        item = item[len("http://") :] if item.lower().startswith("http://") else item
        host, port = parse_endpoint(item.rstrip("/"), DEFAULT_ETCD_PORT)
        if port == 0:
            raise ConfigError(f"--rdzv-endpoint '{item}': port 0 is not an etcd endpoint; etcd listens on 2379 by default")
        members.append(Member(host, port))
    if not members:
        raise ConfigError(
            "--rdzv-backend etcd needs --rdzv-endpoint HOST[:PORT][,HOST[:PORT]...]: the etcd cluster's client endpoints (default port 2379)"
        )
    return tuple(dict.fromkeys(members))


def parse_rdzv_conf(text: str) -> dict[str, Any]:
    conf = dict(RDZV_CONF_DEFAULTS)
    if not text:
        return conf
    for item in str(text).split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ConfigError(f"--rdzv-conf '{item}' is not KEY=VALUE; e.g. --rdzv-conf join_timeout=60,last_call_timeout=5")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in RDZV_CONF_DEFAULTS:
            raise ConfigError(f"--rdzv-conf: unknown key '{key}'{suggest(key, RDZV_CONF_DEFAULTS)}")
        if key == "is_host":
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ConfigError(f"--rdzv-conf is_host={value}: use true or false")
            conf[key] = value.lower() in ("1", "true", "yes")
        elif key in ("token", "token_file"):
            if not value:
                raise ConfigError(f"--rdzv-conf {key}= is empty; give the job's secret (or a file holding it)")
            conf[key] = value
        elif key == "store_type":
            if value not in ("tcp", "file"):
                raise ConfigError(f"--rdzv-conf store_type={value}: use 'tcp' or 'file'")
            conf[key] = value
        else:
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"--rdzv-conf {key}={value}: expected a number of seconds") from None
            if number <= 0:
                raise ConfigError(f"--rdzv-conf {key}={value}: must be positive")
            conf[key] = number
    if conf["timeout"] is not None:  # torch's name for the same wait; two different values are a mistake
        if "join_timeout" in {i.split("=", 1)[0].strip() for i in str(text).split(",")} and conf["join_timeout"] != conf["timeout"]:
            raise ConfigError(
                f"--rdzv-conf: timeout={conf['timeout']:g} and join_timeout={conf['join_timeout']:g} name the same "
                "wait (how long the job may take to form); give one of them"
            )
        conf["join_timeout"] = conf["timeout"]
    return conf


def parse_std_map(text: str, flag: str, nproc: int) -> dict[int, int]:
    """torchrun's `-r/-t` value: `3` for every rank, or `0:1,1:2` per local rank."""
    text = str(text).strip() or "0"
    try:
        if ":" not in text:
            bits = int(text)
            if not 0 <= bits <= 3:
                raise ValueError
            return {rank: bits for rank in range(nproc)}
        result = {rank: 0 for rank in range(nproc)}
        for item in text.split(","):
            rank, bits = (int(x) for x in item.split(":"))
            if not 0 <= bits <= 3 or rank < 0:
                raise ValueError
            result[rank] = bits
        return result
    except ValueError:
        raise ConfigError(
            f"{flag} '{text}' is not valid; use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per rank like 0:3,1:1"
        ) from None


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not str(text).strip():
        return None
    try:
        ranks = frozenset(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--local-ranks-filter '{text}' must be comma-separated local ranks, e.g. 0,1") from None
    if any(r < 0 for r in ranks):
        raise ConfigError(f"--local-ranks-filter '{text}': ranks cannot be negative")
    return ranks


def _non_negative(value: Any, flag: str) -> float:
    number = float(value)
    if number < 0:
        raise ConfigError(f"{flag} {value}: cannot be negative")
    return number


def _positive_or_none(value: Any, flag: str) -> float | None:
    if value is None:
        return None
    number = float(value)
    if number <= 0:
        raise ConfigError(f"{flag} {value}: must be a positive number of seconds")
    return number


def parse_straggler_factor(value: Any) -> float:
    factor = float(value)
    if not math.isfinite(factor) or factor <= 1:
        raise ConfigError(f"--straggler-factor {value}: must be a number above 1 (1.5: 50% slower than the others' median)")
    return factor


def parse_straggler_window(value: Any) -> int:
    window = int(value)
    if window < 2:
        raise ConfigError(f"--straggler-window {value}: must be at least 2 steps")
    return window


def parse_metrics_port(value: Any) -> int | None:
    if value is None:
        return None
    port = int(value)
    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port {value}: must be a port number 0-65535 (0: any free port)")
    return port


def parse_signals(text: str, flag: str) -> tuple[int, ...]:
    from rally.agent.job import to_signal

    out = []
    for name in str(text).split(","):
        name = name.strip().upper()
        if not name:
            continue
        full = name if name.startswith("SIG") else "SIG" + name
        try:
            out.append(int(to_signal(name)))
        except (KeyError, ValueError):
            raise ConfigError(f"{flag}: unknown signal '{name}'{suggest(full, signal.Signals.__members__)}") from None
    return validate.handled_signals(tuple(out), flag)


# ------------------------------------------------------------------ YAML
def load_config_file(path: str, valid_keys: Iterable[str]) -> dict[str, Any]:
    """Read a YAML job file; keys are option names (dashes or underscores) plus script and args."""
    valid = set(valid_keys) | {"script", "args"}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--config {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    validate.check_config_values(path, {str(k).replace("-", "_"): v for k, v in data.items()})
    result: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in valid:
            raise ConfigError(f"--config {path}: unknown key '{raw_key}'{suggest(key, valid)}")
        if key == "args":
            if not isinstance(value, list):
                raise ConfigError(f"--config {path}: 'args' must be a list, e.g. args: [--lr, '0.1']")
            value = [str(v) for v in value]
        result[key] = value
    return result


# ------------------------------------------------------------------ the whole launch
@dataclass
class Launch:
    """A validated launch: what to run and how to find the other nodes."""

    spec: JobSpec
    plan: RendezvousPlan
    notes: list[str]


def build_launch(o: Mapping[str, Any], script: str | None, script_args: list[str]) -> Launch:
    """Check every option together and build the agent's inputs."""
    notes: list[str] = []
    if not script:
        raise ConfigError("no training script given; usage: rally [OPTIONS] SCRIPT [ARGS]... (see rally --help)")
    if o["module"] and o["no_python"]:
        raise ConfigError("-m/--module and --no-python cannot be used together")
    if o["run_path"] and (o["module"] or o["no_python"]):
        raise ConfigError("--run-path cannot be combined with -m/--module or --no-python")
    validate.check_entry_point(o, script)
    if o["no_python"]:
        if not (shutil.which(script) or Path(script).exists()):
            raise ConfigError(f"--no-python: '{script}' is not an executable on PATH or a file")
    elif not o["module"] and not Path(script).is_file():
        raise ConfigError(f"training script '{script}' does not exist (working directory: {os.getcwd()})")

    min_nodes, max_nodes = parse_nnodes(o["nnodes"])
    nproc = parse_nproc(o["nproc_per_node"])
    validate.check_counts(nproc, max_nodes, o["node_rank"])
    validate.check_options(o)
    max_restarts = int(o["max_restarts"])
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: cannot be negative")
    for name in ("monitor_interval", "shutdown_timeout"):
        if o[name] is not None and float(o[name]) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {o[name]}: cannot be negative")
    conf = parse_rdzv_conf(o["rdzv_conf"])
    validate.check_rdzv_conf(conf)
    backend = str(o["rdzv_backend"]).lower()
    if backend not in BACKENDS:
        raise ConfigError(f"--rdzv-backend '{backend}' is not supported; use c10d, etcd (elastic) or static{suggest(backend, BACKENDS)}")
    endpoint_text, run_id = o["rdzv_endpoint"], str(o["rdzv_id"])
    node_rank = o["node_rank"]
    if node_rank is not None and int(node_rank) < 0:
        raise ConfigError(f"--node-rank {node_rank}: cannot be negative")

    if o["standalone"]:
        backend, endpoint_text, min_nodes, max_nodes = "c10d", "localhost:0", 1, 1
        run_id = str(uuid.uuid4())
    elif backend == "static" and not endpoint_text and o["master_port"] is None and max_nodes == 1:
        # torchrun 2.13 does the same: a single-node static job needs no fixed port.
        backend, endpoint_text, run_id = "c10d", "localhost:0", str(uuid.uuid4()) if run_id == "none" else run_id

    preferred_rank = int(node_rank) if node_rank is not None else (0 if backend == "static" else o.get("_preferred_rank"))
    if backend == "static":
        if min_nodes != max_nodes:
            raise ConfigError("--rdzv-backend static needs a fixed --nnodes N (MIN:MAX needs c10d)")
        node_rank = 0 if node_rank is None else int(node_rank)  # torchrun's default too
        if node_rank >= max_nodes:
            raise ConfigError(f"--node-rank {node_rank} is not below --nnodes {max_nodes}")
        # As torchrun: --rdzv-endpoint, when given, is the master address and port.
        host, port = parse_endpoint(endpoint_text, -1) if endpoint_text else (o["master_addr"] or "127.0.0.1", -1)
        if port < 0:
            port = int(o["master_port"] if o["master_port"] is not None else DEFAULT_MASTER_PORT)
        validate.port(port, "--master-port")
        validate.resolvable(host, "--rdzv-endpoint" if endpoint_text else "--master-addr")
        endpoint = StoreEndpoint(host, port, host_here=node_rank == 0)
    elif backend in ETCD_BACKENDS:
        if conf["store_type"] != "tcp":
            raise ConfigError(f"--rdzv-conf store_type={conf['store_type']} does not apply to --rdzv-backend {backend}; remove it")
        endpoint = StoreEndpoint("", 0, host_here=False, etcd=parse_etcd_endpoints(endpoint_text))
        if run_id == "none":
            raise ConfigError(
                f"--rdzv-backend {backend} needs --rdzv-id ID, one per job: etcd keeps a job's keys after it ends"
            )
    else:
        if not endpoint_text:
            if max_nodes > 1:
                raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST[:PORT] (or run under SLURM, or use --rdzv-backend static)")
            endpoint_text = "localhost:0"
        if conf["store_type"] == "file":
            validate.file_store_path(str(endpoint_text))
            endpoint = StoreEndpoint("", 0, host_here=False, file_path=str(endpoint_text))
        else:
            host, port = parse_endpoint(endpoint_text, DEFAULT_C10D_PORT)
            validate.resolvable(host, "--rdzv-endpoint")
            host_here = conf["is_host"] if conf["is_host"] is not None else is_local_host(host)
            if port == 0 and not host_here:
                raise ConfigError(f"--rdzv-endpoint {endpoint_text}: port 0 only works on the store's own host")
            endpoint = StoreEndpoint(host, port, host_here=host_here)

    keep_alive_timeout = conf["keep_alive_timeout"] or conf["heartbeat_timeout"] or (
        conf["keep_alive_interval"] * conf["keep_alive_max_attempt"]
    )
    settings = RendezvousSettings(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        join_timeout=conf["join_timeout"],
        last_call_timeout=conf["last_call_timeout"],
        keep_alive_interval=conf["keep_alive_interval"],
        keep_alive_timeout=keep_alive_timeout,
        close_timeout=conf["close_timeout"],
    )
    try:
        token = resolve_token(conf["token"], conf["token_file"], bool(o["standalone"]), o.get("_slurm_job_id"))
    except TokenError as exc:
        raise ConfigError(str(exc)) from None
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        notes.append(
            f"setting OMP_NUM_THREADS=1 for each of the {nproc} workers (it was unset); "
            "set it yourself to tune CPU threads"
        )
    from rally.launcher.torchrun_extras import ExtrasError, extras

    try:
        extra_fields, extra_notes = extras(o, nproc, visible_gpu_count())
    except ExtrasError as exc:
        raise ConfigError(str(exc)) from None
    notes += extra_notes
    shutdown_timeout = o["shutdown_timeout"]
    if shutdown_timeout is None:
        shutdown_timeout = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    # Node rank 0 of a static job is, by definition, reachable at the master address.
    static_master = endpoint.host if backend == "static" and endpoint.host_here else None
    local_addr = o["local_addr"] or static_master or socket.getfqdn()
    spec = JobSpec(
        entrypoint=script,
        args=tuple(script_args),
        nproc_per_node=nproc,
        run_id=run_id,
        role=o["role"],
        max_restarts=max_restarts,
        module=bool(o["module"]),
        no_python=bool(o["no_python"]),
        run_path=bool(o["run_path"]),
        log_dir=o["log_dir"],
        redirects=parse_std_map(o["redirects"], "--redirects", nproc),
        tee=parse_std_map(o["tee"], "--tee", nproc),
        local_ranks_filter=parse_ranks_filter(o["local_ranks_filter"]),
        prefix_output=not o["no_prefix"],
        quiet=bool(o["quiet"]),
        shutdown_timeout=float(shutdown_timeout),
        signals_to_handle=parse_signals(o["signals_to_handle"], "--signals-to-handle"),
        preemption_signals=parse_signals(o["preemption_signals"], "--preemption-signals"),
        preemption_grace=_non_negative(o["preemption_grace"], "--preemption-grace"),
        requeue=bool(o["requeue"]),
        **node_check_fields(o, max_nodes),  # --heartbeat-timeout, quarantine, pre-flight (launcher/node_checks_options.py)
        silence_timeout=_positive_or_none(o["silence_timeout"], "--silence-timeout"),
        resource_interval=_positive_or_none(o["resource_interval"], "--resource-interval") or 5.0,
        startup_timeout=_positive_or_none(o.get("startup_timeout"), "--startup-timeout"),
        straggler_factor=parse_straggler_factor(o.get("straggler_factor", 1.5)),
        straggler_window=parse_straggler_window(o.get("straggler_window", 10)),
        metrics_port=parse_metrics_port(o.get("metrics_port")),
        checkpoint_dir=str(Path(o["checkpoint_dir"]).resolve()) if o.get("checkpoint_dir") else None,
        crash_loop_limit=int(_non_negative(o["crash_loop_limit"], "--crash-loop-limit")),
        python_exec=os.environ.get("PYTHON_EXEC", sys.executable),
        **extra_fields,
        preload=parse_preload(o.get("preload"), bool(o.get("no_preload")), bool(o["no_python"]), script, bool(o["module"])),
    )
    plan = RendezvousPlan(
        endpoint=endpoint,
        settings=settings,
        local_addr=local_addr,
        preferred_rank=preferred_rank,
        connect_timeout=conf["join_timeout"],
        read_timeout=conf["read_timeout"],
        token=token,
        workers_use_rendezvous_store=backend == "static" and endpoint.file_path is None,
    )
    return Launch(spec, plan, notes)
