"""Fault matrix: another user of the node against the job's local surfaces (issue 27, items 6-10,
12, 15): the store's lists and keep-alives, the orphan guard, /metrics, the standalone store and
the job's secrets. The attacker is a real other uid (tests/stranger.py) wherever it is one; it
reaches a TCPStore with the torch of this interpreter (a stranger who installs torch can too).

docs/security.md "Local surfaces" lists what these tests prove.
"""

from __future__ import annotations

import pytest

from agents import write_script
from stranger import require_stranger, run_as_stranger
from test_faults_membership import (
    cluster,  # noqa: F401 - a fixture
    job_args,
    records,
    wait_for,
)
from test_faults_trust import RANKS_WORKER, TOKEN

# A stranger's TCPStore client (torch from this interpreter's site-packages), as uid 65534.
STRANGER_CLIENT = """
import os, sys
os.environ["RES_OPTIONS"] = "timeout:1 attempts:1"
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", {port}, is_master=False, timeout=timedelta(seconds=10))
"""


def as_stranger(port: int, code: str, timeout: float = 60) -> str:
    """Run `code` as uid 65534 with `store` connected to the port; its stdout (it must succeed)."""
    done = run_as_stranger(STRANGER_CLIENT.format(port=port) + code, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# ------------------------------------------------------------------ 6. a long unsigned list
@pytest.mark.timeout(180)
def test_a_strangers_long_append_to_the_status_list_does_not_stop_keep_alives(cluster, tmp_path):
    """1.5 MB of lines appended to `status/nodes` used to cost node 0's keep-alive thread two
    store calls per line: keep-alives stopped and both nodes exited 1 blaming the network."""
    require_stranger()
    store = cluster.store()
    script = write_script(tmp_path, "ranks.py", RANKS_WORKER)
    env = {"RALLY_JOB_TOKEN": TOKEN, "SLOW_RANK_SECONDS": "10", "OTHER_RANK_SECONDS": "10"}
    agents = [cluster.agent(f"n{i}", [*job_args(store.port, "2"), str(script)], env=env) for i in range(2)]
    assert wait_for(lambda: len(records(cluster.out)) == 2, 90), "\n".join(a.output() for a in agents)
    appended = as_stranger(
        store.port,
        'store.append("rally/testjob/status/nodes", b"".join(b"n%06d\\n" % i for i in range(190000)))\n'
        'print("appended", len(store.get("rally/testjob/status/nodes")))',
    )
    assert "appended 15" in appended, appended  # 1.5 MB
    codes = [a.wait(90) for a in agents]
    assert codes == [0, 0], "\n".join(a.output() for a in agents)
    assert all("job succeeded" in a.output() for a in agents)
