"""`BackgroundWriter`: one thread per session that writes statistics batches to thread-safe sinks.

Why: formatting and writing a step's statistics (text lines, JSONL lines, TensorBoard events) is pure host work;
done inside `debug_api.step()` it keeps the training loop (and the GPU it feeds) waiting.  `MetricLogger` in
background mode hands each step's batch to this writer and returns.

Guarantee (what is on disk when): after `debug_api.step()` returns for iteration N, iteration N-1 (and everything
logged before it) is written and flushed to every sink; iteration N is written at the start of the next `step()` (the
writer
works while the training thread waits with the GIL released and the GPU still runs its queued kernels, see
`DebugSession.step`), or at the latest when the session is flushed or closed
(`DebugSession.flush`, `debug_api.end_debug()`) or the interpreter exits normally (the atexit handler of
`tedebug.debug_api` drains and joins the writer; an uncaught exception in iteration N+1 therefore still leaves
iteration N on disk).  ``os._exit``, a fatal signal or a hard crash of the process skip atexit and can lose
iteration N (never N-1).  With ``background_logging=False`` nothing is deferred: iteration N is on disk when
`step()` returns.

Protocol (one job in flight, so memory stays bounded):

* `submit(sinks, chunks)` first waits until the previous job is written and flushed, then hands over the new one:
  every sink of `sinks`, in order, receives every chunk (a sequence of records, such as a list or a
  `tedebug.sinks.batch.ScalarBatch`, or a callable returning one, called once on the writer thread) through
  `Sink.log_scalars`, in order, then `Sink.flush()`.  A sink that raises does not stop the others (they still get
  the batch).
* `wait()` blocks until the job in flight is done.  `stop()` waits, then ends and joins the thread (a later
  `submit` starts a new one).
* `write_now(sinks, chunks)` is `submit` followed by `wait()` without the thread: after the job in flight, the caller
  writes the job itself, with the same order, flushes and error records (a `KeyboardInterrupt` or `SystemExit` in it
  propagates at once).  A caller that would only wait for the thread saves the hand-over and the two threads'
  contention for the GIL: `DebugSession.step` waits for iteration N-1 anyway, so it writes this way (about 9 µs
  less host time per logged tensor on the CPU probe).
* Errors raised by a sink in the thread are never swallowed: the first one of a job is kept and `take_error()`
  returns it (as `BackgroundSinkError`, naming the sink and the iterations, with the original exception as its
  ``__cause__`` and every failing sink in ``failures``) so that `MetricLogger` re-raises or reports it in the
  caller's thread.  With ``skip_failed=True`` (`MetricLogger`'s ``on_sink_error="warn"``) a sink that failed once is
  never called again by this writer (a full disk is not retried every step); the other sinks go on.

The thread is a daemon (a non-daemon thread would make the interpreter wait for it *before* atexit handlers run, so
a blocked writer could never be told to finish); the session's atexit handler drains it instead
(`tedebug.debug_api`, `DebugSession.flush`).  After `os.fork()` the child gets a fresh writer state.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, List, Optional, Sequence, Tuple, Type

#: one scalar: (name, value, iteration, layer, tensor, stat), as `tedebug.sinks.base.Record`
Record = Tuple[str, Any, int, Optional[str], Optional[str], Optional[str]]

#: how often (seconds) a waiting caller checks that the writer thread is still alive
_LIVENESS_POLL_S = 0.5


class BackgroundSinkError(RuntimeError):
    """A statistics sink failed in the background writer; ``sink`` is the sink, ``__cause__`` the original error."""

    def __init__(
        self, message: str, sink: Any, failures: Sequence[Tuple[Any, BaseException]] = (), iterations: str = ""
    ):
        super().__init__(message)
        self.sink = sink
        #: (sink, exception) of every sink that failed (empty when building the batch failed)
        self.failures: List[Tuple[Any, BaseException]] = list(failures)
        #: the iterations of the batch, as text ("3, 4")
        self.iterations = iterations


def describe_sink(sink: Any) -> str:
    """``TypeName('path')`` when the sink has a ``path`` attribute, else ``TypeName``."""
    path = getattr(sink, "path", None)
    return f"{type(sink).__name__}({path!r})" if isinstance(path, (str, os.PathLike)) else type(sink).__name__


def iterations_text(chunks: Sequence[Sequence[Record]]) -> str:
    """The iterations of the records of `chunks`, first-seen order, as text ("3, 4"; "none").  A
    `tedebug.sinks.batch.ScalarBatch` answers from its rows (its records are not built for this)."""
    seen: dict = {}
    for chunk in chunks:
        row_iterations = getattr(chunk, "row_iterations", None)
        if row_iterations is None:
            seen.update(dict.fromkeys(record[2] for record in chunk))
        else:
            iteration = chunk.iteration  # type: ignore[attr-defined]  # (a ScalarBatch)
            seen.update(dict.fromkeys([iteration] if iteration is not None else row_iterations()))
    return ", ".join(map(str, seen)) or "none"


def sink_failure_error(
    failures: Sequence[Tuple[Any, BaseException]], iterations: str, where: str = "tedebug's background writer"
) -> BackgroundSinkError:
    """The error of a job in which `failures` ((sink, exception), first failure first) happened, for the caller's
    thread to raise or report; `where` names the writer."""
    sink, exc = failures[0]
    message = (
        f"statistics sink {describe_sink(sink)} failed in {where} while writing iteration(s) {iterations}: "
        f"{type(exc).__name__}: {exc}"
    )
    if len(failures) > 1:
        others = "; ".join(f"{describe_sink(s)}: {type(e).__name__}: {e}" for s, e in failures[1:])
        message += f" (also failed: {others})"
    error = BackgroundSinkError(message, sink, failures, iterations)
    error.__cause__ = exc
    return error


def merged_errors(errors: List[BackgroundSinkError]) -> Optional[BackgroundSinkError]:
    """The first of `errors` with the later ones attached (as notes, and their failures), or None when empty."""
    if not errors:
        return None
    for later in errors[1:]:
        if hasattr(errors[0], "add_note"):  # Python 3.11+
            errors[0].add_note(f"a later batch also failed: {later}")
        errors[0].failures.extend(later.failures)
    return errors[0]


Job = Tuple[Tuple[Any, ...], List[Any]]


class BackgroundWriter:
    """Writes jobs ``(sinks, chunks)`` on one daemon thread; see the module docstring."""

    def __init__(self, name: str = "tedebug-stats-writer", *, skip_failed: bool = False) -> None:
        self.name = name
        self.skip_failed = skip_failed
        self._failed: set = set()  # ids of the sinks that failed (skipped when `skip_failed`)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._thread: Optional[threading.Thread] = None
        self._jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._errors: List[BackgroundSinkError] = []

    # ------------------------------------------------------------------------------------------- caller thread
    def submit(self, sinks: Sequence[Any], chunks: List[Any]) -> None:
        """Wait for the job in flight, then hand over `chunks` for `sinks` (written and flushed on the thread)."""
        if os.getpid() != self._pid:  # forked child: the parent's thread does not exist here
            self._reset()
        self.wait()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._idle.clear()
        self._jobs.put((tuple(sinks), chunks))

    def write_now(self, sinks: Sequence[Any], chunks: List[Any]) -> None:
        """Wait for the job in flight, then write `chunks` to `sinks` in the caller's thread (see the module
        docstring): errors are kept for `take_error()` as the thread keeps them; an interrupt propagates."""
        if os.getpid() != self._pid:  # forked child: the parent's thread does not exist here
            self._reset()
        self.wait()
        self._write(tuple(sinks), chunks, catch=Exception)

    def wait(self) -> None:
        """Block until the job in flight (if any) is written and flushed."""
        if self._idle.is_set() or os.getpid() != self._pid:
            return
        while not self._idle.wait(_LIVENESS_POLL_S):
            if self._thread is None or not self._thread.is_alive():
                raise RuntimeError(
                    f"tedebug's statistics writer thread {self.name!r} ended with a job in flight; "
                    f"that batch of statistics was not written"
                )

    def take_error(self) -> Optional[BackgroundSinkError]:
        """The first error of the finished jobs not yet taken (later ones attached as notes), or None."""
        errors, self._errors = self._errors, []
        return merged_errors(errors)

    def stop(self) -> None:
        """Wait for the job in flight, end the thread and join it."""
        if os.getpid() != self._pid:
            self._reset()
            return
        self.wait()
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join()

    # ------------------------------------------------------------------------------------------- writer thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write(*job)
            finally:
                self._idle.set()

    def _write(self, sinks: Tuple[Any, ...], chunks: List[Any], catch: Type[BaseException] = BaseException) -> None:
        """Write one job; the errors of class `catch` are kept (on the thread: every error, re-raised in the caller's
        thread; in the caller's thread, `write_now`: `Exception`, so that an interrupt is not kept)."""
        try:  # deferred chunks (`MetricLogger.log_deferred`) are built here, once for every sink
            chunks = [chunk() if callable(chunk) else chunk for chunk in chunks]
        except catch as exc:  # kept and re-raised in the caller's thread (never swallowed)
            error = BackgroundSinkError(
                f"tedebug's background writer could not build a batch of statistics: {type(exc).__name__}: {exc}", None
            )
            error.__cause__ = exc
            self._errors.append(error)
            return
        failures = []
        failed = self._failed
        for sink in sinks:
            if id(sink) in failed:
                continue
            try:
                for chunk in chunks:
                    sink.log_scalars(chunk)
                sink.flush()
            except catch as exc:  # kept and re-raised in the caller's thread (never swallowed)
                failures.append((sink, exc))
                if self.skip_failed:
                    failed.add(id(sink))
        if failures:
            self._errors.append(sink_failure_error(failures, iterations_text(chunks)))
