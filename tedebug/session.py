"""`DebugSession`: everything one `debug_api.initialize()` creates, and its lifecycle.

A session owns the compiled `config`, the feature `registry`, the `iteration` counter, `log_dir`, `rank`, the main
text log (`text_log`), the statistics fan-out (`metric_logger`) with its sinks, the `stats` engine, the namespaces
(``transformer_engine``, ``base``), the tensor `reduction_group` and `weight_tensor_tp_group_reduce` (default True).
`end_debug()` closes it; nothing of it survives (a new `initialize()` builds everything afresh).

Hot-path memo tables (`memo(name)`): values the debug path derives from the config and would otherwise rebuild for
every tensor of every iteration (parsed schedules, parsed statistic requests, ...) are memoised per session, so
they never outlive it and two sessions never share them.

`open_session(...)` builds a session in this order: the log directory lock (`tedebug.log_dir_lock`: a second live
session of the same rank on one `log_dir` is an error, before any file there is truncated), main text log, feature
registry (built-ins, then `feature_dirs`), config, sinks, stats engine.  If any step fails, everything created so far
is closed (log handlers
removed, sinks closed) before the error propagates, so nothing is left half-set and a retry works.

Sink errors (`on_sink_error`, default ``"warn"``): a sink that fails (a full disk, a read-only file system, a user
sink raising) is reported once in the main log (WARNING, also on stderr) with the sink, its file, the iterations and
the errno, and is stopped; training and the other sinks go on (`tedebug.sinks.base`).  ``"raise"`` propagates the
error from `step()` / `end_debug()` instead.

Sinks: `statistics_logger` (any object with ``log_scalar``), a `TensorBoardSink` with TransformerEngine's flat tags
for `tb_writer`, the sinks queued
by `debug_api.add_statistics_sink` before initialize, the default text statistics file when neither
`statistics_logger` nor `tb_writer` is given or `default_logging_enabled` is True, and always a JSONL file at
``<log_dir>/tedebug_statistics/metrics_globalrank-<R>.jsonl``; with ``statistics_rank0_only`` the two statistics
files (text, JSONL) are written by global rank 0 only.  (nvdlfw ignores `tb_writer` when
`statistics_logger` is given; tedebug attaches both.)

Background logging (`background_logging`, default ``"process"``): the statistics engine hands each step's batch to
the session's `MetricLogger`, which has it written off the training thread.

* ``"process"`` (the default): tedebug's text and JSONL statistics files are written by a writer process of their
  own (`tedebug.sinks.process_writer`; the training process sends the step's rows in one pipe write: the final
  formulas, formatting and writing cost it nothing, on a host whose Python is the bottleneck as on a GPU host).
  Other sinks are written as with ``True``.  If the process cannot start, one warning says so and ``True`` applies.
* ``True``: tedebug's own sinks (text, JSONL, TensorBoard) are written on one writer thread
  (`tedebug.sinks.background`).
* ``False``: every write happens inside `step()`: iteration N is on disk when it returns.

When every sink is one of tedebug's own (no `statistics_logger` or other caller-thread sink), the statistics engine
also defers its read-back (`tedebug.stats.engine`; several ranks: one asynchronous collective per reduction group):
`step()` for iteration N enqueues the transfer of iteration N's rows and returns without waiting for the GPU, after
reducing iteration N-1 and handing it to the writers; a training loop that never synchronises keeps its GPU queue
full across steps.  Otherwise `step()` first writes iteration N-1, then reads iteration N back.  With the writer
thread, `step()` waits until iteration N-1 is written, so it writes it itself, in the training thread
(`MetricLogger.flush_and_wait`: handing the batch to the thread only to wait for it cost the hand-over and the two
threads' contention for the GIL, about 9 µs of host time per logged tensor on the CPU probe); the writer process
writes it while training goes on.  The records reach every sink in the order of a synchronous run.

Guarantee: after `debug_api.step()` returns for iteration N, iteration N-1 (and everything before it) is on disk
(writer thread), or on disk except iteration N-1, which the writer process has received and writes whatever happens
to the training process (SIGKILL, ``os._exit``, a crash included: it ends only after writing everything it was
sent).  Iteration N is written during the next `step()`, or at `end_debug()` / `flush()` / interpreter exit (the
atexit handler of `tedebug.debug_api` calls `flush()`, which emits the iteration in flight and waits for the
writers; an uncaught exception in iteration N+1 therefore still leaves iteration N on disk; a fatal signal,
``os._exit`` or a CUDA error that destroys the context before the exit can lose it).  Sinks supplied by the user
(`statistics_logger`, queued sinks) are called in the caller's thread unless they are `Sink` subclasses declaring
``thread_safe = True``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, Optional, Union

from tedebug import usage_checks
from tedebug.config import load_config
from tedebug.log_dir_lock import LogDirLock
from tedebug.logging import TextLog, log_file_name
from tedebug.namespace import BaseNamespace, TransformerEngineNamespace, custom_namespaces
from tedebug.registry import Registry, build_registry
from tedebug.sinks.base import SINK_ERROR_POLICIES, MetricLogger, check_sink
from tedebug.sinks.text import TextStatsSink, escape_name, stats_log_path

JSONL_DIR = "tedebug_statistics"


def jsonl_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, JSONL_DIR, f"metrics_globalrank-{rank}.jsonl")


def global_rank() -> int:
    """torch.distributed's global rank when it is initialised, else 0."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class DebugSession:
    """The state of one initialised debug session (see the module docstring)."""

    def __init__(
        self,
        *,
        config: Any,
        registry: Registry,
        text_log: TextLog,
        metric_logger: MetricLogger,
        log_dir: str,
        rank: int,
        iteration: int = 0,
        weight_tensor_tp_group_reduce: bool = True,
        lock: Optional[LogDirLock] = None,
    ):
        from tedebug.stats import StatsEngine

        self.config = config
        self.registry = registry
        self.text_log = text_log
        self.metric_logger = metric_logger
        self.log_dir = log_dir
        self.rank = rank
        self.iteration = iteration
        self.reduction_group = None
        self.weight_tensor_tp_group_reduce = weight_tensor_tp_group_reduce
        self.stats = StatsEngine(metric_logger, log_message=self.log_message, flush_at_step=False)
        self.namespaces: Dict[str, Any] = {
            TransformerEngineNamespace.name: TransformerEngineNamespace(self),
            BaseNamespace.name: BaseNamespace(self),
        }
        self.namespaces.update(custom_namespaces(self))  # nvdlfw-style namespaces registered by feature files
        self.closed = False
        self.lock = lock
        #: the `tedebug.signal_guard.SignalGuard` that `debug_api.initialize` installs (None: no guard)
        self.signal_guard: Any = None
        #: False (``initialize(..., plan_cache=False)``): no compiled plans, every hook question reaches the features
        #: through ``debug_api.transformer_engine`` (`tedebug.plan`)
        self.plan_cache = True
        #: the depth of `debug_api.paused()` blocks: while above 0 the layers' debug gates answer "not debugged"
        #: to every GEMM call that starts (an evaluation loop between two steps stays out of the statistics)
        self.paused = 0
        self._memos: Dict[str, dict] = {}
        self._logged: set = set()  # (layer, message, extra) keys already written by log_message

    def memo(self, name: str) -> dict:
        """The session's memo table `name` (created empty on first use; dropped with the session)."""
        table = self._memos.get(name)
        if table is None:
            table = self._memos[name] = {}
        return table

    # nvdlfw / TE compatibility: TE reads DEBUG_MANAGER._trainer_iteration_count.
    @property
    def _trainer_iteration_count(self) -> int:
        return self.iteration

    @_trainer_iteration_count.setter
    def _trainer_iteration_count(self, value: int) -> None:
        self.iteration = int(value)

    @property
    def transformer_engine(self) -> TransformerEngineNamespace:
        return self.namespaces[TransformerEngineNamespace.name]

    @property
    def base(self) -> BaseNamespace:
        return self.namespaces[BaseNamespace.name]

    # ------------------------------------------------------------------ logging
    def log_message(
        self, message: str, layer_name: Optional[str] = None, level: int = logging.INFO, extra_cachable_args: Any = None
    ) -> bool:
        """Write `message` (prefixed ``LAYER=<name>: `` when a layer is given) once per distinct
        (layer, message, extra_cachable_args) in this session; True when it was written."""
        key = (layer_name, message, extra_cachable_args)
        try:
            if key in self._logged:  # seen: skip building the line
                return False
        except TypeError:  # unhashable extra_cachable_args: the text log deduplicates by repr
            key = None
        text = f"LAYER={escape_name(layer_name)}: {message}" if layer_name is not None else message
        written = self.text_log.log_once((layer_name, message, extra_cachable_args), text, level)
        if key is not None:
            self._logged.add(key)
        return written

    # ------------------------------------------------------------------ lifecycle
    def step(self) -> None:
        """Advance the iteration, let each namespace finish the previous one (statistics emitted), flush (see the
        module docstring for the order in background mode)."""
        finished = self.iteration
        self.iteration += 1
        logger = self.metric_logger
        if not logger.background:
            for namespace in self.namespaces.values():
                namespace.step(finished)
            logger.flush()
        else:
            self.stats.defer_read_back = logger.defers_builds
            if self.stats.defers():
                with logger.one_step_behind():
                    for namespace in self.namespaces.values():
                        namespace.step(finished)
                logger.flush_and_wait()
            else:
                self._catch_up()
                logger.flush_and_wait()
                for namespace in self.namespaces.values():
                    namespace.step(finished)
        self.text_log.flush()
        usage_checks.after_step(self, finished)  # first step: sections that selected no layer (warning)

    def _catch_up(self) -> None:
        """Emit the iteration whose rows are still in flight (deferred read-back) and queue the records held back
        with it, so that the next flush writes them in order."""
        if self.stats.has_in_flight:
            with self.metric_logger.one_step_behind():
                self.stats.finish_pending()
        self.metric_logger.release_held()

    def flush(self) -> None:
        """Write everything logged so far to disk: emit the iteration still in flight, drain the background writer
        (wait for it, end its thread) and flush the main log.  Called by the atexit handler."""
        try:
            self._catch_up()
        finally:
            self.metric_logger.drain()
            self.text_log.flush()

    def close(self) -> None:
        """Reset the namespaces, flush and close every sink, remove the log handlers (each step runs even if an
        earlier one fails; the first error is re-raised at the end)."""
        if self.closed:
            return
        self.closed = True
        errors = []
        release = self.lock.release if self.lock is not None else (lambda: None)
        try:
            usage_checks.before_close(self)  # step() never called / statistics dropped (warnings)
        except Exception as exc:  # e.g. warnings turned into errors: close everything first, re-raised below
            errors.append(exc)
        self._memos.clear()
        for action in (
            [self._catch_up]
            + [ns.end_debug for ns in self.namespaces.values()]
            + [self.metric_logger.close, self.text_log.close, release]
        ):
            try:
                action()
            except Exception as exc:  # keep closing the rest; re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]


