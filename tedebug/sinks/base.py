"""The statistics sink interface (`Sink`) and the per-session fan-out (`MetricLogger`).

Every statistic is emitted once, through `MetricLogger.log_scalar(name, value, iteration, *, layer, tensor, stat)`,
and fanned out to every sink of the session.  `MetricLogger.log_scalars(records)` emits a batch (the statistics of
one step): each `Sink` receives it through `Sink.log_scalars` (by default one `log_scalar` call per record, in
order; the file sinks write a batch at once), any other object one ``log_scalar`` call per record.  A batch is any
sequence of records; the statistics engine emits a `tedebug.sinks.batch.ScalarBatch` (immutable, so it is queued for
the writer as it is, and its records are only built if a sink iterates them).  Sinks derived from `Sink` receive the
structured keywords; any other object with a ``log_scalar(name, value, iteration)`` method (an nvdlfw
``BaseLogger``, a W&B adapter) receives only the three positional values.

nvdlfw compatibility: ``MetricLogger.add_logger(sink)`` and ``MetricLogger.log_scalar(name, value, iteration)``
also work when called on the *class* (as frameworks and TE-style custom features do); they then act on the active
session (``add_logger`` before initialize queues the sink for the next session, see
`add_statistics_sink`).

Background mode (``MetricLogger(background=True)``; what a debug session uses unless
``initialize(..., background_logging=False)``): sinks that declare ``thread_safe = True`` (tedebug's text, JSONL and
TensorBoard sinks) are written by one `tedebug.sinks.background.BackgroundWriter` thread per logger.  In the
caller's thread `log_scalars` / `log_scalar` only queue the records for them; `flush()` (once per
`debug_api.step()`) waits until the previous batch is written and flushed, hands the queued batch over, and
returns.  Every other sink (user objects, nvdlfw loggers, W&B adapters, `Sink` subclasses that do not declare
themselves thread-safe) is still called synchronously in the caller's thread, in order.  Guarantee: when
`debug_api.step()` returns for iteration N, every statistic of earlier iterations is written and flushed to every
sink; iteration N's are written by the writer thread meanwhile, and at the latest by `drain()`, `close()`
(`debug_api.end_debug()`) or the session's atexit handler (normal interpreter exit, including an uncaught
exception; not ``os._exit`` or a fatal signal).  An error raised by a sink on the writer thread is re-raised in the
caller's thread (as `BackgroundSinkError`, naming the sink) at the next `log_scalars`, `log_scalar`, `flush`,
`drain` or `close`; the other sinks still receive the batch.  In synchronous mode (the default of
``MetricLogger()``) every call is made in the caller's thread.

Writer process (``MetricLogger(background=True, writer_process=True)``; what a debug session uses unless
``initialize(..., background_logging=True / False)``): the sinks that say how to make their twin in another process
(`Sink.writer_process_spec`: tedebug's text and JSONL files) are written by a process of their own
(`tedebug.sinks.process_writer`) instead of the writer thread; the others as above.  The hand-over of a batch
builds its `log_deferred` builders in the caller's thread, except a `DeferredBatch` that no writer-thread sink
needs (the writer process runs its final formulas), and returns once the process has written the previous batch;
its errors come back as the writer thread's do, one batch later.  If the process cannot take a sink, that is
reported once and the thread writes it.

Sink errors (``MetricLogger(on_sink_error=...)``): with ``"raise"`` (the default of a bare `MetricLogger`, and
``initialize(..., on_sink_error="raise")``) a sink error propagates as described above.  With ``"warn"`` (what a
debug session uses by default) a debugging tool never takes the training run down: the first error of a sink (in
`log_scalar(s)`, `flush`, `close`, on the writer thread or in the caller's) is reported once through `report`
(the session's main log, WARNING, which also reaches stderr), naming the sink, its file, the iterations and the
errno, and that sink is stopped for the rest of the session; every other sink goes on.  The file sinks write whole
records only (`tedebug.sinks.record_file`), so what a failing sink wrote before is intact.
"""

