"""How one node finds the others: the store, the membership rules, and who it is.

Built by the launcher from flags, environment, config file and SLURM (launcher/config.py) and
handed to the agent, which opens the store and runs the round protocol with it.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

from rally.rendezvous.protocol import RendezvousSettings
from rally.rendezvous.store import Store, StoreEndpoint, open_store
from rally.rendezvous.token import Signer


@dataclass
class RendezvousPlan:
    """How this node finds the others: the store, the membership rules, and who it is."""

    endpoint: StoreEndpoint
    settings: RendezvousSettings
    local_addr: str
    preferred_rank: int | None = None
    connect_timeout: float = 600.0
    read_timeout: float = 60.0
    token: str = ""  # the job's secret: every store value is signed with it (rendezvous/token.py)
    # The static backend, as torchrun: workers get MASTER_ADDR/MASTER_PORT = the rendezvous
    # store itself (--master-addr/--master-port; clusters open one port), and node 0 deletes
    # the previous attempt's worker keys before each round. Otherwise: a fresh store per round.
    workers_use_rendezvous_store: bool = False

    def open_store(self, run_id: str, progress: Callable[[str], None] | None = None) -> tuple[Store, Any]:
        """Connect to the job's store (hosting it when this is the endpoint's host): the store
        and the server this node hosts, or None. StoreUnavailable when it cannot be reached.
        `progress` hears every few seconds what a refused connect still waits for."""
        opened = open_store(self.endpoint, f"rally/{run_id}/", self.connect_timeout, self.read_timeout, Signer(self.token), progress)
        if self.endpoint.etcd:
            # Reaching etcd needs no torch, but any node may host the workers' TCPStore in a
            # later round: import it now, beside the rendezvous, not in the middle of a re-form.
            threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()
        return opened
