"""`SignalGuard`: SIGINT / SIGTERM never cut a `debug_api.step()` in half, and SIGTERM still leaves every finished
iteration on disk.

Why: the statistics of iteration N are written during the next `step()` or by the atexit handler (see
`tedebug.session`).  A Ctrl-C landing inside `step()` could interrupt that hand-over; and SIGTERM's default action
ends the process without running atexit handlers, losing the last finished iteration.

`SignalGuard(flush)` is installed by `debug_api.initialize` in the main thread, and only over the *default*
handlers (a handler the application installed is never replaced).  While a step runs (`entering_step()` /
`step_done()`), a signal is only recorded and acted upon when the step is complete.  Outside a step it acts at
once: SIGINT raises `KeyboardInterrupt` exactly like Python's default handler (so the atexit handler flushes);
SIGTERM calls `flush()` (everything logged so far reaches the sinks), puts the default handler back and sends the
signal again, so the process ends the way it would have.  `restore()` (at `end_debug()`) puts the previous handlers
back.  The cost per step is two attribute writes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Dict, Optional


def _default_handlers() -> Dict[int, object]:
    handlers = {signal.SIGINT: signal.default_int_handler}
    if hasattr(signal, "SIGTERM"):
        handlers[signal.SIGTERM] = signal.SIG_DFL
    return handlers


class SignalGuard:
    """See the module docstring."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._previous: Dict[int, object] = {}
        self.in_step = False
        self.pending: Optional[int] = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, default in _default_handlers().items():
            if signal.getsignal(signum) is default:
                signal.signal(signum, self._handle)
                self._previous[signum] = default

    @property
    def installed(self) -> tuple:
        return tuple(self._previous)

    def entering_step(self) -> None:
        self.in_step = True

    def step_done(self) -> None:
        """End of a step: act on a signal that arrived during it."""
        self.in_step = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            self._act(signum)

    def _handle(self, signum: int, frame) -> None:
        if self.in_step:
            self.pending = signum
            return
        self._act(signum)

    def _act(self, signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        try:
            self._flush()
        except BaseException as exc:  # noqa: BLE001 - reported; the process is about to end by the signal anyway
            sys.stderr.write(f"tedebug: flushing the statistics at signal {signum} failed: {exc!r}\n")
        self.restore()
        os.kill(os.getpid(), signum)

    def restore(self) -> None:
        """Put back the handlers replaced at installation (where ours is still the one installed)."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)
