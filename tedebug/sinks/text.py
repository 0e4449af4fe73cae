"""The default statistics file sink: nvdlfw-compatible text lines.

File: ``<log_dir>/nvdlfw_inspect_statistics_logs/nvdlfw_inspect[_<TS>]_globalrank-<R>.log`` (same base name as the
main log).  One line per scalar, byte-compatible with nvdlfw_inspect (TE's tests and user scripts parse it):

    <asctime> - INFO - <name> \\t\\t\\t\\t iteration=<%06d> \\t\\t\\t\\t value=<%.4f>

i.e. a space, four TAB characters and a space around the ``iteration=`` field.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Optional

from tedebug.logging import STATS_LOG_DIR, file_mode_from_env, log_file_name, new_logger, open_file_handler
from tedebug.sinks.base import Sink

SEPARATOR = " \t\t\t\t "
_SINK_IDS = itertools.count(1)


def stats_log_path(log_dir: str, rank: int, file_name: Optional[str] = None) -> str:
    """Where the statistics file of `rank` lives under `log_dir`."""
    return os.path.join(log_dir, STATS_LOG_DIR, file_name or log_file_name(rank))


def format_stat_message(name: str, value: Any, iteration: int) -> str:
    """``name \\t\\t\\t\\t iteration=000020 \\t\\t\\t\\t value=1.4388`` (the message part of a stats line)."""
    return f"{name}{SEPARATOR}iteration={int(iteration):06d}{SEPARATOR}value={float(value):.4f}"


class TextStatsSink(Sink):
    """Writes each scalar as one nvdlfw-format line to `path` (truncated unless the overwrite env var is 0)."""

    def __init__(self, path: str):
        self.path = path
        self._logger = new_logger(f"tedebug.stats.{next(_SINK_IDS)}", logging.INFO)
        self._logger.addHandler(open_file_handler(path, file_mode_from_env()))

    def log_scalar(self, name: str, value: Any, iteration: int, *, layer: Optional[str] = None,
                   tensor: Optional[str] = None, stat: Optional[str] = None, level: int = logging.INFO) -> None:
        self._logger.log(level, format_stat_message(name, value, iteration))

    def flush(self) -> None:
        for handler in self._logger.handlers:
            handler.flush()

    def close(self) -> None:
        for handler in list(self._logger.handlers):
            self._logger.removeHandler(handler)
            handler.close()
