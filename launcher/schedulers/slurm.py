"""Everything rally knows about SLURM, read from one environment.

Under SLURM the user starts one `rally` per node with `srun`; each copy must
then agree, without talking to the others, on the run id, the number of nodes,
its own node rank and where the rendezvous store lives. SLURM already knows all
of that, so `SlurmJob` maps its environment variables onto one small,
immutable object (the shape of submitit's `JobEnvironment`), and the launcher
asks it instead of reading `SLURM_*` variables in several places: what SLURM
fills in of the options (`SlurmJob.overrides`), where the store is
(`SlurmJob.store_address`, for the agent and `rally status` alike), and
requeueing the job (`SlurmJob.requeue`).

This module imports nothing heavy and never talks to the controller, except
that `hostnames` asks `scontrol` to expand a host list when it can.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rally.agent.base.spec import SchedulerView
from rally.rendezvous.backends import HostPort, registered


class Options(Protocol):
    """What SLURM's fill-in reads of the options (launcher/options.py's Options is one)."""

    @property
    def rdzv_backend(self) -> str: ...

    @property
    def standalone(self) -> bool: ...

    @property
    def nproc_per_node(self) -> str | int: ...


__all__ = [
    "DESCRIBE_KEYS",
    "REQUEUE_TIMEOUT_S",
    "SCONTROL_TIMEOUT_S",
    "STORE_PORT_BASE",
    "STORE_PORT_SPAN",
    "SlurmJob",
    "expand_hostlist",
    "first_host",
    "hostnames",
]

#: How long `scontrol show hostnames` may take before the parser is used instead.
#: It is a local string operation; anything slower means a broken SLURM client
#: (for example one that is waiting on a configless DNS lookup).
SCONTROL_TIMEOUT_S: float = 5.0

#: How long `scontrol requeue` may take (it talks to the controller, which may be busy).
REQUEUE_TIMEOUT_S: float = 30.0

#: The store port is chosen from `STORE_PORT_BASE .. STORE_PORT_BASE + STORE_PORT_SPAN - 1`
#: (15000-28999). Why this range: it lies below Linux's default ephemeral range
#: (32768-60999), so an outgoing connection on the store host can never already
#: hold the port; it stays below torch's own defaults (29400 for torchrun's
#: rendezvous, 29500 for MASTER_PORT), so a job that also uses those does not
#: collide with itself; and it is above the ports of common services. It is a
#: fixed, documented choice: reading `ip_local_port_range` would make the
#: port depend on each node's settings, and every node must compute the same one.
STORE_PORT_BASE: int = 15000
STORE_PORT_SPAN: int = 14000

# Multiplier for the job id when it is mapped into the port range. It is coprime
# with STORE_PORT_SPAN, so SPAN consecutive job ids get SPAN different ports, and
# close to SPAN / golden ratio, so jobs a few ids apart land far apart and small
# step numbers cannot make them meet.
_PORT_STRIDE = 8653

# SLURM reserves the top step ids for its special steps (batch 0xfffffffb,
# extern 0xfffffffc, interactive 0xfffffffa, ...). They are not `srun` steps of
# the user's job and are treated like "no step".
_SPECIAL_STEP_MIN = 0xFFFFFFF0

#: Names accepted by `SlurmJob.describe`: the torchrun options that SLURM can fill in.
DESCRIBE_KEYS: frozenset[str] = frozenset({"nnodes", "node_rank", "rdzv_id", "rdzv_endpoint", "nproc_per_node"})

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


# --------------------------------------------------------------------- host lists


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM compressed host list, e.g. `node[01-03,07],gpu1`.

    Rules (the ones `scontrol show hostnames` follows):

    * Hosts are separated by commas (or whitespace) outside brackets; commas
      inside brackets separate ranges.
    * A bracket holds ranges `N` or `N-M`; zero padding is kept, with the
      width of the lower bound (`[08-10]` gives `08 09 10`).
    * Several bracket groups in one name give every combination, the leftmost
      group varying slowest: `a[1-2]-b[3,5]` gives `a1-b3 a1-b5 a2-b3 a2-b5`.
    * Order and duplicates are kept as written; empty entries are skipped.

    Raises `ValueError` with the offending part named when the list is
    malformed (unbalanced or nested brackets, empty or non-numeric ranges,
    reversed ranges).
    """
    hosts: list[str] = []
    for token in _split_top_level(text):
        hosts.extend(_expand_one(token, text))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas and whitespace that are not inside brackets."""
    tokens: list[str] = []
    depth = 0
    current: list[str] = []
    for pos, char in enumerate(text):
        if char == "[":
            if depth:
                raise ValueError(f"bad SLURM host list {text!r}: nested '[' at position {pos}")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"bad SLURM host list {text!r}: ']' without '[' at position {pos}")
            depth = 0
        elif depth == 0 and (char == "," or char.isspace()):
            tokens.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise ValueError(f"bad SLURM host list {text!r}: '[' is never closed")
    tokens.append("".join(current))
    return [t for t in tokens if t]


def _expand_one(token: str, text: str) -> list[str]:
    """Expand one host expression (no top-level commas) into its names."""
    # re.split with a capturing group alternates literal, bracket body, literal, ...
    parts = re.split(r"\[([^\]]*)\]", token)
    choices: list[list[str]] = []
    for index, part in enumerate(parts):
        if index % 2 == 0:
            choices.append([part])
        else:
            choices.append(_expand_ranges(part, token, text))
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_ranges(body: str, token: str, text: str) -> list[str]:
    """Expand the inside of one bracket, e.g. `01-03,7`."""
    where = f"bad SLURM host list {text!r}: in {token!r}"
    if not body.strip():
        raise ValueError(f"{where}: empty brackets")
    values: list[str] = []
    for item in body.split(","):
        item = item.strip()
        match = _RANGE.fullmatch(item)
        if not match:
            raise ValueError(f"{where}: {item!r} is not a number or a range N-M")
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise ValueError(f"{where}: reversed range {item!r} ({low} > {high})")
        width = len(low_text)
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
    return values


def hostnames(nodelist: str) -> list[str]:
    """Expand `nodelist`, asking `scontrol show hostnames` first.

    scontrol is the authority: it is SLURM's own parser, so it agrees with the
    controller even on syntax a site may rely on and `expand_hostlist`
    does not know. The parser covers the cases where scontrol is not there or
    cannot run: containers without SLURM's client tools, login-less images,
    a client without a readable `slurm.conf`.
    """
    if shutil.which("scontrol"):
        try:
            # wait: short: timeout=SCONTROL_TIMEOUT
            done = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=SCONTROL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0:
            names = done.stdout.split()
            # scontrol 22.05 exits 0 even on a malformed list, printing nothing
            # or fragments such as "n]" for "n[1-2"; such output is not trusted,
            # and the parser then reports the error.
            if names and not any(c in name for name in names for c in "[],"):
                return names
    return expand_hostlist(nodelist)


def first_host(nodelist: str) -> str:
    """The first host of `nodelist`: where SLURM jobs conventionally put the store.

    Uses `hostnames` (scontrol when it works, else the parser).
    """
    names = hostnames(nodelist)
    if not names:
        raise ValueError(f"SLURM host list {nodelist!r} names no host")
    return names[0]


# ------------------------------------------------------------------- the job


def inside_a_job(environ: Mapping[str, str]) -> bool:
    """This process runs inside a SLURM job (a step, a batch shell or an salloc shell)."""
    return bool(environ.get("SLURM_JOB_ID"))


@dataclass(frozen=True)
class SlurmJob:
    """What SLURM says about the job step this process runs in.

    Guarantees: every node of one `srun` step builds an equal object except
    for `node_rank`, `node_name` and the per-node counts (GPUs, CPUs), so `run_id`,
    `store_host` and `store_port` agree everywhere without communication.
    Two steps of one job get different `run_id` and `store_port` values, so
    they never join each other's rendezvous.
    """

    job_id: str
    #: The `srun` step number; None in a batch shell (and SLURM's special steps).
    step_id: int | None
    #: How often SLURM has requeued the job (SLURM_RESTART_COUNT, 0 at first).
    restart_count: int
    nnodes: int
    #: This node's index in the step (SLURM_NODEID), 0-based.
    node_rank: int
    #: The compressed node list, exactly as SLURM gave it (for messages).
    nodelist: str
    hosts: tuple[str, ...]
    #: GPUs SLURM gave this node, or None when no variable says anything about GPUs.
    gpus_on_node: int | None
    #: The variable `gpus_on_node` came from (for messages), or None.
    gpus_source: str | None
    #: SLURM_CPUS_ON_NODE, or None when unset.
    cpus_on_node: int | None
    #: This node's name as SLURM knows it (SLURMD_NODENAME), "" when unset.
    node_name: str = ""

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str],
        *,
        expand: Callable[[str], list[str]] = hostnames,
    ) -> SlurmJob | None:
        """Read the job from `environ`; None when rally is not running on a SLURM node.

        What counts as "inside SLURM":

        * an `srun` task (SLURM_JOB_ID and SLURM_STEP_ID): a job step, the
          normal way to run rally on several nodes;
        * a batch shell (SLURM_JOB_ID and SLURM_NODEID but no step id): rally
          runs on the job's first node, `step_id` is None and `nnodes` is
          the job's node count. Only this node runs rally unless it is started
          through `srun`; `describe` says so when the job has more nodes.
        * an `salloc` shell is *not* inside SLURM: it runs on the submit
          host, which is not one of the allocated nodes (no SLURM_NODEID), so
          its first "host" would be wrong. None is returned; use `srun`.

        `expand` turns a compressed node list into names (default
        `hostnames`; tests pass `expand_hostlist`). Raises
        ValueError, naming the variable, when the environment is inconsistent.
        """
        job_id = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        if job_id is None or _first(environ, "SLURM_NODEID") is None:
            return None

        step_id = _int(environ, "SLURM_STEP_ID", "SLURM_STEPID")
        if step_id is not None and (step_id < 0 or step_id >= _SPECIAL_STEP_MIN):
            step_id = None
        in_step = step_id is not None

        if in_step:
            nnodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
            nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        else:
            nnodes = _int(environ, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
            nodelist = _first(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise ValueError(f"SLURM job {job_id}: SLURM_JOB_NODELIST is not set")
        hosts = tuple(expand(nodelist))
        if not hosts:
            raise ValueError(f"SLURM job {job_id}: node list {nodelist!r} names no host")
        if nnodes is None:
            nnodes = len(hosts)
        if nnodes < 1:
            raise ValueError(f"SLURM job {job_id}: node count {nnodes} is not positive")

        node_rank = _int(environ, "SLURM_NODEID")
        assert node_rank is not None  # checked above
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"SLURM job {job_id}: SLURM_NODEID={node_rank} is outside 0..{nnodes - 1}")

        gpus, gpus_source = _gpus(environ)
        return cls(
            job_id=job_id,
            step_id=step_id,
            restart_count=_int(environ, "SLURM_RESTART_COUNT") or 0,
            nnodes=nnodes,
            node_rank=node_rank,
            nodelist=nodelist,
            hosts=hosts,
            gpus_on_node=gpus,
            gpus_source=gpus_source,
            cpus_on_node=_int(environ, "SLURM_CPUS_ON_NODE"),
            node_name=_first(environ, "SLURMD_NODENAME") or "",
        )

    @classmethod
    def of_step(cls, environ: Mapping[str, str], step: int) -> SlurmJob | None:
        """The job as the agent of step `step` saw it, read from another step's (or the batch
        shell's) environment: for `rally status` inside the job."""
        job = cls.from_env({k: v for k, v in environ.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")})
        return None if job is None else dataclasses.replace(job, step_id=step)

    @property
    def name(self) -> str:
        return "slurm"

    @property
    def endpoint(self) -> HostPort:
        """Where the step's rendezvous store is (the Scheduler seam's name for `store_address`)."""
        return self.store_address

    def agent_view(self) -> SchedulerView:
        """What the agent needs of SLURM: how to keep a quarantined node out, and that SLURM tracks
        the step by its cgroups (so the job's own cgroup is a v2 one inside them)."""
        keep_out = (
            f"to keep SLURM node {self.node_name} out when the job is requeued: "
            f"scontrol update JobId={self.job_id} ExcNodeList={self.node_name}"
            if self.node_name
            else ""
        )
        return SchedulerView("slurm", keep_out, tracks_cgroups=True)

    @property
    def in_step(self) -> bool:
        """True inside an `srun` step, False in a batch shell."""
        return self.step_id is not None

    @property
    def run_id(self) -> str:
        """The rendezvous id: `"<job>.<step>"` in a step (`"1234.0"`), else `"<job>"`.

        The step is part of it so that two steps of one job (run one after the
        other, or side by side on different nodes) never share a rendezvous.
        """
        return self.job_id if self.step_id is None else f"{self.job_id}.{self.step_id}"

    @property
    def store_host(self) -> str:
        """The host that runs the rendezvous store: the step's first node."""
        return self.hosts[0]

    @property
    def store_port(self) -> int:
        """A port that every node of the step computes alike, from job id and step id.

        See `STORE_PORT_BASE` for why the range is 15000-28999.
        """
        key = int(self.job_id) if self.job_id.isdigit() else zlib.crc32(self.job_id.encode())
        step_key = 0 if self.step_id is None else self.step_id + 1
        return STORE_PORT_BASE + (key * _PORT_STRIDE + step_key) % STORE_PORT_SPAN

    def nproc_auto_with_source(self) -> tuple[int, str]:
        """Workers per node for `--nproc-per-node auto`, and where the number came from.

        One per GPU when SLURM gave this node GPUs; else SLURM_CPUS_ON_NODE
        (what the step may use, not what the machine has); else os.cpu_count().
        """
        if self.gpus_on_node:
            return self.gpus_on_node, self.gpus_source or "GPUs"
        if self.cpus_on_node:
            return self.cpus_on_node, "SLURM_CPUS_ON_NODE"
        return os.cpu_count() or 1, "os.cpu_count()"

    def nproc_auto(self) -> int:
        """Workers per node for `--nproc-per-node auto` (see `nproc_auto_with_source`)."""
        return self.nproc_auto_with_source()[0]

    @property
    def store_address(self) -> HostPort:
        """Where this step's rendezvous store lives: the first host, a port derived from the ids."""
        return HostPort(self.store_host, self.store_port)

    def overrides(self, options: Options, given: Collection[str]) -> tuple[dict[str, Any], list[str]]:
        """What SLURM fills in of `options` (launcher.options.Options): only what the user left
        unset (`given` names the options set by a flag, a PET_/RALLY_ variable, the config file
        or a keyword argument). Returns the new values and the names taken, for `describe`."""
        changes: dict[str, Any] = {}
        taken: list[str] = []
        if "nnodes" not in given:
            changes["nnodes"] = str(self.nnodes)
            taken += ["nnodes", "node_rank"]
        chosen = registered(str(options.rdzv_backend))
        rendezvous_set = (
            any(name in given for name in ("rdzv_endpoint", "master_addr", "master_port"))
            or chosen is not None
            and not chosen.takes_slurm_store
            and "rdzv_backend" in given
        )
        if not options.standalone and not rendezvous_set:
            changes["rdzv_backend"] = "c10d"
            changes["rdzv_endpoint"] = self.store_address
            taken.append("rdzv_endpoint")
        if "rdzv_id" not in given:
            changes["rdzv_id"] = self.run_id
            taken.append("rdzv_id")
        nproc = "auto" if "nproc_per_node" not in given else options.nproc_per_node
        if str(nproc).lower() == "auto":
            changes["nproc_per_node"] = str(self.nproc_auto())
            taken.append("nproc_per_node")
        return changes, taken

    def requeue(self) -> str:
        """Requeue this job (node 0's agent calls it on a preemption signal with --requeue)."""
        # wait: short: timeout=REQUEUE_TIMEOUT_S on scontrol; SLURM answers in ms
        done = subprocess.run(
            ["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S
        )
        if done.returncode != 0:
            raise RuntimeError(f"scontrol requeue {self.job_id} failed: {done.stderr.strip() or done.returncode}")
        return f"requeued SLURM job {self.job_id}; it will resume from the latest checkpoint"

    def describe(self, taken: Iterable[str]) -> str:
        """One line for the launcher to print: what SLURM supplied and what was used.

        `taken` names the settings the launcher took from SLURM (the others
        came from flags or a config file), from `DESCRIBE_KEYS`; dashes
        are accepted for underscores. Example:

            SLURM job 1234.0: 2 nodes (node[1-2]), this is node 0, store node1:17234, nproc 2 from SLURM_CPUS_ON_NODE
        """
        keys = {key.replace("-", "_") for key in taken}
        unknown = keys - DESCRIBE_KEYS
        if unknown:
            raise ValueError(f"describe(): unknown keys {sorted(unknown)}; known: {sorted(DESCRIBE_KEYS)}")
        parts: list[str] = []
        if "nnodes" in keys:
            noun = "node" if self.nnodes == 1 else "nodes"
            parts.append(f"{self.nnodes} {noun} ({self.nodelist})")
        if "node_rank" in keys:
            parts.append(f"this is node {self.node_rank}")
        if "rdzv_endpoint" in keys:
            parts.append(f"store {self.store_host}:{self.store_port}")
        if "nproc_per_node" in keys:
            nproc, source = self.nproc_auto_with_source()
            parts.append(f"nproc {nproc} from {source}")
        line = f"SLURM job {self.run_id}"
        if self.restart_count:
            line += f" (restart {self.restart_count})"
        line += ": " + (", ".join(parts) if parts else "nothing taken from it")
        if not self.in_step and self.nnodes > 1:
            line += "; note: batch shell, not an srun step, so only this node runs rally (use: srun rally ...)"
        return line


# ----------------------------------------------------------------- env parsing


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    """The value of the first of `names` that is set and not blank."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    """Like `_first`, parsed as an int; ValueError names the variable."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return None


def _gpus(environ: Mapping[str, str]) -> tuple[int | None, str | None]:
    """GPUs on this node and the variable that said so, or (None, None).

    SLURM_GPUS_ON_NODE is SLURM's own count. Without it (older SLURM, `--gres`
    instead of `--gpus`) the number of devices listed in CUDA_VISIBLE_DEVICES,
    SLURM_STEP_GPUS or SLURM_JOB_GPUS is used. CUDA's "none" markers (empty,
    `NoDevFiles`, `-1`) count as 0.
    """
    count = _int(environ, "SLURM_GPUS_ON_NODE")
    if count is not None:
        return count, "SLURM_GPUS_ON_NODE"
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if name in environ:
            devices = [d.strip() for d in environ[name].split(",")]
            devices = [d for d in devices if d and d not in ("NoDevFiles", "-1")]
            return len(devices), name
    return None, None