def _select_sinks(
    log_dir: str,
    rank: int,
    file_name: str,
    *,
    statistics_logger: Any,
    tb_writer: Any,
    files: bool,
    default_logging_enabled: bool,
    queued: Iterable[Any],
    text_log: TextLog,
    metric_logger: MetricLogger,
    created: list,
) -> None:
    """Attach the session's sinks; the ones tedebug creates are also appended to `created`."""
    if statistics_logger is not None:
        metric_logger.add_sink(statistics_logger)
        text_log.log("Using the provided logger for logging tensor statistics.")
    if tb_writer is not None:
        from tedebug.sinks.tensorboard import TensorBoardSink

        created.append(metric_logger.add_sink(TensorBoardSink(writer=tb_writer, tag_style="flat")))
        text_log.log("TB Writer found. Logging to Tensorboard..")
    for sink in queued:
        metric_logger.add_sink(sink)
    if not files:  # statistics_rank0_only on a rank other than 0
        text_log.log("statistics_rank0_only: statistics files are written by global rank 0 only.")
        return
    if (statistics_logger is None and tb_writer is None) or default_logging_enabled:
        created.append(metric_logger.add_sink(TextStatsSink(stats_log_path(log_dir, rank, file_name))))
        text_log.log(f"Default logging to file enabled at {log_dir}")
    from tedebug.sinks.jsonl import JsonlSink

    created.append(metric_logger.add_sink(JsonlSink(jsonl_path(log_dir, rank))))


