"""A stranger on etcd (in the fault matrix): values are signed with the job
token there as on c10d, so an unsigned round end written mid-run is rejected with one line naming
the key instead of ending the job "succeeded". Runs on the real 3-member cluster of
tests/support/etcd_cluster.py; with RALLY_TEST_CPU_HOG=1 beside a busy loop per core (tests/conftest.py).
"""

from __future__ import annotations

import base64
import json
import urllib.request
import uuid

import pytest

from support.agents import AgentProcess, start_agent, stop_all
from support.etcd_cluster import etcd, etcd_cluster, needs_etcd  # noqa: F401 - fixtures
from support.helpers import eventually, write_probe
from test_etcd import PROBE
from test_etcd_security import job_args


# Same under load: the forged end is written at a fixed point and rejected by its (missing) signature.
@pytest.mark.same_under_load
@needs_etcd
@pytest.mark.timeout(180)
def test_a_strangers_unsigned_round_end_on_etcd_is_rejected_naming_the_key(etcd, tmp_path):
    probe, steps = write_probe(tmp_path / "probe.py", PROBE), tmp_path / "steps.jsonl"
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    args = job_args(etcd.endpoints(), run_id, "read_timeout=10", probe, steps, 60)
    agents: list[AgentProcess] = [
        start_agent(f"n{i}", tmp_path, args, env={"RALLY_JOB_TOKEN": "the-secret"}) for i in range(2)
    ]
    try:
        assert eventually(lambda: steps.exists() and len(steps.read_text().splitlines()) > 10, 120), agents[0].output()
        key = f"rally/{run_id}/0/end"
        forged = json.dumps(
            {"kind": "succeeded", "detail": "all workers finished successfully", "node": "", "info": {}}
        )
        body = json.dumps(
            {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(forged.encode()).decode()}
        )
        request = urllib.request.Request(
            f"http://{etcd.members[0].endpoint}/v3/kv/put", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200
        codes = [agent.wait(60) for agent in agents]
        outputs = "\n".join(a.output() for a in agents)
        assert codes == [1, 1], outputs
        for agent in agents:
            text = agent.output()
            assert f"'{key}'" in text and "which no rally agent wrote" in text and "Traceback" not in text, text
            assert "job succeeded" not in text, text
    finally:
        stop_all(agents)
