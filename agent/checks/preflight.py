"""The pre-flight check (`--preflight`, on by default for multi-node jobs): bad nodes never join.

When a round has formed and before any worker starts, every node of the round runs the probe
(agent/checks/preflight_probe.py: a compute block, an all-reduce over the job's backend, a timed
exchange with every other node), forked from the worker template so it costs no torch import.
Each node publishes its numbers under the round's pre-flight keys; node 0 judges them (`judge`,
a pure function): a node whose probe failed, or that is slower than the median by
`--preflight-factor` (compute or link), is named with its numbers. As many of them as MIN allows
are left out: node 0 counts them lost and ends the round (a membership change, no restart spent),
their agents leave with one line, and the round re-forms without them, a waiting spare in their
place. The others are kept, and a line says the job goes on with them.

Every node prints the verdict's lines, writes a `preflight` event, and shows its numbers in its
status record (`rally status`, /metrics). A round that re-forms after a worker failure on the same
nodes (same member count) is not probed again, unless `--preflight-every-round`. The probe's own
timeout and the wait for the verdict are bounded (`PROBE_TIMEOUT_SECONDS`); a node 0 that never
judges means no verdict, and the job goes on and says so.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rally.agent.base.collaborator import AgentContext
from rally.agent.display import console
from rally.agent.template.client import TemplateClient
from rally.rendezvous.protocol import FAILURE_KINDS, Assignment, EndKind, Round, RoundEnd, preflight_key
from rally.rendezvous.status.job_notes import save_preflight
from rally.rendezvous.status.long_wait import wait_in_slices

PROBE = str(Path(__file__).with_name("preflight_probe.py"))
# The probe's collective timeout; the probe, and every wait for the others' numbers, ends by then.
PROBE_TIMEOUT_SECONDS = 20.0
# After the probe, how long node 0 waits for the slowest node's numbers, and the others for the verdict.
VERDICT_WAIT_SECONDS = 30.0
# A link is slow only when its exchange (1 MB each way) also takes this long: 20 ms is 100 MB/s,
# a working link; below it the ratio measures CPU scheduling on a busy node, not the network.
LINK_SLOW_FLOOR_SECONDS = 0.02


def judge(results: dict[int, dict | None], factor: float, min_nodes: int) -> dict[str, Any]:
    """The verdict on a round's probe results (by group rank; None: no result): who is bad, who is left out."""
    ok = {g: r for g, r in results.items() if r and not r.get("error") and r.get("compute")}
    compute = statistics.median(r["compute"] for r in ok.values()) if ok else None
    links = [r["link"] for r in ok.values() if r.get("link")]
    link = statistics.median(links) if len(results) >= 3 and len(links) == len(ok) and links else None
    nodes, bad = [], []
    for g in sorted(results):
        r = results[g] or {}
        host = r.get("host", f"group rank {g}")
        why = ""
        if g not in ok:
            why = f"its probe failed: {r.get('error') or 'no result within the time limit'}"
        else:
            slow = []
            if compute and r["compute"] > factor * compute:
                slow.append(f"compute {r['compute'] / compute:.1f}x the median")
            if link and r.get("link") and r["link"] > max(factor * link, LINK_SLOW_FLOOR_SECONDS):
                slow.append(f"link {r['link'] / link:.1f}x the median")
            why = f"slower than {factor:g}x the median ({', '.join(slow)})" if slow else ""
        numbers = _numbers(r, compute, link)
        nodes.append(
            {
                "group_rank": g,
                "host": host,
                "bad": why,
                "numbers": numbers,
                "line": f"{why + '; ' if why else ''}{numbers}",
                **{k: r.get(k) for k in ("compute", "link", "allreduce", "error")},
            }
        )
        if why:
            bad.append(
                (
                    0 if g not in ok else 1,
                    -max((r.get("compute") or 0) / (compute or 1), (r.get("link") or 0) / (link or 1)),
                    g,
                )
            )
    room = max(0, len(results) - min_nodes)
    if len(ok) * 2 <= len(results):  # a probe that failed on most nodes names no culprit
        room = 0
    out = [g for *_, g in sorted(bad)[:room]]
    kept = [g for *_, g in sorted(bad)[room:]]
    summary = f"{len(results)} nodes, {len(bad)} named, {len(out)} left out" + (f", {len(kept)} kept" if kept else "")
    if kept:
        summary += (
            f" (the probe failed on {len(results) - len(ok)} of {len(results)}: no culprit)"
            if len(ok) * 2 <= len(results)
            else f" (MIN={min_nodes})"
        )
    return {
        "nodes": nodes,
        "left_out": out,
        "kept_bad": kept,
        "median_compute": compute,
        "median_link": link,
        "summary": summary,
    }


