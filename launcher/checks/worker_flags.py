"""The flags that shape each worker (its local rank and devices, copies of its output, where its
logs go, its CPUs), torchrun 2.13's newer ones: what their checks (launcher/checks/option_checks.py) need.

* `--virtual-local-rank`: every worker sees LOCAL_RANK=0 and one GPU (CUDA_VISIBLE_DEVICES
  narrowed to its own), as torchrun's `_set_local_rank_env`.
* `--duplicate-stdout-filters` / `--duplicate-stderr-filters`: lines containing any of the
  substrings are copied to `attempt_<n>/filtered_stdout.log` / `filtered_stderr.log`; `,,`
  is a literal comma (torchrun's `comma_separated_list`).
* `--logs-specs NAME`: torchrun loads a `LogsSpecs` class from the `torchrun.logs_specs`
  entry-point group; rally checks here that it exists (a typo is an error) and the agent
  writes where the class says, every attempt (agent/rounds/logs_specs.py).
* `--event-log-handler`: accepted; rally writes its events to `events.jsonl` in the run
  directory whatever the handler, and says so when one other than `null` is named.
* `--numa-binding MODE`: torch's modes; each worker is bound to the CPUs torch picks near its
  GPU (agent/base/numa.py). On a node without GPUs there is nothing to bind near; one line says so.
* `--nproc-per-node xpu`: one worker per Intel XPU (torch.xpu), an error when there is none.
"""

from __future__ import annotations

import os

from rally.launcher.checks.validate import ConfigError

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def comma_separated_list(value: str | None) -> tuple[str, ...]:
    """torchrun's parsing: split on ',', where ',,' stands for a literal comma."""
    if not value:
        return ()
    placeholder = "\0"
    return tuple(item.replace(placeholder, ",") for item in str(value).replace(",,", placeholder).split(","))


def xpu_count() -> int:
    try:
        import torch

        return torch.xpu.device_count() if torch.xpu.is_available() else 0
    except Exception:  # a torch without XPU support means no XPU
        return 0


def check_virtual_local_rank(enabled: bool, nproc: int) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if enabled and visible is not None and nproc > len(visible.split(",")):
        raise ConfigError(
            f"--virtual-local-rank: {nproc} workers but CUDA_VISIBLE_DEVICES={visible} lists fewer GPUs; "
            "lower --nproc-per-node or widen CUDA_VISIBLE_DEVICES"
        )


def logs_specs_note(name: str | None) -> str | None:
    if not name:
        return None
    from importlib.metadata import entry_points

    # wait: not_a_wait: entry points, not select(2)
    found = entry_points(group="torchrun.logs_specs").select(name=name)
    if not found:
        raise ConfigError(
            f"--logs-specs '{name}': no entry point of that name in the 'torchrun.logs_specs' group; install "
            "the package that provides it, or drop the flag"
        )
    return None  # applied every attempt: agent/rounds/logs_specs.py


def event_log_note(handler: str | None) -> str | None:
    if handler and handler != "null":
        return f"--event-log-handler {handler}: rally records its events in events.jsonl in the run directory instead"
    return None


def numa_note(mode: str | None, gpus: int) -> str | None:
    if mode is None:
        return None
    if mode not in NUMA_MODES:
        raise ConfigError(f"--numa-binding '{mode}' is not one of {', '.join(NUMA_MODES)}")
    if gpus == 0:
        return f"--numa-binding {mode}: no GPU on this node to bind workers near; workers keep every CPU"
    return None  # applied per worker: agent/base/numa.py


def check_numa_binding(mode: str, nproc: int) -> None:
    """Work out every worker's CPUs now, so a node where torch cannot is one line at launch."""
    from rally.agent.base.numa import NumaBindingError, cpus_near_gpu

    for local_rank in range(nproc):
        try:
            cpus_near_gpu(mode, local_rank)
        except NumaBindingError as exc:
            raise ConfigError(f"{exc}; run without --numa-binding") from None
