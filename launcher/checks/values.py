"""Parsers of option values written as text (as typed, or as YAML gave it) -> the agent's types,
for the option checks (launcher/checks/option_checks.py) and `rally status` (--rdzv-conf).

Every failure is `ConfigError` with one line that says what is wrong and how to fix it.
"""

from __future__ import annotations

import difflib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rally.launcher.checks.validate import ConfigError
from rally.rendezvous.etcd.conf import ETCD_CONF_KEYS
from rally.rendezvous.plan import READ_TIMEOUT_SECONDS
from rally.rendezvous.protocol import RendezvousSettings

# torch's default for keep_alive_max_attempt; with keep_alive_interval it makes the default keep_alive_timeout.
KEEP_ALIVE_MAX_ATTEMPT = 5

# torchrun's --rdzv-conf keys (c10d), plus rally's keep_alive_timeout.
RDZV_CONF_DEFAULTS: dict[str, Any] = {
    "join_timeout": RendezvousSettings.join_timeout,
    "last_call_timeout": RendezvousSettings.last_call_timeout,
    "close_timeout": RendezvousSettings.close_timeout,
    "read_timeout": READ_TIMEOUT_SECONDS,
    "timeout": None,  # torch's static and etcd backends: how long the job may take to form (= join_timeout)
    "is_host": None,
    "keep_alive_interval": RendezvousSettings.keep_alive_interval,
    "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPT,
    "keep_alive_timeout": None,  # default: interval x max_attempt
    "heartbeat_timeout": None,  # torch's name for the same idea; accepted as an alias
    "store_type": "tcp",
    "token": None,  # the job's secret (rendezvous/base/token.py); prefer token_file or RALLY_JOB_TOKEN
    "token_file": None,
    **{key: None for key in ETCD_CONF_KEYS},  # TLS and etcd users (rendezvous/etcd/conf.py)
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
        raise ConfigError(
            f"--nnodes '{text}' is not a number; write N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4"
        ) from None
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


def gpu_driver_present() -> bool:
    """A GPU driver is installed (NVIDIA's /dev/nvidiactl or nvidia-smi, AMD's /dev/kfd). Without
    one torch finds no GPU, whatever CUDA_VISIBLE_DEVICES lists: saying so costs no torch import."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists() or shutil.which("nvidia-smi") is not None


def visible_gpu_count() -> int:
    """GPUs this process may use, counted as torchrun counts them (torch.cuda.device_count() when
    torch.cuda.is_available()): only devices that exist, which CUDA_VISIBLE_DEVICES narrows but
    never adds to. torch is imported only on a node with a GPU driver."""
    if not gpu_driver_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver means no usable GPU
        return 0


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: taskset, cgroup cpusets), as torch's
    cpu_count, which torchrun's `cpu` and `auto` use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def accelerator_count() -> int:
    """`auto`'s devices, as torch.accelerator counts them: CUDA (or ROCm) GPUs, else XPUs (asked of
    torch only where a GPU's device files are), else none."""
    gpus = visible_gpu_count()
    if gpus or not Path("/dev/dri").exists():
        return gpus
    from rally.launcher.checks.worker_flags import xpu_count

    return xpu_count()


def parse_nproc(text: str) -> int:
    """int, `cpu`, `gpu` (error without GPUs), `xpu` (error without XPUs), or `auto` (the
    accelerators if any, else CPUs): torchrun's determine_local_world_size."""
    value = str(text).strip().lower()
    if value == "cpu":
        return usable_cpus()
    if value == "gpu":
        count = visible_gpu_count()
        if count == 0:
            raise ConfigError(
                "--nproc-per-node gpu: Cuda is not available (torch finds no GPU on this node, whatever "
                "CUDA_VISIBLE_DEVICES lists); use a number, 'cpu' or 'auto'"
            )
        return count
    if value == "xpu":
        from rally.launcher.checks.worker_flags import xpu_count

        count = xpu_count()
        if count == 0:
            raise ConfigError(
                "--nproc-per-node xpu: no XPU is available on this node (torch.xpu); use a number, 'cpu' or 'auto'"
            )
        return count
    if value == "auto":
        return accelerator_count() or usable_cpus()
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node '{text}' is not valid; use a number, 'auto', 'cpu', 'gpu' or 'xpu'"
        ) from None
    if number < 1:
        raise ConfigError(f"--nproc-per-node {number}: must be at least 1")
    return number


def unquoted(text: str) -> str:
    """`text` stripped of blanks and of quote characters at either end."""
    return text.strip().strip("'\"").strip()


def parse_rdzv_conf(text: str, warnings: list[str] | None = None) -> dict[str, Any]:
    """torchrun's `K=V,...` (torch's _parse_rendezvous_config splits it the same way), checked.

    Quote characters at either end of a key or a value are taken off, and so are quotes around
    the whole value (its first key and last value then carry them): shells, YAML-to-argv tools
    and PyTorch's own launcher test pass `'join_timeout=5,timeout=5'` with the quotes in it.
    torchrun keeps them, so its backend then sees keys it does not know, which it ignores; rally
    uses the keys as written. A key rally does not know is ignored as torchrun ignores it, with
    one line in `warnings` naming the closest known key (a typo then costs a warning, not the
    job); a value a known key cannot take is an error."""
    conf = dict(RDZV_CONF_DEFAULTS)
    text = str(text or "")
    given: set[str] = set()
    for item in text.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ConfigError(
                f"--rdzv-conf '{item}' is not KEY=VALUE; e.g. --rdzv-conf join_timeout=60,last_call_timeout=5"
            )
        key, value = (unquoted(s) for s in item.split("=", 1))
        if key not in RDZV_CONF_DEFAULTS:
            if warnings is not None:
                closest = suggest(key, RDZV_CONF_DEFAULTS)
                warnings.append(f"--rdzv-conf: unknown key '{key}', ignored as torchrun ignores it{closest}")
            continue
        given.add(key)
        if key == "is_host":
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ConfigError(f"--rdzv-conf is_host={value}: use true or false")
            conf[key] = value.lower() in ("1", "true", "yes")
        elif key in ("token", "token_file", *ETCD_CONF_KEYS):
            if not value:
                what = (
                    "the job's secret (or a file holding it)"
                    if key.startswith("token")
                    else "a value, or leave the key out"
                )
                raise ConfigError(f"--rdzv-conf {key}= is empty; give {what}")
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
        if "join_timeout" in given and conf["join_timeout"] != conf["timeout"]:
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