class PreflightContext(AgentContext, Protocol):
    """What the pre-flight (and so agent/checks/node_checks.py) needs of its agent beyond every
    collaborator's context."""

    @property
    def template(self) -> TemplateClient | None:
        """The agent's worker template (the probe is forked from it), None without one."""


def _numbers(result: dict, compute: float | None, link: float | None) -> str:
    parts = []
    if result.get("compute") is not None:
        parts.append(f"compute {result['compute']:.3f} s" + (f" (median {compute:.3f} s)" if compute else ""))
    if result.get("link") is not None:
        parts.append(f"link {result['link'] * 1000:.1f} ms" + (f" (median {link * 1000:.1f} ms)" if link else ""))
    if result.get("allreduce") is not None:
        parts.append(f"all-reduce {result['allreduce'] * 1000:.1f} ms")
    return ", ".join(parts) or "no numbers"


class Preflight:
    """One agent's pre-flight: probe, publish, (node 0) judge, act on the verdict."""

    def __init__(self, ctx: PreflightContext, backend: Callable[[], str]):
        """Its long waits say every few seconds what they wait for through `ctx.announce`
        (agent/rounds/node_waits.py)."""
        self.ctx = ctx
        self.backend = backend  # the process-group backend the job's workers would use (nccl with GPUs, else gloo)
        self.spec, self.host, self.events, self.report = ctx.spec, ctx.host, ctx.events, ctx.report
        self.store_call, self.base_env, self.run_dir, self.announce = (
            ctx.store_call, ctx.base_env, ctx.run_dir, ctx.announce
        )  # fmt: skip
        self.last: dict | None = None  # this node's numbers and the verdict's summary, for its status record
        self.left_out: dict[int, str] = {}  # round -> the line this node leaves with
        self.own_template: TemplateClient | None = (
            None  # preloads torch for the first probe when the job has no worker template
        )
        self.template_wait = (
            0.0  # of the last probe: waiting for the template's preload, which the workers wait for too
        )

    def start_template(self) -> None:
        """A job whose workers start plainly (a script without torch, --no-preload) has no template
        to fork the probe from: start one now, so torch loads while the rendezvous runs (a plain
        probe would import it after the round formed: 2 s here, 7 s on a busy machine). It is
        stopped after the first probe; a later one (after a membership change) starts plainly."""
        if self.ctx.template is not None or not self.spec.preflight:
            return
        from rally.agent.base.spec import BOOTSTRAP, shared_worker_env

        argv = [self.spec.python_exec, "-u", BOOTSTRAP, "script", PROBE]
        self.own_template = TemplateClient(
            self.spec.python_exec,
            BOOTSTRAP,
            argv,
            ("torch", "torch.distributed"),
            shared_worker_env(self.spec, self.base_env),
            os.getcwd(),
            console.warn,
            self.announce,
        )
        try:
            self.own_template.start()
        except OSError:
            self.own_template = None

    def stop_template(self, grace: float | None = None) -> None:
        """`grace`: how long it may take to leave by itself before SIGKILL (default: the template's own)."""
        if self.own_template is not None:
            if grace is None:
                self.own_template.stop()
            else:
                self.own_template.stop(grace)
            self.own_template = None

    def due(self, rnd: Round) -> bool:
        """Every node decides the same from the store: not after a failure on the same nodes, nor
        when the round re-forms with the nodes a pre-flight just passed (those it left out gone)."""
        a, rdzv = rnd.assignment, rnd.rendezvous
        if a.group_world_size < 2:
            return False
        if self.spec.preflight_every_round or a.round == 0:
            return True
        before, now, end = rdzv.round_record(a.round - 1), rdzv.round_record(a.round), rdzv.round_end(a.round - 1)
        if not (before and now and end):
            return True
        left_out = (end.info or {}).get("preflight")
        if end.kind is EndKind.NODE_LEFT and isinstance(left_out, list):
            return now.members != before.members - len(left_out)
        return not (end.kind in FAILURE_KINDS and before.members == now.members)

    def run(self, rnd: Round, master: tuple[str, int]) -> RoundEnd | None:
        a = rnd.assignment
        if not self.store_call(lambda: self.due(rnd)):
            self.stop_template()  # the next probe, if any, starts plainly
            return None
        started = time.monotonic()
        result = {"host": self.host, **self._probe(a, master)}
        self.store_call(lambda: rnd.store.set(preflight_key(a.round, f"result/{a.group_rank}"), json.dumps(result)))
        verdict: dict | None
        if a.group_rank == 0:
            verdict = self.store_call(lambda: self._judge(rnd), waiting=True)
        else:
            verdict = self.store_call(lambda: self._read_verdict(rnd), waiting=True)
        seconds = time.monotonic() - started
        if verdict is None:
            console.warn(f"pre-flight: no verdict from node 0 within {VERDICT_WAIT_SECONDS:g} s; going on without one")
            return None
        return self._act(rnd, verdict, result, seconds)

    # ------------------------------------------------------------------ steps
    def _probe(self, assignment: Assignment, master: tuple[str, int]) -> dict:
        from rally.agent.base.spec import BOOTSTRAP, shared_worker_env
        from rally.agent.guard import processes

        out = self.run_dir / f"preflight_{assignment.round}.json"
        out.unlink(missing_ok=True)
        env = {
            **shared_worker_env(self.spec, self.base_env),
            "RANK": str(assignment.group_rank),
            "WORLD_SIZE": str(assignment.group_world_size),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
            "RALLY_PREFLIGHT_OUT": str(out),
            "RALLY_PREFLIGHT_PREFIX": f"rally-preflight/{assignment.round}/",
            "RALLY_PREFLIGHT_TIMEOUT": str(PROBE_TIMEOUT_SECONDS),
            "RALLY_PREFLIGHT_BACKEND": self.backend(),
        }
        template = self.ctx.template or self.own_template
        launch = template.spawn if template is not None else processes.spawn
        asked = time.monotonic()
        with open(
            self.run_dir / f"preflight_{assignment.round}.log", "wb"
        ) as log:  # a template still loading torch is waited for here
            child = launch([self.spec.python_exec, "-u", BOOTSTRAP, "script", PROBE], env, None, log, log)
        self.template_wait = time.monotonic() - asked
        try:
            what = (
                f"pre-flight of round {assignment.round}: waiting for the probe "
                f"(pid {child.pid}: compute, all-reduce, links) "
                "to finish"
            )
            code = self.store_call(
                # wait: bounded, said by Preflight._probe: PROBE_TIMEOUT_SECONDS + 10 (30 s), through store_call:
                #   signals and the store probe stay live
                lambda: wait_in_slices(
                    child.wait, PROBE_TIMEOUT_SECONDS + 10, what, self.announce, done=lambda c: c is not None
                ),
                waiting=True,
            )
        finally:
            if child.returncode is None:
                os.killpg(child.pid, signal.SIGKILL)
                # wait: short: timeout=5 after SIGKILL of the probe's process group
                child.wait(5)
        # Nothing else is forked from it and its probe has exited: killed at once. A torch-loaded
        # interpreter's own exit (up to the 0.2 s grace, then SIGKILL anyway) would delay this
        # node's numbers, and so the verdict every node waits for, by 0.2-0.4 s (measured, issue 41).
        self.stop_template(grace=0.0)
        try:
            return json.loads(out.read_text())
        except (OSError, ValueError):
            log_path = (
                f"{self.run_dir.resolve()}/preflight_{assignment.round}.log"  # the real path, not /proc/<pid>/fd/<n>
            )
            return {"error": f"the probe exited with {code} and wrote no result (see {log_path})"}

    def _results(self, rnd: Round, wait: float) -> dict[int, dict | None]:
        a, store = rnd.assignment, rnd.store
        names = [preflight_key(a.round, f"result/{g}") for g in range(a.group_world_size)]
        what = f"pre-flight of round {a.round}: waiting for every node's probe results to judge them"
        # wait wait_in_slices: bounded, said by Preflight._results: node 0 waits VERDICT_WAIT_SECONDS (30 s) for the
        #   slowest node's numbers
        # wait store.try_wait: slice, said by Preflight._results: one slice
        wait_in_slices(lambda t: store.try_wait(names, t), wait, what, self.announce)
        present = store.read_present(names)  # one request on etcd; a slow node's result may be absent
        found: dict[int, dict | None] = {}
        for g, name in enumerate(names):
            raw = present.get(name)
            try:
                value = json.loads(raw) if isinstance(raw, bytes) else None
            except ValueError:
                value = None
            found[g] = value if isinstance(value, dict) else None
        return found

    def _judge(self, rnd: Round) -> dict:
        a, store = rnd.assignment, rnd.store
        verdict = judge(self._results(rnd, VERDICT_WAIT_SECONDS), self.spec.preflight_factor, rnd.settings.min_nodes)
        verdict["round"] = a.round
        save_preflight(store, verdict)  # for `rally status`
        if verdict["left_out"]:
            names = ", ".join(n["host"] for n in verdict["nodes"] if n["group_rank"] in verdict["left_out"])
            rnd.channel.count_lost(len(verdict["left_out"]))  # the re-formed round does not wait for them
            store.set(preflight_key(a.round, "verdict"), json.dumps(verdict))
            rnd.channel.end(
                RoundEnd(
                    EndKind.NODE_LEFT, f"pre-flight left out {names}", self.host, {"preflight": verdict["left_out"]}
                )
            )
        else:
            store.set(preflight_key(a.round, "verdict"), json.dumps(verdict))
        return verdict

    def _read_verdict(self, rnd: Round) -> dict | None:
        name = preflight_key(rnd.assignment.round, "verdict")
        what = f"pre-flight of round {rnd.assignment.round}: waiting for node 0's verdict"
        bound = PROBE_TIMEOUT_SECONDS + VERDICT_WAIT_SECONDS
        # wait wait_in_slices: bounded, said by Preflight._read_verdict: PROBE_TIMEOUT_SECONDS + VERDICT_WAIT_SECONDS
        #   (50 s)
        # wait rnd.store.try_wait: slice, said by Preflight._read_verdict: one slice
        if not wait_in_slices(lambda t: rnd.store.try_wait([name], t), bound, what, self.announce):
            return None
        try:
            verdict = json.loads(rnd.store.get(name))
        except ValueError:
            return None
        return verdict if isinstance(verdict, dict) and isinstance(verdict.get("nodes"), list) else None

    def _act(self, rnd: Round, verdict: dict, mine: dict, seconds: float) -> RoundEnd | None:
        a = rnd.assignment
        left_out, kept = set(verdict.get("left_out") or []), set(verdict.get("kept_bad") or [])
        waited = (
            f" ({self.template_wait:.2f} s of it waiting for the worker template to load torch)"
            if self.template_wait >= 0.1
            else ""
        )
        console.say(f"pre-flight of round {a.round} took {seconds:.2f} s{waited}: {verdict.get('summary', '')}")
        for node in verdict["nodes"]:
            if node.get("group_rank") in left_out:
                console.warn(f"pre-flight: node {node.get('host')} is left out of the round: {node.get('line')}")
            elif node.get("group_rank") in kept:
                console.warn(
                    f"pre-flight: node {node.get('host')}: {node.get('bad')}; kept: {verdict.get('summary')}; "
                    f"going on with it ({node.get('numbers')})"
                )
        self.events.emit(
            "preflight",
            round=a.round,
            seconds=round(seconds, 3),
            template_wait=round(self.template_wait, 3),
            nodes=verdict["nodes"],
            left_out=sorted(left_out),
            kept_bad=sorted(kept),
        )
        me: dict[str, Any] = next((n for n in verdict["nodes"] if n.get("group_rank") == a.group_rank), {})
        self.last = {
            "round": a.round,
            "seconds": seconds,
            "compute": mine.get("compute"),
            "link": mine.get("link"),
            "allreduce": mine.get("allreduce"),
            "bad": me.get("bad", ""),
            "left_out": [n["host"] for n in verdict["nodes"] if n.get("group_rank") in left_out],
        }
        if not left_out:
            return None
        if a.group_rank in left_out:
            self.left_out[a.round] = (
                f"node {self.host} is left out by the pre-flight check: {me.get('line')}; the job goes on without it"
            )
            self.report.outcome = "left out by pre-flight"
        # wait: slice: 5 s slices for the round's end after a node was left out
        return self.store_call(lambda: rnd.channel.wait_end(5.0), waiting=True)

    def left_out_line(self, assignment: Assignment, end: RoundEnd) -> str | None:
        return self.left_out.pop(assignment.round, None)
