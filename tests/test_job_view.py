"""agent/observe/job_view.py: node 0's view of the job in its run directory, for `rally status RUN_DIR`.

Written as node 0 writes it, read as `rally status` reads it: only the user's own, owner-only,
fresh view of this run id, each node record checked as a store record is. Real files; the other
user's planted view is in tests/test_status_hostile.py.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from rally.agent.observe.job_view import MAX_VIEW_AGE_SECONDS, VIEW_FILE, read_job_view, write_job_view
from rally.rendezvous.base.records import EndKind, RoundEnd

NODE = {"host": "node-a", "node_id": "n1", "round": 4, "workers": [{"rank": 0, "pid": 4242, "state": "running"}]}


def status(**changes: object) -> dict:
    return {"round": 4, "closed": None, "nodes": [NODE], "quarantined": {}, "preflight": None, **changes}


# Same under load: files and clocks passed in, nothing timed.
@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_the_view_node_0_writes_is_read_back_owner_only_with_its_age(tmp_path: Path) -> None:
    end = RoundEnd(EndKind("succeeded"), "all workers finished")
    write_job_view(tmp_path, "job", status(closed=end, quarantined={"node-b": "GPU XID 79"}))
    path = tmp_path / VIEW_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and [p.name for p in tmp_path.iterdir()] == [VIEW_FILE]
    written = json.loads(path.read_text())["written"]
    view, age = read_job_view(tmp_path, "job", now=written + 2.5)
    assert age == pytest.approx(2.5)
    assert view["round"] == 4 and view["nodes"] == [NODE] and view["quarantined"] == {"node-b": "GPU XID 79"}
    assert view["closed"] == {"kind": "succeeded", "detail": "all workers finished"}


@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_a_view_that_is_stale_of_another_run_or_open_to_others_is_not_read(tmp_path: Path) -> None:
    write_job_view(tmp_path, "job", status())
    written = json.loads((tmp_path / VIEW_FILE).read_text())["written"]
    assert (
        read_job_view(tmp_path, "job", now=written + MAX_VIEW_AGE_SECONDS + 1) is None
    )  # node 0 moved, or between rounds
    assert read_job_view(tmp_path, "other job", now=written) is None
    (tmp_path / VIEW_FILE).chmod(0o644)  # readable by others: not what the agent wrote
    assert read_job_view(tmp_path, "job", now=written) is None
    (tmp_path / VIEW_FILE).chmod(0o600)
    assert read_job_view(tmp_path, "job", now=written) is not None
    os.rename(tmp_path / VIEW_FILE, tmp_path / "elsewhere.json")
    (tmp_path / VIEW_FILE).symlink_to(tmp_path / "elsewhere.json")  # a link is never followed
    assert read_job_view(tmp_path, "job", now=written) is None
    assert read_job_view(tmp_path / "missing", "job") is None


@pytest.mark.same_under_load
@pytest.mark.timeout(30)
def test_a_view_s_records_are_checked_as_store_records_are(tmp_path: Path) -> None:
    shapes = [NODE, ["not", "a", "record"], {**NODE, "node_id": "n2", "updated": "yesterday"}]
    write_job_view(tmp_path, "job", status(nodes=shapes, round="four"))
    view, _age = read_job_view(tmp_path, "job", now=time.time())
    assert view["round"] is None and [n["node_id"] for n in view["nodes"]] == ["n1", "n2"]
    assert "updated" not in view["nodes"][1]  # a string where a number goes reads as absent
    (tmp_path / VIEW_FILE).write_text("[" * 100_000 + "]" * 100_000)
    assert read_job_view(tmp_path, "job") is None  # not a RecursionError