def _load_config(config_file: Any, registry: Registry, text_log: TextLog) -> Any:
    if isinstance(config_file, dict):
        text_log.log("Reading config from Python dictionary.")
    elif isinstance(config_file, str) and config_file == "":
        text_log.log("No config file given: running without config.")
    elif isinstance(config_file, (str, os.PathLike)):
        text_log.log(f"Reading config from {escape_name(os.fspath(config_file))}.")
    else:
        raise TypeError(
            f"initialize: config_file must be a path (str or PathLike), a dict or '', got "
            f"{type(config_file).__name__}: {config_file!r}"
        )
    config = load_config(
        config_file, feature_names=registry.feature_names(), feature_validators=registry.feature_validators()
    )
    text_log.log(f"Loaded configs for {list(config.sections)}.")
    return config


def _check_arguments(log_dir: Any, init_training_step: Any, background_logging: Any, on_sink_error: Any) -> None:
    if not isinstance(log_dir, (str, os.PathLike)) or not isinstance(os.fspath(log_dir), str):
        raise TypeError(f"initialize: log_dir must be a path (str or PathLike), got {type(log_dir).__name__}")
    if "\0" in os.fspath(log_dir):
        raise ValueError(f"initialize: log_dir contains a NUL character: {os.fspath(log_dir)!r}")
    if on_sink_error not in SINK_ERROR_POLICIES:
        raise ValueError(f"initialize: on_sink_error must be one of {SINK_ERROR_POLICIES}, got {on_sink_error!r}")
    if isinstance(init_training_step, bool) or not isinstance(init_training_step, int):
        raise TypeError(f"initialize: init_training_step must be an int, got {init_training_step!r}")
    if not isinstance(background_logging, bool) and background_logging != "process":
        raise TypeError(f"initialize: background_logging must be True, False or 'process', got {background_logging!r}")


