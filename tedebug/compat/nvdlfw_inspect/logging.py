"""``nvdlfw_inspect.logging``: `BaseLogger`, `MetricLogger`, `wrap_tensorboard_writer`, `get_logger`, `print_rank_0`.

`MetricLogger` is tedebug's (`tedebug.sinks.base.MetricLogger`): ``MetricLogger.add_logger(sink)`` and
``MetricLogger.log_scalar(name, value, iteration)`` called on the class act on the active session (``add_logger``
before ``initialize`` queues the sink for the next session).  `get_logger()` returns the active session's main log
(``log_message(msg, level=)``, ``root_log_dir``); it raises RuntimeError before ``initialize``.
"""

from __future__ import annotations

import abc
import logging as _logging
from typing import Any

from tedebug.sinks.base import MetricLogger

__all__ = ["BaseLogger", "MetricLogger", "TensorboardLogger", "get_logger", "print_rank_0", "wrap_tensorboard_writer"]


class BaseLogger(abc.ABC):
    """A statistics sink: ``log_scalar(name, value, iteration, **kwargs)``."""

    @abc.abstractmethod
    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        """Record one statistic."""


class TensorboardLogger(BaseLogger):
    """Writes each statistic with ``writer.add_scalar(name, value, iteration)`` (flat tags, as nvdlfw-inspect)."""

    def __init__(self, writer: Any) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"wrap_tensorboard_writer expects a writer with add_scalar, got {type(writer).__name__}")
        self.writer = writer

    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        self.writer.add_scalar(name, value, iteration)


def wrap_tensorboard_writer(writer: Any) -> TensorboardLogger:
    return TensorboardLogger(writer)


class _SessionLogger:
    """The active session's main log, with nvdlfw's logger interface."""

    def __init__(self, session: Any) -> None:
        self._session = session

    @property
    def root_log_dir(self) -> str:
        return self._session.log_dir

    def log_message(self, message: str, level: int = _logging.INFO) -> None:
        self._session.text_log.log(message, level)


def get_logger() -> _SessionLogger:
    from tedebug import debug_api

    return _SessionLogger(debug_api.session())


def print_rank_0(message: Any) -> None:
    from tedebug.session import global_rank

    if global_rank() == 0:
        print(message)
