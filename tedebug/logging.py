"""The main text log of a debug session: file layout, line formats, env vars and "log once" deduplication.

Layout and formats are byte-compatible with nvdlfw_inspect (tools parse these files):

    <log_dir>/nvdlfw_inspect_logs/nvdlfw_inspect[_<TS>]_globalrank-<R>.log            main log (this module)
    <log_dir>/nvdlfw_inspect_statistics_logs/nvdlfw_inspect[_<TS>]_globalrank-<R>.log statistics (sinks/text.py)

Main log lines are ``%(asctime)s - %(levelname)s - %(message)s``; WARNING and above also go to stderr with the prefix
``NVDLFW INSPECT - ``.  Environment variables:

- ``NVDLFW_INSPECT_LOG_LEVEL``: level name of the main log (default INFO; unknown names mean INFO);
- ``NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE``: ``1`` (default) truncates the files at initialize, ``0`` appends;
- ``NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP``: ``1`` inserts ``_<TS>`` before ``_globalrank-`` where ``<TS>`` is
  ``NVDLFW_INSPECT_LOG_TIMESTAMP`` when set (so ranks can share one value) or the session start time
  (``%Y%m%d_%H%M%S``).

Each session uses its own `logging.Logger` (named ``tedebug.session.<id>``, not propagating to the root logger), so
handlers never accumulate across sessions; `TextLog.close()` removes and closes them and drops the logger from
`logging`'s registry (which would otherwise keep one logger object per session for the life of the process).
A main-log write that fails (a full disk) never raises into training: `logging` reports it on stderr, and a failing
`flush()` is reported there once.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from typing import Hashable, Optional, Set

MAIN_LOG_DIR = "nvdlfw_inspect_logs"
STATS_LOG_DIR = "nvdlfw_inspect_statistics_logs"
LINE_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
STDERR_PREFIX = "NVDLFW INSPECT - "

ENV_LEVEL = "NVDLFW_INSPECT_LOG_LEVEL"
ENV_OVERWRITE = "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE"
ENV_TIMESTAMP_ON = "NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP"
ENV_TIMESTAMP = "NVDLFW_INSPECT_LOG_TIMESTAMP"

_SESSION_IDS = itertools.count(1)
#: `logging`'s module lock guards its logger registry
_LOGGING_LOCK = getattr(logging, "_lock", None) or threading.RLock()


def log_level_from_env() -> int:
    """The level named by NVDLFW_INSPECT_LOG_LEVEL (INFO when unset or unknown)."""
    name = os.environ.get(ENV_LEVEL, "INFO").strip().upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.INFO


def file_mode_from_env() -> str:
    """'w' (truncate; the default) unless NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE is 0, then 'a'."""
    return "a" if os.environ.get(ENV_OVERWRITE, "1").strip() == "0" else "w"


def log_file_name(rank: int) -> str:
    """``nvdlfw_inspect[_<TS>]_globalrank-<rank>.log`` following the timestamp env vars."""
    stem = "nvdlfw_inspect"
    if os.environ.get(ENV_TIMESTAMP_ON, "0").strip() == "1":
        stamp = os.environ.get(ENV_TIMESTAMP) or time.strftime("%Y%m%d_%H%M%S")
        stem += f"_{stamp}"
    return f"{stem}_globalrank-{rank}.log"


def open_file_handler(path: str, mode: str) -> logging.FileHandler:
    """A FileHandler with the nvdlfw line format, creating the parent directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    handler = logging.FileHandler(path, mode=mode, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LINE_FORMAT))
    return handler


class StderrHandler(logging.Handler):
    """Writes to the *current* ``sys.stderr`` (so redirection after initialize is honoured)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's own convention: report through handleError, never raise from emit
            self.handleError(record)


def new_logger(name: str, level: int) -> logging.Logger:
    """A fresh, non-propagating logger with no handlers."""
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(level)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    return logger


def _freeze(value) -> Hashable:
    """A hashable stand-in for `value` (its repr when it is not hashable)."""
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


class TextLog:
    """The main text log of one session (file + stderr handlers) with "log once" deduplication.

    `file_name` is shared with the statistics file so both carry the same timestamp; `session_id` makes the
    logger name unique.
    """

    def __init__(self, log_dir: str, rank: int, *, file_name: Optional[str] = None, session_id: Optional[int] = None):
        self.root_log_dir = log_dir
        self.rank = rank
        self.session_id = next(_SESSION_IDS) if session_id is None else session_id
        self.file_name = file_name or log_file_name(rank)
        self.path = os.path.join(log_dir, MAIN_LOG_DIR, self.file_name)
        self.logger = new_logger(f"tedebug.session.{self.session_id}", log_level_from_env())
        self._seen: Set[Hashable] = set()
        self._flush_failed = False
        file_handler = open_file_handler(self.path, file_mode_from_env())
        stderr_handler = StderrHandler(level=logging.WARNING)
        stderr_handler.setFormatter(logging.Formatter(STDERR_PREFIX + LINE_FORMAT))
        self.logger.addHandler(file_handler)
        self.logger.addHandler(stderr_handler)

    def log(self, message: str, level: int = logging.INFO) -> None:
        """Write one line at `level`."""
        self.logger.log(level, message)

    # nvdlfw `get_logger().log_message(msg, level=)` compatibility (TE's DumpTensors uses it).
    def log_message(self, message: str, level: int = logging.INFO) -> None:
        self.log(message, level)

    def log_once(self, key: Hashable, message: str, level: int = logging.INFO) -> bool:
        """Write `message` only the first time `key` is seen in this session; True when written."""
        key = _freeze(key)
        if key in self._seen:
            return False
        self._seen.add(key)
        self.log(message, level)
        return True

    def flush(self) -> None:
        for handler in self.logger.handlers:
            try:
                handler.flush()
            except OSError as err:
                if not self._flush_failed:
                    self._flush_failed = True
                    sys.stderr.write(
                        f"{STDERR_PREFIX}tedebug: the main log {self.path} could not be written "
                        f"({err}); later lines of it may be missing\n"
                    )

    def close(self) -> None:
        """Remove and close every handler and forget the logger; the log cannot be written afterwards."""
        for handler in list(self.logger.handlers):
            self.logger.removeHandler(handler)
            try:
                handler.close()
            except OSError:  # its last flush failed; already reported by `flush` or by logging
                pass
        self._seen.clear()
        with _LOGGING_LOCK:
            if logging.Logger.manager.loggerDict.get(self.logger.name) is self.logger:
                del logging.Logger.manager.loggerDict[self.logger.name]
