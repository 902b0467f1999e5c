"""`<log-dir>/events.jsonl`: one JSON object per lifecycle event, for tools and post-mortems.

Each line has `time` (Unix seconds), `event`, `host` and the event's own fields. Events:
round_formed, workers_starting (the round's workers are about to be forked), worker_started,
worker_exited (a worker's own exit), worker_stopped (the agent stopped it at the round's end;
`reason`: that end), worker_hung, round_ended (with `stop_seconds`, the time its workers took to
stop), restart, membership_change, preempted, job_end. The end of each worker of a round that ended
is one worker_exited or worker_stopped (workers stopped as the agent itself exits, on a signal or an
error, have none: job_end says why). The file is appended and flushed per event, so it survives a crash.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path):
        self.path = path
        self.host = socket.gethostname()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        self._file = open(os.open(path, flags, 0o600), "a", buffering=1)  # lives as long as the agent

    def emit(self, event: str, **fields: object) -> None:
        record = {"time": round(time.time(), 6), "event": event, "host": self.host, **fields}
        self._file.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        self._file.close()