def open_session(
    config_file: Any = "",
    feature_dirs: Any = None,
    statistics_logger: Any = None,
    log_dir: Any = ".",
    init_training_step: int = 0,
    *,
    tb_writer: Any = None,
    default_logging_enabled: bool = False,
    queued_sinks: Iterable[Any] = (),
    weight_tensor_tp_group_reduce: bool = True,
    background_logging: Union[bool, str] = "process",
    on_sink_error: str = "warn",
    statistics_rank0_only: bool = False,
) -> DebugSession:
    """Build a `DebugSession` (see the module docstring); on failure nothing created is left open."""
    _check_arguments(log_dir, init_training_step, background_logging, on_sink_error)
    if not isinstance(statistics_rank0_only, bool):
        raise TypeError(f"initialize: statistics_rank0_only must be a bool, got {statistics_rank0_only!r}")
    log_dir = os.fspath(log_dir)
    if statistics_logger is not None:
        check_sink(statistics_logger)
    rank = global_rank()
    file_name = log_file_name(rank)
    lock = LogDirLock(log_dir, rank)
    try:
        text_log = TextLog(log_dir, rank, file_name=file_name)
    except BaseException:
        lock.release()
        raise
    created: list = []
    try:
        registry = build_registry(feature_dirs)
        for skipped in registry.skipped_dirs:
            text_log.log(
                f"Skipping feature directory {skipped}: it is TransformerEngine's or nvdlfw-inspect's own "
                f"feature directory; "
                f"tedebug provides these features itself."
            )
        for replaced in registry.replaced + [
            f"{api} ignored: tedebug implements this namespace itself" for api in registry.ignored_apis
        ]:
            text_log.log(f"Feature registry: {replaced}")
        config = _load_config(config_file, registry, text_log)
        metric_logger = MetricLogger(
            background=bool(background_logging),
            writer_process=background_logging == "process",
            on_sink_error=on_sink_error,
            report=lambda message: text_log.log(message, logging.WARNING),
        )
        session = DebugSession(
            config=config,
            registry=registry,
            text_log=text_log,
            metric_logger=metric_logger,
            log_dir=log_dir,
            rank=rank,
            iteration=init_training_step,
            weight_tensor_tp_group_reduce=weight_tensor_tp_group_reduce,
            lock=lock,
        )
        _select_sinks(
            log_dir,
            rank,
            file_name,
            statistics_logger=statistics_logger,
            tb_writer=tb_writer,
            files=not (statistics_rank0_only and rank != 0),
            default_logging_enabled=default_logging_enabled,
            queued=queued_sinks,
            text_log=text_log,
            metric_logger=session.metric_logger,
            created=created,
        )
        return session
    except BaseException as error:
        for close in [sink.close for sink in created] + [text_log.close, lock.release]:
            _close_during(error, close)
        raise


def _close_during(error: BaseException, close) -> None:
    """Cleanup while `error` propagates: a cleanup failure is attached to `error` as a note, not swallowed."""
    try:
        close()
    except Exception as cleanup_error:  # noqa: BLE001 - recorded on the error the user sees
        if hasattr(error, "add_note"):
            error.add_note(f"additionally, cleanup failed: {cleanup_error!r}")
        else:
            raise cleanup_error from error
