"""The default statistics file sink: nvdlfw-compatible text lines.

File: ``<log_dir>/nvdlfw_inspect_statistics_logs/nvdlfw_inspect[_<TS>]_globalrank-<R>.log`` (same base name as the
main log).  One line per scalar, byte-compatible with nvdlfw_inspect (TE's tests and user scripts parse it):

    <asctime> - INFO - <name> \\t\\t\\t\\t iteration=<%06d> \\t\\t\\t\\t value=<%.4f>

i.e. a space, four TAB characters and a space around the ``iteration=`` field.  ``<asctime>`` is the time the
line was formatted in `logging`'s default format (``%Y-%m-%d %H:%M:%S,<msecs>``, local time): when the scalar was
logged, or, with a background-mode `MetricLogger`, when its writer thread wrote the step's batch (one stamp per
batch).  Lines are formatted here (not through `logging`: a `LogRecord` per scalar cost more than the statistic
itself), kept in memory and reach the file at `flush()` (every `debug_api.step()`) and `close()`, in one
`RecordFile` write (whole lines only, even when the disk fills up); a batch formats the text between name and value
once per iteration.

A name containing a control character (a newline would forge a line of its own) is escaped (`escape_name`:
``\n``, ``\t``, ``\x00``, ... and ``\\`` for a backslash); every other name is written as it is.  A
`tedebug.sinks.batch.ScalarBatch` of one
iteration (a step of `StatsEngine`) is written at once: its names (a list cached per layout), the prefix, the
middle and the values (formatted by one ``map``) are joined into the same bytes.
"""

from __future__ import annotations

import logging
import os
import re
import time
from itertools import repeat
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tedebug.logging import STATS_LOG_DIR, file_mode_from_env, log_file_name
from tedebug.sinks.base import Record, Sink
from tedebug.sinks.batch import ScalarBatch
from tedebug.sinks.record_file import RecordFile

SEPARATOR = " \t\t\t\t "
#: the lowest level written (the statistics file's logger level in nvdlfw)
MIN_LEVEL = logging.INFO


#: control characters (C0, DEL, C1) and the Unicode line / paragraph separators
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: "re.Match") -> str:
    char = match.group()
    return _ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_name(name: Any) -> Any:
    """`name` unchanged unless it is a str holding a control character; then backslashes and control characters
    are written as escapes, so one statistic is always one line."""
    if type(name) is not str or not _CONTROL.search(name):
        return name
    return _CONTROL.sub(_escape_char, name.replace("\\", "\\\\"))


def stats_log_path(log_dir: str, rank: int, file_name: Optional[str] = None) -> str:
    """Where the statistics file of `rank` lives under `log_dir`."""
    return os.path.join(log_dir, STATS_LOG_DIR, file_name or log_file_name(rank))


def format_stat_message(name: str, value: Any, iteration: int) -> str:
    """``name \\t\\t\\t\\t iteration=000020 \\t\\t\\t\\t value=1.4388`` (the message part of a stats line)."""
    return f"{escape_name(name)}{SEPARATOR}iteration={int(iteration):06d}{SEPARATOR}value={float(value):.4f}"


class _AscTime:
    """`logging.Formatter`'s default ``asctime`` (local time, ``,msecs``), the seconds part formatted once per
    second."""

    __slots__ = ("_second", "_text")

    def __init__(self) -> None:
        self._second: Optional[int] = None
        self._text = ""

    def now(self) -> str:
        created = time.time()
        second = int(created)
        if second != self._second:
            self._second = second
            self._text = time.strftime(logging.Formatter.default_time_format, time.localtime(created))
        template = logging.Formatter.default_msec_format  # "%s,%03d"; typed Optional for subclasses that unset it
        return template % (self._text, int((created - second) * 1000))  # type: ignore[operator]


class TextStatsSink(Sink):
    """Writes each scalar as one nvdlfw-format line to `path` (truncated unless the overwrite env var is 0, or
    `append` says otherwise)."""

    thread_safe = True  # only the background writer calls it (see tedebug.sinks.base)

    def __init__(self, path: str, *, append: Optional[bool] = None):
        self.path = path
        if append is None:
            append = file_mode_from_env() == "a"
        self._file = RecordFile(os.path.abspath(path), append=append)
        self._pending: List[str] = []
        self._asctime = _AscTime()
        #: the layout of the last `ScalarBatch` written and its names (None: a name is not a plain str)
        self._batch_layout: Optional[tuple] = None
        self._batch_names: Optional[List[str]] = None

    def writer_process_spec(self) -> Optional[Tuple[str, str, dict]]:
        if type(self) is not TextStatsSink:  # a subclass may write differently: it stays in this process
            return None
        return (__name__, "TextStatsSink", {"path": os.path.abspath(self.path), "append": True})

    def log_scalar(
        self,
        name: str,
        value: Any,
        iteration: int,
        *,
        layer: Optional[str] = None,
        tensor: Optional[str] = None,
        stat: Optional[str] = None,
        level: int = logging.INFO,
    ) -> None:
        if level < MIN_LEVEL or self._file.closed:  # below the file's level, or logged after close(): dropped
            return
        message = format_stat_message(name, value, iteration)
        self._pending.append(f"{self._asctime.now()} - {logging.getLevelName(level)} - {message}\n")

    def log_scalars(self, records: Sequence[Record]) -> None:
        """Write a batch of INFO lines at once (one timestamp: the batch is written at one instant)."""
        if self._file.closed or not records:
            return
        prefix = f"{self._asctime.now()} - {logging.getLevelName(logging.INFO)} - "
        if type(records) is ScalarBatch and records.iteration is not None:
            names = self._names_for(records)
            if names is not None:
                self._pending.append(self._batch_text(names, records, prefix))
                return
        middles: Dict[Any, str] = {}  # iteration -> the text between name and value (equal iterations: equal text)
        lines = []
        for name, value, iteration, _, _, _ in records:
            middle = middles.get(iteration)
            if middle is None:
                middle = middles[iteration] = f"{SEPARATOR}iteration={int(iteration):06d}{SEPARATOR}value="
            lines.append(f"{prefix}{escape_name(name)}{middle}{float(value):.4f}\n")  # = format_stat_message's
        self._pending.append("".join(lines))

    def _names_for(self, batch: ScalarBatch) -> Optional[List[str]]:
        """The name of every record of `batch` (listed again when the layout changed); None when a name is not a
        plain str."""
        if not batch.same_layout(self._batch_layout):
            names = [escape_name(name) for name, _, _, _ in batch.name_parts()]
            self._batch_names = names if all(type(name) is str for name in names) else None
            self._batch_layout = batch.layout
        return self._batch_names

    @staticmethod
    def _batch_text(names: List[str], batch: ScalarBatch, prefix: str) -> str:
        """The lines of a one-iteration `batch` (`names`: its `_names_for`): per record prefix, name, middle, value
        and newline, joined (a ``%`` template of the batch costs more: its literal text is scanned per character)."""
        values = batch.values
        middle = f"{SEPARATOR}iteration={int(batch.iteration):06d}{SEPARATOR}value="
        parts: List[Any] = [prefix, None, middle, None, "\n"]
        parts *= len(values)
        parts[1::5] = names
        parts[3::5] = map(float.__format__, values, repeat(".4f"))  # = f"{float(value):.4f}", as `log_scalars`
        return "".join(parts)

    def flush(self) -> None:
        if self._pending and not self._file.closed:
            text = "".join(self._pending)
            self._pending.clear()  # a batch that cannot be written is dropped, never written twice or in part
            self._file.write(text)

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.flush()
            finally:
                self._file.close()
