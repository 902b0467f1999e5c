"""The worker's side of preemption: a flag and callbacks that a preemption signal sets and runs
instead of killing the worker (the agent forwards the scheduler's warning signal, agent/preemption.py).
Part of `rally.job` (agent/worker_side/job.py re-exports `preempted`, `on_preempt`,
`install_preemption_handler` and the signal parsing); a module of its own because it holds the
process's signal state, and standard library only because rally's bootstrap installs the handler
in every worker before the script's first line: importing all of `rally.job` there (its checkpoint
modules) cost every plainly started worker ~0.12 s of CPU for a handler that needs none of it."""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Callable, Iterable

# The environment variable the agent lists the signals in (agent/rounds/workers.py), SIGUSR1 and
# SIGUSR2 by default.
PREEMPT_SIGNALS_ENV = "RALLY_PREEMPT_SIGNALS"

_preempted = False
_preempt_callbacks: list[Callable[[int], object]] = []
_in_callbacks = False


def preempted() -> bool:
    """Whether a preemption warning has arrived: save a checkpoint and exit when it turns true.

    rally forwards its `--preemption-signals` (SIGUSR1, SIGUSR2: SLURM's time-limit and preemption
    warnings) to the workers, where rally's bootstrap turns them into this flag instead of killing
    the worker; the workers then have `--preemption-grace` seconds to save ([SLURM](slurm.md)).

    Returns:
        True once such a signal has arrived in this worker; it stays true.

    Examples:
        >>> if job.preempted():
        ...     job.save({"model": model.state_dict()}, step)
        ...     sys.exit(0)
    """
    return _preempted


def on_preempt(callback: Callable[[int], object]) -> None:
    """Call `callback(signum)` each time a preemption signal arrives.

    Callbacks run as Python signal handlers do: in the main thread, between two bytecodes of
    whatever it was doing, possibly inside a collective. Keep them short: set a flag or log a line,
    and let the loop act on `preempted()`; never start a collective or a save from one. An exception
    from a callback is printed to stderr and swallowed. Callbacks registered after a signal are not
    called for that past signal.

    Args:
        callback: Called with the signal's number.

    Examples:
        >>> job.on_preempt(lambda signum: print(f"got signal {signum}; saving at the next step"))
    """
    _preempt_callbacks.append(callback)


def install_preemption_handler(signums: Iterable[int]) -> None:
    """Catch `signums` so that they mark the worker preempted instead of killing it.

    Called by rally's worker bootstrap before the training script runs, with the signals from
    RALLY_PREEMPT_SIGNALS (`context().preempt_signals`), so a forwarded SIGUSR1 never kills a
    worker whose script ignores preemption. Must run in the main thread (a Python rule).
    """
    for signum in signums:
        signal.signal(signum, _handle_preemption)


def _handle_preemption(signum: int, frame: object) -> None:
    global _preempted, _in_callbacks
    _preempted = True
    if _in_callbacks:
        return
    _in_callbacks = True
    try:
        for callback in list(_preempt_callbacks):
            try:
                callback(signum)
            except Exception:
                print(f"rally: preemption callback {callback!r} failed:", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)
    finally:
        _in_callbacks = False


def to_signal(item: str) -> signal.Signals:
    """`"SIGUSR1"`, `"usr1"` or `"10"` as a signal: rally's one reading of a signal's name
    (flags, config, RALLY_PREEMPT_SIGNALS). KeyError or ValueError when there is no such signal."""
    name = item.strip().upper()
    return (
        signal.Signals(int(name))
        if name.isdigit()
        else signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    )


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """Parse `"SIGUSR1,TERM,12"` into signals; the format of RALLY_PREEMPT_SIGNALS."""
    signals: list[signal.Signals] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            signals.append(to_signal(item))
        except (KeyError, ValueError):
            raise ValueError(
                f"rally: unknown signal {item!r} in {PREEMPT_SIGNALS_ENV}; use names like SIGUSR1,SIGTERM"
            ) from None
    return tuple(signals)
