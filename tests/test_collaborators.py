"""The agent calls its collaborators' hooks (agent/base/collaborator.py) at the documented moments,
in the order they are registered, in a real run: rally itself, with one tracing collaborator
registered before the agent's own and one after (tracer.py below, the only difference from the
`rally` command), each writing an event to events.jsonl as its hooks run. The agent's own
collaborators' events (the observer's `gpu_health_skipped` at start, the judge of exits'
`worker_exited` on a watch turn) then fall between the two tracers' events for the same hook."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from support.helpers import clean_env, read_events, run_rally, write_probe

TRACER = """
import sys

from rally.agent import agent
from rally.agent.base.collaborator import Collaborator


class Trace(Collaborator):
    def __init__(self, ctx, label):
        self.ctx, self.label = ctx, label

    def _event(self, hook):
        self.ctx.events.emit("hook", hook=hook, by=self.label)

    def start(self): self._event("start")
    def joined(self, store): self._event("joined")
    def before_round(self): self._event("before_round")
    def round_formed(self, rnd): self._event("round_formed")
    def workers_starting(self, rnd, master): self._event("workers_starting")
    def watch(self, rnd): self._event("watch")
    def watch_over(self, rnd): self._event("watch_over")
    def round_ending(self, rnd): self._event("round_ending")
    def round_ended(self, rnd, end): self._event("round_ended")
    def restarting(self, rnd, end): self._event("restarting")
    def exit(self): self._event("exit")
    def workers_started(self, rnd, workers): self._event("workers_started")
    def worker_env(self): return {"TRACED_BY_" + self.label.upper(): "1"}


built = agent.Agent.__init__


def traced(self, *args, **kwargs):
    built(self, *args, **kwargs)
    self.collaborators = [Trace(self, "first"), *self.collaborators, Trace(self, "last")]


agent.Agent.__init__ = traced
from rally.launcher.entry import main  # as `python -m rally`

sys.argv[0] = "rally"
main()
"""

# Round 0: rank 1 fails at once while rank 0 waits to be stopped; round 1: both succeed.
SCRIPT = """
import os, sys, time
if not (os.environ.get("TRACED_BY_FIRST") and os.environ.get("TRACED_BY_LAST")):
    sys.exit(3)  # both tracers' worker_env reached the workers
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if os.environ["RANK"] == "1":
        sys.exit(1)
    time.sleep(60)
"""

HOOKS_IN_A_RUN = [
    "start", "joined",
    "before_round", "round_formed", "workers_starting", "workers_started", "watch", "watch_over", "round_ending",
    "round_ended", "restarting",
    "before_round", "round_formed", "workers_starting", "workers_started", "watch", "watch_over", "round_ending",
    "round_ended",
    "exit",
]  # fmt: skip
SHOWN = {"gpu_health_skipped", "round_formed", "workers_starting", "worker_started", "worker_exited", "round_ended"}
SHOWN |= {"restart", "job_end"}


def names(events: list[dict]) -> list[str]:
    """The run as names: a tracer's hook as `first:hook`, the agent's own events by name."""
    every = [f"{e['by']}:{e['hook']}" if e["event"] == "hook" else e["event"] for e in events]
    return [n for n in every if ":" in n or n in SHOWN]


def hooks_of(tracer: str, run: list[str]) -> list[str]:
    """One tracer's hooks in order, a run of watch turns as one."""
    hooks = [n.split(":")[1] for n in run if n.startswith(tracer + ":")]
    return [h for i, h in enumerate(hooks) if not (h == "watch" and i and hooks[i - 1] == "watch")]


@pytest.mark.timeout(90)
def test_every_hook_runs_at_its_moment_in_the_order_registered(tmp_path: Path) -> None:
    tracer = write_probe(tmp_path / "tracer.py", TRACER)
    script = write_probe(tmp_path / "job.py", SCRIPT)
    logs = tmp_path / "logs"
    args = ["--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs), str(script)]
    result = run_rally(args, cwd=tmp_path, env=clean_env(), argv=[sys.executable, str(tracer), *args])
    assert result.returncode == 0, result.describe()
    run = names(read_events(logs))
    shown = " ".join(run)
    assert hooks_of("first", run) == hooks_of("last", run) == HOOKS_IN_A_RUN, shown
    # Registered order: first, the agent's own, last; at exit the reverse. The one exception is the
    # watch turn whose collaborator ended the round: the first end wins, the later ones are not asked.
    tracers = [n for n in run if ":" in n]
    ending = next(i for i, n in enumerate(tracers) if n == "first:watch" and tracers[i + 1] == "first:watch_over")
    del tracers[ending]
    pairs = list(zip(tracers[::2], tracers[1::2], strict=True))
    assert all(a == "first:" + b.split(":")[1] and b.startswith("last:") for a, b in pairs[:-1]), shown
    assert pairs[-1] == ("last:exit", "first:exit"), shown
    # The agent's own collaborators act between the two tracers, at their hook's moment:
    assert "first:start gpu_health_skipped last:start" in shown  # the observer opens NVML (none here)
    assert "first:watch worker_exited first:watch_over" in shown  # the judge of exits ended round 0
    # and the agent's own steps fall where agent/base/collaborator.py says:
    assert "round_formed first:round_formed" in shown
    assert "last:workers_starting workers_starting worker_started" in shown
    assert "worker_started first:workers_started last:workers_started" in shown  # after every worker started
    assert "last:round_ending round_ended first:round_ended" in shown  # the workers were stopped between
    assert "restart first:restarting" in shown
    assert shown.endswith("last:exit first:exit job_end")


# What agent/agent.py may name of its features: the registration (the list in Agent.__init__), nothing else.
REGISTRATION = re.compile(
    r"        # The agent's features, .*?self\.collaborators: list\[Collaborator\] = \[\n.*?\n        \]\n", re.S
)


@pytest.mark.timeout(30)
def test_the_agent_names_no_feature_outside_their_registration() -> None:
    """A feature reaches the agent through hooks (agent/base/collaborator.py): its class is named
    once, where it is registered, and the agent keeps no attribute of its own for it."""
    from rally.agent import agent
    from rally.agent.base.collaborator import Collaborator

    source = Path(agent.__file__).read_text()
    registration = REGISTRATION.search(source)
    assert registration is not None, "Agent.__init__ registers its features in one list"
    body = source[source.index("class Agent") :].replace(registration[0], "")  # the imports name them too
    features = [
        name
        for name, value in vars(agent).items()
        if isinstance(value, type) and issubclass(value, Collaborator) and value is not Collaborator
    ]
    assert len(features) >= 5, features  # checks, exits, hangs, observer, checkpoints, preemption
    assert sorted(name for name in features if re.search(rf"\b{name}\b", body)) == []
    assert all(re.search(rf"\b{name}\b", registration[0]) for name in features)
