"""The statistics sink interface (`Sink`) and the per-session fan-out (`MetricLogger`).

Every statistic is emitted once, through `MetricLogger.log_scalar(name, value, iteration, *, layer, tensor, stat)`,
and fanned out to every sink of the session.  `MetricLogger.log_scalars(records)` emits a batch (the statistics of
one step): each `Sink` receives it through `Sink.log_scalars` (by default one `log_scalar` call per record, in
order; the file sinks write a batch at once), any other object one ``log_scalar`` call per record.  Sinks derived from `Sink` receive the structured keywords; any other
object with a ``log_scalar(name, value, iteration)`` method (an nvdlfw ``BaseLogger``, a W&B adapter) receives only
the three positional values.

nvdlfw compatibility: ``MetricLogger.add_logger(sink)`` and ``MetricLogger.log_scalar(name, value, iteration)``
also work when called on the *class* (as frameworks and TE-style custom features do); they then act on the active
session (``add_logger`` before initialize queues the sink for the next session, see
`tedebug.debug_api.add_statistics_sink`).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

#: one scalar of a batch: (name, value, iteration, layer, tensor, stat)
Record = Tuple[str, Any, int, Optional[str], Optional[str], Optional[str]]


class Sink:
    """Base class of statistics sinks. Subclasses implement `log_scalar`; `flush`/`close` are optional."""

    def log_scalar(self, name: str, value: Any, iteration: int, *, layer: Optional[str] = None,
                   tensor: Optional[str] = None, stat: Optional[str] = None) -> None:
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


def _class_add_logger(sink: Any) -> None:
    from tedebug import debug_api  # late import: debug_api imports this module

    debug_api.add_statistics_sink(sink)


def _class_log_scalar(name: str, value: Any, iteration: int, **structured: Any) -> None:
    from tedebug import debug_api

    debug_api.session().metric_logger.log_scalar(name, value, iteration, **structured)


class MetricLogger:
    """Fans each scalar out to the sinks of one session."""

    def __init__(self) -> None:
        self.sinks: List[Any] = []
        self._dirty = False  # something was logged since the last flush

    def add_sink(self, sink: Any) -> Any:
        """Attach `sink` (a `Sink` or any object with ``log_scalar(name, value, iteration)``); returns it."""
        self.sinks.append(check_sink(sink))
        return sink

    def _log_scalar(self, name: str, value: Any, iteration: int, *, layer: Optional[str] = None,
                    tensor: Optional[str] = None, stat: Optional[str] = None) -> None:
        self._dirty = True
        for sink in self.sinks:
            if isinstance(sink, Sink):
                sink.log_scalar(name, value, iteration, layer=layer, tensor=tensor, stat=stat)
            else:
                sink.log_scalar(name, value, iteration)

    def log_scalars(self, records: Sequence[Record]) -> None:
        """Log a batch of (name, value, iteration, layer, tensor, stat) records: each sink receives the whole batch
        in order (`Sink.log_scalars`, or one ``log_scalar(name, value, iteration)`` call per record)."""
        if not records:
            return
        self._dirty = True
        for sink in self.sinks:
            if isinstance(sink, Sink):
                sink.log_scalars(records)
            else:
                for name, value, iteration, _, _, _ in records:
                    sink.log_scalar(name, value, iteration)

    # Instance call: this logger.  Class call (nvdlfw style): the active session's logger.
    log_scalar = _SessionOrInstance("_log_scalar", _class_log_scalar)
    add_logger = _SessionOrInstance("add_sink", _class_add_logger)

    def flush(self) -> None:
        """Flush every sink that can be flushed, if anything was logged since the last flush (an idle
        `debug_api.step()` then costs no file-system call)."""
        if not self._dirty:
            return
        self._dirty = False
        for sink in self.sinks:
            flush = getattr(sink, "flush", None)
            if callable(flush):
                flush()

    def close(self) -> None:
        """Close `Sink` subclasses, flush the others, and forget all of them (each is closed even if one fails)."""
        sinks, self.sinks = self.sinks, []
        errors = []
        for sink in sinks:
            try:
                if isinstance(sink, Sink):
                    sink.close()
                elif callable(getattr(sink, "flush", None)):
                    sink.flush()
            except Exception as exc:  # collected and re-raised below, after every sink had its turn
                errors.append(exc)
        if errors:
            raise errors[0]