from __future__ import annotations

import contextlib
import errno
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

from tedebug import active
from tedebug.sinks.background import BackgroundSinkError, BackgroundWriter, describe_sink, iterations_text
from tedebug.sinks.batch import DeferredBatch, ScalarBatch
from tedebug.sinks.process_writer import ProcessWriter

#: one scalar of a batch: (name, value, iteration, layer, tensor, stat)
Record = Tuple[str, Any, int, Optional[str], Optional[str], Optional[str]]

__all__ = [
    "BackgroundSinkError",
    "MetricLogger",
    "Record",
    "SINK_ERROR_POLICIES",
    "Sink",
    "check_sink",
    "describe_failure",
]

#: what a `MetricLogger` does when a sink fails: report once and stop that sink, or raise
SINK_ERROR_POLICIES = ("warn", "raise")


class Sink:
    """Base class of statistics sinks. Subclasses implement `log_scalar`; `flush`/`close` are optional.

    `thread_safe`: True when a background-mode `MetricLogger` may call `log_scalars` and `flush` on its writer
    thread (then every call it makes to the sink comes from that thread, one at a time, except `close`, which
    follows the thread's last job).  Leave it False for sinks that must run in the caller's thread.
    """

    thread_safe: bool = False

    def writer_process_spec(self) -> Optional[Tuple[str, str, dict]]:
        """How a writer process makes this sink's twin: ``(module, class name, keyword arguments)``, the twin
        appending to this sink's file; None (the default) when it cannot (`tedebug.sinks.process_writer`)."""
        return None

    def handed_to_writer_process(self) -> None:
        """Called once the writer process writes this sink's twin: from then on this object is not given the
        statistics (it may still be called by the training script, see `writer_process_notes`)."""

    def writer_process_notes(self) -> List[Any]:
        """What this object (in the training process) has for its twin since the last call, e.g. values the
        training script logged through it; taken at each hand-over and given to the twin's
        `apply_writer_process_notes` before that hand-over's statistics.  Picklable items; none by default."""
        return []

    def apply_writer_process_notes(self, notes: Sequence[Any]) -> None:
        """The twin's side of `writer_process_notes`."""

    def log_scalar(
        self,
        name: str,
        value: Any,
        iteration: int,
        *,
        layer: Optional[str] = None,
        tensor: Optional[str] = None,
        stat: Optional[str] = None,
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement log_scalar(name, value, iteration, ...)")

    def log_scalars(self, records: Sequence[Record]) -> None:
        """Log a batch of scalars, in order (the default calls `log_scalar` for each)."""
        for name, value, iteration, layer, tensor, stat in records:
            self.log_scalar(name, value, iteration, layer=layer, tensor=tensor, stat=stat)

    def flush(self) -> None:
        """Make everything logged so far visible (called at every `debug_api.step()`)."""

    def close(self) -> None:
        """Flush and release resources (called at `debug_api.end_debug()`)."""
        self.flush()


def check_sink(sink: Any) -> Any:
    """Return `sink` if it has a callable ``log_scalar``; TypeError otherwise."""
    if not callable(getattr(sink, "log_scalar", None)):
        raise TypeError(
            f"a statistics sink needs a log_scalar(name, value, iteration) method; got {type(sink).__name__!r}"
        )
    return sink


class _SessionOrInstance:
    """Descriptor: on an instance calls ``<instance>.<impl>``; on the class calls ``<class_impl>`` (module-level
    function resolving the active session)."""

    def __init__(self, impl: str, class_impl):
        self.impl = impl
        self.class_impl = class_impl

    def __get__(self, instance, owner):
        if instance is None:
            return self.class_impl
        return getattr(instance, self.impl)


def add_statistics_sink(sink: Any) -> Any:
    """Attach a statistics sink to the active session, or queue it for the next `debug_api.initialize` (returns
    it); TypeError when `sink` has no ``log_scalar`` method.  Re-exported as `tedebug.debug_api.add_statistics_sink`."""
    check_sink(sink)
    current = active.DEBUG_MANAGER
    if current is None:
        active.QUEUED_SINKS.append(sink)
    else:
        current.metric_logger.add_sink(sink)
    return sink


def _class_add_logger(sink: Any) -> None:
    add_statistics_sink(sink)


def _class_log_scalar(name: str, value: Any, iteration: int, **structured: Any) -> None:
    active.session().metric_logger.log_scalar(name, value, iteration, **structured)


def describe_failure(sink: Any, exc: BaseException, iterations: str) -> str:
    """One line naming the sink (and its file), the iterations and the error (with its errno name)."""
    detail = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        detail += f" (errno {code}, {errno.errorcode[code]})"
    return (
        f"tedebug: statistics sink {describe_sink(sink)} failed while writing iteration(s) {iterations}: "
        f"{detail}; this sink is stopped for the rest of the session, training and the other sinks go on"
    )


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class MetricLogger:
    """Fans each scalar out to the sinks of one session (see the module docstring for background mode and sink
    errors)."""

    def __init__(
        self,
        *,
        background: bool = False,
        on_sink_error: str = "raise",
        report: Optional[Callable[[str], None]] = None,
        writer_process: bool = False,
    ) -> None:
        if on_sink_error not in SINK_ERROR_POLICIES:
            raise ValueError(f"on_sink_error must be one of {SINK_ERROR_POLICIES}, got {on_sink_error!r}")
        self.on_sink_error = on_sink_error
        self._report = report or _warn
        self._stopped: List[Any] = []  # sinks stopped after an error ("warn"); closed quietly at close()
        self._last_iteration: Any = None  # of the last scalar logged (names a failing flush)
        self.sinks: List[Any] = []
        self.background = bool(background)
        self._dirty = False  # something was logged since the last flush
        self._caller_sinks: List[Any] = []  # called in the caller's thread
        self._writer_sinks: List[Any] = []  # written by the background writer
        #: batches queued for the writer since the last hand-over (record lists, `ScalarBatch`es, or builders)
        self._pending: List[Any] = []
        self._loose: List[Record] = []  # the last pending chunk when it collects single log_scalar records
        self._writer: Optional[BackgroundWriter] = (
            BackgroundWriter(skip_failed=on_sink_error == "warn") if self.background else None
        )
        self._held: List[Any] = []  # chunks held back by `one_step_behind` until the next one
        #: background mode with ``writer_process``: the sinks with a `Sink.writer_process_spec` are written by a
        #: process of their own (`tedebug.sinks.process_writer`); None when off or when it could not start
        self._process: Optional[ProcessWriter] = (
            ProcessWriter(skip_failed=on_sink_error == "warn") if self.background and writer_process else None
        )
        self._process_sinks: List[Any] = []

    def add_sink(self, sink: Any) -> Any:
        """Attach `sink` (a `Sink` or any object with ``log_scalar(name, value, iteration)``); returns it."""
        self.sinks.append(check_sink(sink))
        spec = sink.writer_process_spec() if self._process is not None and isinstance(sink, Sink) else None
        if spec is not None and self._in_writer_process(sink, spec):
            self._process_sinks.append(sink)
        elif self.background and isinstance(sink, Sink) and sink.thread_safe:
            self._writer_sinks.append(sink)
        else:
            self._caller_sinks.append(sink)
        return sink

    def _in_writer_process(self, sink: Any, spec: Tuple[str, str, dict]) -> bool:
        """Hand `sink` to the writer process; False (reported once; the writer process is then given up for this
        logger) when it cannot take it."""
        assert self._process is not None
        problem = self._process.add(sink, spec)
        if problem is None:
            sink.handed_to_writer_process()
            return True
        self._report(
            f"tedebug: the statistics writer process cannot write {describe_sink(sink)} ({problem}); the statistics "
            f"files are written by the training process instead"
        )
        if not self._process_sinks:
            self._process.stop()
            self._process = None
        return False

    @property
    def _queues(self) -> bool:
        """True when something writes the pending chunks (the writer thread's sinks or the writer process's)."""
        return bool(self._writer_sinks or self._process_sinks)

    def _log_scalar(
        self,
        name: str,
        value: Any,
        iteration: int,
        *,
        layer: Optional[str] = None,
        tensor: Optional[str] = None,
        stat: Optional[str] = None,
    ) -> None:
        self._dirty = True
        self._last_iteration = iteration
        for sink in self._caller_sinks:
            try:
                if isinstance(sink, Sink):
                    sink.log_scalar(name, value, iteration, layer=layer, tensor=tensor, stat=stat)
                else:
                    sink.log_scalar(name, value, iteration)
            except Exception as exc:
                self._sink_failed(sink, exc, str(iteration))
        if self._queues:
            if not (self._pending and self._pending[-1] is self._loose):
                self._loose = []
                self._pending.append(self._loose)
            self._loose.append((name, value, iteration, layer, tensor, stat))
        self._raise_writer_error()

    def log_scalars(self, records: Sequence[Record]) -> None:
        """Log a batch of (name, value, iteration, layer, tensor, stat) records: each sink receives the whole batch
        in order (`Sink.log_scalars`, or one ``log_scalar(name, value, iteration)`` call per record); in background
        mode the writer's sinks receive it after the next `flush()`."""
        if records:
            self._dirty = True
            last = getattr(records, "iteration", None)  # a ScalarBatch knows it without building its records
            self._last_iteration = last if last is not None else records[-1][2]
            for sink in self._caller_sinks:
                try:
                    if isinstance(sink, Sink):
                        sink.log_scalars(records)
                    else:
                        for name, value, iteration, _, _, _ in records:
                            sink.log_scalar(name, value, iteration)
                except Exception as exc:
                    self._sink_failed(sink, exc, iterations_text([records]))
            if self._queues:  # our own copy (the caller may reuse its list); a ScalarBatch never changes
                self._pending.append(records if isinstance(records, ScalarBatch) else list(records))
        self._raise_writer_error()

    def log_deferred(self, build: Callable[[], Sequence[Record]]) -> None:
        """Log the records `build()` returns.  In background mode with only writer sinks, `build` runs on the
        writer thread (the caller pays nothing for formatting the values); otherwise it runs now, as
        `log_scalars(build())`.  `build` must depend only on data it captured (it may run after the caller moved
        on); an exception it raises is reported like a sink error."""
        if self._caller_sinks or not self._queues:
            self.log_scalars(build())
            return
        self._dirty = True
        self._pending.append(build)
        self._raise_writer_error()

    @property
    def defers_builds(self) -> bool:
        """True in background mode with no caller-thread sink: `log_deferred` builds its records on the writer thread
        (or, with no sink at all - a rank that writes no files, `statistics_rank0_only` - builds them for nobody),
        so the statistics engine may read back one step late.  Ranks whose only difference is that they write no
        files thus take the same read-back path and run the same collectives."""
        return self._writer is not None and not self._caller_sinks

    @contextlib.contextmanager
    def one_step_behind(self):
        """For a statistics engine that emits iteration N-1 during step N (deferred read-back): the chunks queued
        before the block (logged during iteration N) are held back until the next block or `release_held()`, and
        the ones the block queues (iteration N-1's statistics) go after the chunks held back by the previous block
        (logged during iteration N-1).  So every sink receives the records in the order of a synchronous run."""
        current, self._pending, self._loose = self._pending, [], []
        try:
            yield
        finally:
            self._pending = self._held + self._pending
            self._held = current
            self._dirty = self._dirty or bool(self._pending)

    def release_held(self) -> None:
        """Queue the chunks `one_step_behind` holds back (after everything queued so far)."""
        if self._held:
            held, self._held = self._held, []
            self._pending = self._pending + held
            self._loose = []
            self._dirty = True

    # Instance call: this logger.  Class call (nvdlfw style): the active session's logger.
    log_scalar = _SessionOrInstance("_log_scalar", _class_log_scalar)
    add_logger = _SessionOrInstance("add_sink", _class_add_logger)

    def flush(self) -> None:
        """Flush every sink that can be flushed, if anything was logged since the last flush (an idle
        `debug_api.step()` then costs no file-system call).  Background mode: wait for the batch in flight (the
        writer process's too, even when nothing new was logged), hand the queued batch to the writers (which write
        and flush it) and return."""
        writer = self._writer
        if writer is not None:
            writer.wait()
        if self._process is not None:
            self._process.wait()
        if self._dirty:
            self._dirty = False
            self._flush_caller_sinks()
            self._hand_over()
        self._raise_writer_error()

    def flush_and_wait(self) -> None:
        """`flush()` followed by `wait_written()`, with the queued batch written in the caller's thread instead of
        being handed to the writer thread (the caller waits for it anyway: `BackgroundWriter.write_now`); the writer
        process is handed it after the batch in flight there is written (so when this returns, every batch handed
        over before the previous call is on disk).  Synchronous mode: the same as `flush()`."""
        writer = self._writer
        if writer is None:
            self.flush()
            return
        writer.wait()
        if self._process is not None:
            self._process.wait()
        if self._dirty:
            self._dirty = False
            self._flush_caller_sinks()
            if self._queues:
                pending = self._take_pending()
                if self._writer_sinks:
                    writer.write_now(self._writer_sinks, pending)
        self._raise_writer_error()

    def _flush_caller_sinks(self) -> None:
        for sink in self._caller_sinks:
            flush = getattr(sink, "flush", None)
            if callable(flush):
                try:
                    flush()
                except Exception as exc:
                    self._sink_failed(sink, exc, f"up to {self._last_iteration}")

    def wait_written(self) -> None:
        """Background mode: block until the batch handed to the writer is written and flushed (errors re-raised).
        Synchronous mode: nothing to wait for."""
        if self._writer is not None:
            self._writer.wait()
        if self._process is not None:
            self._process.wait()
        self._raise_writer_error()

    def drain(self) -> None:
        """`flush()`, then wait until the writer has written and flushed everything and end its thread (a later
        batch starts a new one).  Synchronous mode: the same as `flush()`.  Chunks held back by `one_step_behind` are
        written too.  The writer process (if any) keeps running: this waits until it has written everything."""
        self.release_held()
        self.flush()
        if self._writer is not None:
            self._writer.stop()
        if self._process is not None:
            self._process.wait()
        self._raise_writer_error()

    def close(self) -> None:
        """Drain the writer, then close `Sink` subclasses, flush the others, and forget all of them (each is closed
        even if one fails; the first error is re-raised at the end)."""
        errors = []
        if self._writer is not None:
            try:
                self.release_held()
                self._hand_over()
                self._writer.stop()
            except Exception as exc:  # collected and re-raised below, after every sink had its turn
                errors.append((None, exc))
            error = self._writer.take_error()
            if error is not None:
                errors.append((None, error))
        if self._process is not None:
            try:
                self._process.stop()  # (the chunks were handed over with the writer thread's, above)
            except Exception as exc:  # collected and re-raised below, after every sink had its turn
                errors.append((None, exc))
            error = self._process.take_error()
            if error is not None:
                errors.append((None, error))
        sinks, self.sinks = self.sinks, []
        self._caller_sinks, self._writer_sinks, self._process_sinks = [], [], []
        for sink in sinks:
            try:
                if isinstance(sink, Sink):
                    sink.close()
                elif callable(getattr(sink, "flush", None)):
                    sink.flush()
            except Exception as exc:  # collected and re-raised below, after every sink had its turn
                errors.append((sink, exc))
        stopped, self._stopped = self._stopped, []
        for sink in stopped:  # already reported: release its file, quietly
            try:
                if callable(getattr(sink, "close", None)):
                    sink.close()
            except Exception:  # noqa: BLE001 - the sink's failure was reported when it was stopped
                pass
        if not errors:
            return
        if self.on_sink_error == "raise":
            raise errors[0][1]
        for sink, failure in errors:
            if isinstance(failure, BackgroundSinkError):
                self._report_background(failure)
            elif sink is None:
                self._report(f"tedebug: closing the statistics writer failed: {type(failure).__name__}: {failure}")
            else:
                self._report(describe_failure(sink, failure, f"up to {self._last_iteration} (at close)"))

    # ------------------------------------------------------------------------------------------- background
    def _hand_over(self) -> None:
        """Give the queued batch to the writers (each writes, then flushes, its sinks)."""
        if self._writer is None or not self._queues:
            return
        pending = self._take_pending()
        if self._writer_sinks:
            self._writer.submit(self._writer_sinks, pending)

    def _take_pending(self) -> List[Any]:
        """The queued chunks, taken; the writer process's sinks are given them here (`log_deferred` builders built
        first, once for both writers: the writer thread then receives the built chunks)."""
        pending, self._pending, self._loose = self._pending, [], []
        if self._process_sinks:
            assert self._process is not None
            pending = self._built(pending)
            self._process.submit(self._process_sinks, pending)
        return pending

    def _built(self, chunks: List[Any]) -> List[Any]:
        """`chunks` with every builder replaced by what it returns (a builder that raises is reported like the
        writer thread reports it, and its batch is not written).  A `DeferredBatch` stays unevaluated when no writer
        thread sink takes it: the writer process runs its final formulas."""
        built = []
        for chunk in chunks:
            if type(chunk) is DeferredBatch and not self._writer_sinks:
                chunk = chunk.batch()
            elif callable(chunk):
                try:
                    chunk = chunk()
                except Exception as exc:  # noqa: BLE001 - reported (or raised) as the writer thread's build error
                    error = BackgroundSinkError(
                        f"tedebug's statistics writer could not build a batch of statistics: "
                        f"{type(exc).__name__}: {exc}",
                        None,
                    )
                    error.__cause__ = exc
                    self._raise_or_report(error)
                    continue
            built.append(chunk)
        return built

    def _raise_writer_error(self) -> None:
        for writer in (self._writer, self._process):
            if writer is not None:
                error = writer.take_error()
                if error is not None:
                    self._raise_or_report(error)

    def _raise_or_report(self, error: BackgroundSinkError) -> None:
        if self.on_sink_error == "raise":
            raise error
        self._report_background(error)

    # ------------------------------------------------------------------------------------------- sink errors
    def _sink_failed(self, sink: Any, exc: Exception, iterations: str) -> None:
        """A caller-thread sink failed: raise ("raise"), or report once and stop the sink ("warn")."""
        if self.on_sink_error == "raise":
            raise exc
        self._stop(sink, describe_failure(sink, exc, iterations))

    def _report_background(self, error: BackgroundSinkError) -> None:
        """Report a writer-thread error ("warn"): each failing sink once, then stopped (the writer already skips it)."""
        if not error.failures:  # building the batch failed: that batch is lost, the sinks are fine
            self._report(f"tedebug: {error}; the statistics of that batch are not written, training goes on")
            return
        for sink, exc in error.failures:
            self._stop(sink, describe_failure(sink, exc, error.iterations))

    def _stop(self, sink: Any, message: str) -> None:
        if any(sink is s for s in self._stopped):
            return
        self._stopped.append(sink)
        self.sinks = [s for s in self.sinks if s is not sink]
        self._caller_sinks = [s for s in self._caller_sinks if s is not sink]
        self._writer_sinks = [s for s in self._writer_sinks if s is not sink]
        self._process_sinks = [s for s in self._process_sinks if s is not sink]
        if not self._queues:  # nothing left to hand over: drop what was queued for the writers
            self._pending, self._loose, self._held = [], [], []
        self._report(message)
