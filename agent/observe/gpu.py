"""GPU health through NVML (nvidia-ml-py's `pynvml`): memory, utilisation, XID and ECC errors.

Why NVML and not `nvidia-smi`: one library call per device instead of a process per sample
(tens of milliseconds, at every resource interval), and it sees what nvidia-smi's CSV does not
carry: XID events as they happen, uncorrected ECC counts, retired pages and row remapping.

The package is optional (`pip install 'torch-rally[gpu]'`). Without it, without a driver, or
without a GPU, `open_monitor` returns no monitor and a reason in one line, and nothing
else changes. The judgement is kept apart from NVML: `device_problems` and
`worker_usage` are pure functions over `DeviceReading` values, so they are tested
on machines without GPUs; only `NvmlMonitor` talks to the library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

# XIDs that the application causes (illegal memory access, a killed context, ...). They show in
# the XID list but do not make the node unhealthy: a restart clears them. Every other critical
# XID (48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92/94/95 ECC,
# 119/120 GSP, ...) points at the hardware or the driver.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
MIB = 1024 * 1024


@dataclass(frozen=True)
class DeviceReading:
    """One GPU as NVML reported it at one moment."""

    index: int
    uuid: str = ""
    name: str = ""
    memory_used: int = 0  # bytes
    memory_total: int = 0  # bytes
    utilization: int | None = None  # percent of time a kernel ran (None: not supported)
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors (None: no ECC)
    retired_pages_pending: bool = False  # pages waiting to be retired at the next reset
    remapping_failed: bool = False  # a row remapping failed: the GPU needs service
    xids: tuple[int, ...] = ()  # critical XID events seen since the previous reading
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes of GPU memory
    process_utilization: dict[int, int] = field(default_factory=dict)  # pid -> SM percent


@dataclass(frozen=True)
class WorkerGpu:
    """What one worker (with its children) uses on the GPUs."""

    memory: int  # bytes
    utilization: int | None  # percent: the worker's own SM share, else its devices' utilisation


def device_problems(device: DeviceReading) -> list[str]:
    """Why this GPU is unhealthy, one phrase per problem (empty: healthy)."""
    xids = xid_problem(device)
    return state_problems(device) + ([xids] if xids else [])


def state_problems(device: DeviceReading) -> list[str]:
    """Problems NVML keeps reporting until the GPU is reset or serviced (ECC, retired pages, remapping)."""
    where = _where(device)
    problems = []
    if device.ecc_uncorrected:
        problems.append(f"{where}: {device.ecc_uncorrected} uncorrected ECC errors")
    if device.retired_pages_pending:
        problems.append(f"{where}: memory pages waiting to be retired (reset the GPU)")
    if device.remapping_failed:
        problems.append(f"{where}: a memory row remapping failed (the GPU needs service)")
    return problems


def xid_problem(device: DeviceReading) -> str | None:
    """The hardware XIDs in this reading (events: each is reported once, by the reading after it)."""
    hardware = sorted({x for x in device.xids if x not in APPLICATION_XIDS})
    return f"{_where(device)}: XID {', '.join(map(str, hardware))}" if hardware else None


def _where(device: DeviceReading) -> str:
    return f"GPU {device.index}" + (f" ({device.uuid})" if device.uuid else "")


def node_problems(devices: Iterable[DeviceReading]) -> list[str]:
    """Every problem of every GPU on this node."""
    return [problem for device in devices for problem in device_problems(device)]


def worker_usage(devices: Iterable[DeviceReading], pids: set[int]) -> WorkerGpu:
    """GPU memory and utilisation of a worker whose process tree is `pids`.

    A DataLoader child or a compile worker may hold CUDA memory too, so the whole tree counts.
    Utilisation is the worker's own SM share where NVML samples it per process, else the
    highest utilisation of the devices the worker has memory on.
    """
    memory = 0
    own: list[int] = []
    device_util: list[int] = []
    for device in devices:
        used = sum(device.processes.get(pid, 0) for pid in pids)
        memory += used
        shares = [device.process_utilization[pid] for pid in pids if pid in device.process_utilization]
        if shares:
            own.append(sum(shares))
        elif used and device.utilization is not None:
            device_util.append(device.utilization)
    utilization = max(own) if own else (max(device_util) if device_util else None)
    return WorkerGpu(memory, utilization)


# ----------------------------------------------------------------------------- NVML


class NvmlMonitor:
    """An initialised NVML with one handle per GPU and an event set for critical XIDs."""

    def __init__(self, nvml: ModuleType, handles: list[object]):  # NVML's device handles: opaque
        self.nvml = nvml
        self.handles = handles
        self.events = None
        self.last_sample_at: dict[int, int] = {}
        try:
            self.events = nvml.nvmlEventSetCreate()
            for handle in handles:
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.events)
                except nvml.NVMLError:
                    pass  # not supported on this GPU (e.g. some consumer boards): no XIDs from it
        except nvml.NVMLError:
            self.events = None

    def read(self) -> list[DeviceReading]:
        """Read every GPU once (a few library calls each; no process is started)."""
        xids = self._drain_xids()
        return [self._read_device(i, h, tuple(xids.get(i, ()))) for i, h in enumerate(self.handles)]

    def close(self) -> None:
        nvml = self.nvml
        try:
            if self.events is not None:
                nvml.nvmlEventSetFree(self.events)
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass

    def _drain_xids(self) -> dict[int, list[int]]:
        seen: dict[int, list[int]] = {}
        if self.events is None:
            return seen
        nvml = self.nvml
        for _ in range(1000):  # bounded: a flood of events cannot hold the agent
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError:
                break  # NVML_ERROR_TIMEOUT: nothing more
            index = next((i for i, h in enumerate(self.handles) if _same(nvml, h, event.device)), -1)
            seen.setdefault(index, []).append(int(event.eventData))
        return seen

    def _read_device(self, index: int, handle: object, xids: tuple[int, ...]) -> DeviceReading:
        nvml = self.nvml
        memory = _call(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
        utilization = _call(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
        ecc = _call(
            nvml,
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        pending = _call(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        remapped = _call(nvml, nvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failed)
        processes: dict[int, int] = {}
        for proc in _call(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []:
            processes[int(proc.pid)] = processes.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
        shares: dict[int, int] = {}
        samples = _call(nvml, nvml.nvmlDeviceGetProcessUtilization, handle, self.last_sample_at.get(index, 0)) or []
        for sample in samples:
            shares[int(sample.pid)] = int(sample.smUtil)
            self.last_sample_at[index] = max(self.last_sample_at.get(index, 0), int(sample.timeStamp))
        return DeviceReading(
            index=index,
            uuid=_text(_call(nvml, nvml.nvmlDeviceGetUUID, handle)),
            name=_text(_call(nvml, nvml.nvmlDeviceGetName, handle)),
            memory_used=int(memory.used) if memory else 0,
            memory_total=int(memory.total) if memory else 0,
            utilization=int(utilization.gpu) if utilization else None,
            ecc_uncorrected=int(ecc) if ecc is not None else None,
            retired_pages_pending=bool(pending),
            remapping_failed=bool(remapped[3]) if remapped else False,
            xids=xids,
            processes=processes,
            process_utilization=shares,
        )


def open_monitor(
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> tuple[NvmlMonitor | None, str]:
    """NVML ready to read, or None and the reason GPU health is skipped on this node (one line)."""
    try:
        nvml = import_module("pynvml")
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'torch-rally[gpu]' to check GPUs)"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return None, f"NVML cannot start ({exc}): no NVIDIA driver on this node"
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except nvml.NVMLError as exc:
        nvml.nvmlShutdown()
        return None, f"NVML cannot list the GPUs ({exc})"
    if not handles:
        nvml.nvmlShutdown()
        return None, "no NVIDIA GPU on this node"
    return NvmlMonitor(nvml, handles), ""


def _call(nvml: ModuleType, fn: Callable[..., Any], *args: object) -> Any:
    """One NVML query; None where the GPU does not support it (NVML_ERROR_NOT_SUPPORTED, ...)."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _same(nvml: ModuleType, first: object, second: object) -> bool:
    """Two NVML device handles (opaque: only NVML reads them) name the same GPU."""
    try:
        return _text(nvml.nvmlDeviceGetUUID(first)) == _text(nvml.nvmlDeviceGetUUID(second))
    except nvml.NVMLError:
        return False


def _text(value: object) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
