"""`BuildOnce`: one build per process whoever asks, the outcome kept, a failure said once, a fork that can build."""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
import warnings

import pytest

from tedebug.backends.build_once import BuildOnce


class Builds:
    """A build that counts its runs and answers `outcome` after `delay` seconds."""

    def __init__(self, outcome=("helper", ""), delay: float = 0.0) -> None:
        self.outcome = outcome
        self.delay = delay
        self.runs = 0

    def __call__(self):
        self.runs += 1
        time.sleep(self.delay)
        return self.outcome


def _say(why: str) -> str:
    return f"could not be built ({why})"


def test_threads_that_ask_at_once_build_once():
    build = Builds(delay=0.2)
    once = BuildOnce(build, _say)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(once.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.runs == 1
    assert answers == [("helper", "")] * 8
    assert once.reason() == ""


def test_a_failure_is_said_once_and_kept():
    build = Builds(outcome=(None, "cc: exit status 1"))
    once = BuildOnce(build, _say)
    assert once.reason() == ""  # (before the build)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(cc: exit status 1\)"):
        assert once.get() == (None, "cc: exit status 1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert once.get() == (None, "cc: exit status 1")
    assert build.runs == 1 and once.reason() == "cc: exit status 1"


def test_nothing_is_said_where_the_warning_has_no_text_or_the_caller_asks_for_none():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert BuildOnce(Builds(outcome=(None, "no compiler")), lambda why: None).get() == (None, "no compiler")
        assert BuildOnce(Builds(outcome=(None, "broken")), _say).get(warn=False) == (None, "broken")


def test_the_warning_names_the_line_stacklevel_says():
    once = BuildOnce(Builds(outcome=(None, "broken")), _say, stacklevel=3)

    def load():  # a helper's loader: stacklevel 3 names the line that called it
        return once.get()

    with pytest.warns(RuntimeWarning) as said:
        line = inspect.currentframe().f_lineno + 1
        load()
    assert (said[0].filename, said[0].lineno) == (__file__, line)


def test_forget_builds_again():
    build = Builds()
    once = BuildOnce(build, _say)
    once.get()
    once.forget()
    assert once.outcome is None
    once.get()
    assert build.runs == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_while_a_thread_builds_can_build():
    """The parent's thread holds the lock while it builds; the child, without that thread, gets a new lock and
    builds for itself (with the parent's lock it would wait forever: the alarm ends it)."""
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(30)
        return ("parent's", "")

    once = BuildOnce(slow, _say)
    builder = threading.Thread(target=once.get)
    builder.start()
    assert started.wait(30)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (fork of a process with threads)
            pid = os.fork()
        if pid == 0:  # the child
            signal.alarm(20)
            once._build = lambda: ("child's", "")
            os._exit(0 if once.get() == ("child's", "") else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        builder.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert once.get() == ("parent's", "")
