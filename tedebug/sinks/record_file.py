"""`RecordFile`: an append-only file that only ever holds whole records (lines).

Why: a statistics file is read while the run goes on and after it died.  A half-written line (a full disk, a write
error, a kill in the middle of a buffered flush) makes a JSONL file unparsable from that line on.  `RecordFile`
writes each batch of complete lines with `os.write` straight to the file descriptor (no Python buffer that could
be flushed in pieces), and when a write fails part-way it truncates the file back to the end of the last complete
batch before re-raising, so what was already written is never corrupted.  Data handed to `os.write` is in the
kernel's page cache: it survives the death of the process (SIGKILL included), though not a power loss.
A reader running during a write can still see part of it (Linux makes a buffered write visible page by page), so
a reader of a live file keeps only the lines up to its last newline, as `tedebug.analysis.load` does.
"""

from __future__ import annotations

import os


class RecordFile:
    """Whole-batch appends to `path` (created with its parent directories; truncated unless `append`)."""

    def __init__(self, path: str, *, append: bool = False) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0) | (0 if append else os.O_TRUNC)
        self._fd = os.open(path, flags, 0o644)
        self._size = os.lseek(self._fd, 0, os.SEEK_END)  # end of the last complete batch

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def write(self, text: str) -> None:
        """Append `text` (complete lines) at once; on failure the file keeps exactly its previous content."""
        if self._fd < 0:
            raise ValueError(f"I/O operation on closed file {self.path!r}")
        data = memoryview(text.encode("utf-8"))
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except BaseException:
            if written:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:  # nothing more can be done; the original error is what the caller must see
                    pass
            raise
        self._size += written

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
