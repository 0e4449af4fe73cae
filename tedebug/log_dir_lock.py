"""`LogDirLock`: one live debug session per (log directory, rank).

Why: two runs writing the same `log_dir` truncate and interleave each other's statistics files without any error
(the default ``log_dir="."`` makes this easy).  A session takes an exclusive `fcntl.flock` on
``<log_dir>/.tedebug_lock_globalrank-<R>`` before it opens (and truncates) any file there; a second live session of
the same rank on that directory gets a `LogDirInUseError` naming the other process.  The kernel drops a flock when
its process dies, so the lock of a killed run (SIGKILL included) is stale by construction and simply taken over;
the lock file itself stays (empty of meaning once unlocked).  Ranks of one job lock different files, so they share a
directory as before.  On platforms without `fcntl` (Windows) no lock is taken.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_PREFIX = ".tedebug_lock_globalrank-"


class LogDirInUseError(RuntimeError):
    """Another live tedebug session (same rank) holds the log directory."""


def lock_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"{LOCK_PREFIX}{rank}")


class LogDirLock:
    """The lock of one session (see the module docstring); `release()` (idempotent) gives it back."""

    def __init__(self, log_dir: str, rank: int) -> None:
        self.path = lock_path(log_dir, rank)
        self._fd: Optional[int] = None
        if fcntl is None:
            return
        try:
            os.makedirs(log_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as err:
            raise OSError(
                err.errno,
                f"tedebug cannot write to log_dir {log_dir!r} ({err.strerror}); choose a writable directory",
                self.path,
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LogDirInUseError(
                f"log_dir {log_dir!r} is in use by another live tedebug session of rank {rank} ({holder}); two runs "
                f"writing one log_dir would truncate and corrupt each other's statistics files: give this run its "
                f"own log_dir (initialize(..., log_dir=...)), or end the other one"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "holder unknown"
    except OSError:
        return "holder unknown"
