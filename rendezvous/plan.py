"""How one node finds the others: the store, the membership rules, and who it is.

Built by the launcher from flags, environment, config file and SLURM (launcher/config.py) and
handed to the agent, which opens the store and runs the round protocol with it.
"""

from __future__ import annotations

import importlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from rally.rendezvous.backends import OpenedStore, backend_of
from rally.rendezvous.base.keys import job_prefix
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.connect import reporting_progress
from rally.rendezvous.c10d.store import StoreEndpoint
from rally.rendezvous.protocol import RendezvousSettings

# How long any one store call may take (--rdzv-conf read_timeout).
READ_TIMEOUT_SECONDS = 60.0


@dataclass
class RendezvousPlan:
    """How this node finds the others: the store, the membership rules, and who it is."""

    endpoint: StoreEndpoint
    settings: RendezvousSettings
    local_addr: str
    preferred_rank: int | None = None
    connect_timeout: float = RendezvousSettings.join_timeout
    read_timeout: float = READ_TIMEOUT_SECONDS
    token: str = ""  # the job's secret: every store value is signed with it (rendezvous/base/token.py)
    own_token_when_hosted: bool = False
    """A job that can only have one node (launcher/config.py `one_local_node`): when this node hosts
    the store itself, no other agent reads it, so without a given token it signs with a fresh random
    one, as --standalone does, and a local user who reaches the port cannot forge its end. A store
    someone else hosts (a `rally store` service several jobs share) keeps the given token, or none."""

    @property
    def workers_use_rendezvous_store(self) -> bool:
        """The static backend, as torchrun: workers get MASTER_ADDR/MASTER_PORT = the rendezvous
        store itself (--master-addr/--master-port; clusters open one port), and node 0 deletes
        the previous attempt's worker keys before each round. Otherwise: a fresh store per round."""
        return backend_of(self.endpoint).static_ranks

    def open_store(self, run_id: str, progress: Callable[[str], None] | None = None) -> OpenedStore:
        """Connect to the job's store (hosting it when this is the endpoint's host): the store,
        the server this node hosts or None, and the port it is bound to. StoreUnavailable when
        it cannot be reached. `progress` hears every few seconds what a refused connect still
        waits for (rendezvous/c10d/connect.py)."""
        backend = backend_of(self.endpoint)
        signer = Signer(self.token)
        with reporting_progress(progress):
            opened = backend.open(self.endpoint, job_prefix(run_id), self.connect_timeout, self.read_timeout, signer)
        if self.own_token_when_hosted and not self.token and opened.server is not None:
            signer.adopt(secrets.token_hex(32))  # before the job writes its first record
        if not backend.imports_torch:
            # Reaching the store needs no torch, but any node may host the workers' TCPStore in
            # a later round: import it now, beside the rendezvous, not in the middle of a re-form.
            threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()
        return opened
