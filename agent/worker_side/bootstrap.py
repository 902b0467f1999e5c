"""Runs a training script as `__main__`, after installing what rally needs in every worker.

Started as `python -u <path>/agent/worker_side/bootstrap.py {script|module|path} TARGET ARGS...` (by file
path, not `-m`, so a user package that happens to be called `agent` cannot shadow it). Before
the script runs it:

* registers faulthandler on RALLY_STACK_SIGNAL, so the agent can ask a hung worker for the
  Python stacks of all its threads without the script's help (written to RALLY_STACK_FILE, a
  file of the agent's, not to stderr: the agent shows them once, in its report);
* installs the preemption handler for the signals in RALLY_PREEMPT_SIGNALS, so a forwarded
  SLURM warning signal sets a flag instead of killing a worker that did not ask for it;

and then becomes exactly what `python script.py args` would be: sys.argv, sys.path[0],
`__main__`, and the same traceback and exit code on an uncaught exception (the frames of
this file and of runpy are removed from the traceback). Only the standard library is
imported here, so it costs nothing measurable.

The same file is also the worker template (`python -u <path>/agent/worker_side/bootstrap.py template`,
see agent/template/client.py): a process that imports the heavy modules once and forks a worker
per request. `serve_as_template` returns only in a forked child, already turned into a fresh
worker (session, fds, cwd, environment, signals, RNGs), and the child then runs `run()` from
this file's top level exactly as a plainly started worker does, so the frames, the exit
code and the interpreter's shutdown are the same in both.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import zipfile
from collections.abc import Callable


def _bind_cpus() -> None:
    """--numa-binding: a template-forked worker binds itself here (a plain start already is)."""
    text = os.environ.get("RALLY_CPU_AFFINITY")
    if text:
        from rally.agent.base.numa import apply_from_environment

        apply_from_environment()


_stack_file = None  # kept open for faulthandler, which holds only its file descriptor


def install_stack_dump() -> None:
    global _stack_file
    signum = os.environ.get("RALLY_STACK_SIGNAL")
    if not signum:
        return
    target = sys.stderr
    path = os.environ.get("RALLY_STACK_FILE")
    if path:
        try:
            target = _stack_file = open(path, "a")  # noqa: SIM115 - lives as long as the worker
        except OSError:
            pass  # stderr, as before: the stacks then also show among the worker's output
    faulthandler.register(int(signum), file=target, all_threads=True, chain=False)


def install_preemption_handler() -> None:
    names = os.environ.get("RALLY_PREEMPT_SIGNALS")
    if not names:
        return
    # Only the flag's module (standard library), not all of rally.job: a script that never imports
    # rally.job does not pay for its checkpoint modules before its first line.
    from rally.agent.worker_side import preemption_flag

    preemption_flag.install_preemption_handler([int(s) for s in preemption_flag.parse_signals(names)])


def _strip_own_frames(tb):  # traceback objects
    """Drop leading frames that belong to this bootstrap or to runpy."""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename == __file__ or "runpy" in filename:
            tb = tb.tb_next
        else:
            break
    return tb


def run_file_as_main(target: str) -> None:
    """Execute a script file as `__main__`, the way `python script.py` does.

    Not runpy.run_path: that rewrites sys.argv[0] to the path it was given, and python
    keeps argv[0] as typed while giving `__file__` the absolute path.
    """
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(target)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __builtins__=builtins,
        __loader__=SourceFileLoader("__main__", path),
        __spec__=None,
        __package__=None,
        __cached__=None,
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _report(exc: BaseException) -> None:
    exc.__traceback__ = _strip_own_frames(exc.__traceback__)
    sys.excepthook(type(exc), exc, exc.__traceback__)


def start_resume_prefetch() -> None:
    """On a restart under the memory tier, map the checkpoint to resume from while the script starts."""
    if os.environ.get("RALLY_CKPT_HOLDER"):  # client.HOLDER_ENV, read here so other jobs import nothing more
        from rally.agent.checkpoint.core import resume_prefetch

        resume_prefetch.start()


def defer_init_in_spare() -> None:
    """A warm spare (`--warm-spares`) runs its script up to rally.job.run without a rank."""
    if os.environ.get("RALLY_REENTRY_SPARE") == "1":  # reentry_wire.SPARE_ENV
        from rally.agent.worker_side import restartable

        restartable.defer_init_in_spare()


def run(mode: str, target: str, args: list[str]) -> None:
    _bind_cpus()
    install_stack_dump()
    install_preemption_handler()
    start_resume_prefetch()
    defer_init_in_spare()
    runner: Callable[[], object]  # runs the program; what it returns is dropped
    if mode == "module":
        sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
        sys.path[0] = os.getcwd()
        runner = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        if os.path.isfile(target) and not zipfile.is_zipfile(target):
            runner = lambda: run_file_as_main(target)  # noqa: E731
        else:  # a directory or zip archive with __main__.py, as `python DIR` accepts
            runner = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    try:
        runner()
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        _report(exc)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # exit "killed by SIGINT", as python itself does
    except BaseException as exc:  # reported exactly as the interpreter would
        _report(exc)
        sys.exit(1)


def serve_as_template() -> tuple[str, str, list[str]]:
    """Serve as this node's worker template; returns (mode, target, args) in each forked worker."""
    from rally.agent.template import server as template_server

    return template_server.serve()


if __name__ == "__main__":
    # python put this file's folder (rally's agent/) first on sys.path; take it off before
    # anything is imported, so none of rally's modules can shadow a module of the user's.
    # run() sets sys.path[0] to what the script would have (the template sets it per preload).
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = os.getcwd()
    if sys.argv[1] == "template":
        _mode, _target, _args = serve_as_template()
    else:
        _mode, _target, _args = sys.argv[1], sys.argv[2], sys.argv[3:]
    # wait: not_a_wait: the worker's own program
    run(_mode, _target, _args)
