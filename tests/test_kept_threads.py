"""agent/base/kept_threads.py: the calls a worker makes at every re-entry (its teardown, its resume
prefetch) run in a thread kept for the next call, not in a new thread each (a new thread each time
spread what rounds keep over glibc's arenas: tests/test_inprocess_restart.py's memory bound)."""

from __future__ import annotations

import os
import threading

import pytest

from rally.agent.base.kept_threads import Pool


@pytest.mark.timeout(30)
def test_calls_one_after_another_run_in_the_same_kept_thread() -> None:
    pool = Pool("test-kept")
    seen: list[int | None] = []
    for _ in range(5):
        call = pool.start(lambda: seen.append(threading.get_ident()))
        call.join(5)
        assert not call.is_alive()
    assert len(seen) == 5 and len(set(seen)) == 1, f"a new thread per call: {seen}"
    assert [t.name for t in threading.enumerate() if t.ident == seen[0]] == ["test-kept"]


@pytest.mark.timeout(30)
def test_a_call_given_while_another_runs_is_not_delayed_by_it() -> None:
    pool = Pool("test-kept-busy")
    release, started = threading.Event(), threading.Event()
    idents: list[int | None] = []

    def slow() -> None:
        idents.append(threading.get_ident())
        started.set()
        release.wait(10)

    busy = pool.start(slow)
    assert started.wait(5)
    quick = pool.start(lambda: idents.append(threading.get_ident()))
    quick.join(5)
    assert not quick.is_alive(), "the second call waited for the first"
    busy.join(0.05)
    assert busy.is_alive(), "join returned a call still running as finished"
    release.set()
    busy.join(5)
    assert not busy.is_alive()
    assert len(set(idents)) == 2
    # both threads are idle now: the next call takes one of them, no third thread
    third = pool.start(lambda: idents.append(threading.get_ident()))
    third.join(5)
    assert idents[-1] in idents[:2]


@pytest.mark.timeout(30)
def test_a_forked_child_runs_its_calls_in_threads_of_its_own() -> None:
    pool = Pool("test-kept-fork")
    pool.start(lambda: None).join(5)  # an idle kept thread in this process, none in a child
    pid = os.fork()
    if pid == 0:  # the child: its call must run, not wait for the parent's thread
        ran = threading.Event()
        pool.start(ran.set).join(5)
        os._exit(0 if ran.is_set() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's call waited for a thread that only the parent has"
