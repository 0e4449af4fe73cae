"""`BuildOnce`: a compiled helper built at most once per process, its outcome kept, a failure said once.

Why: three compiled helpers are built at their first use, not at install time: the CPU FP8 cast
(`tedebug.backends.host_kernels`), the kernel launches (`tedebug.backends.host_launch`) and the inspect-only GEMM
call's linear (`tedebug.nn.compiled_linear`).  Each needs the same four things around its own build:
- threads that ask at the same time build once (a lock);
- the outcome is kept for the process: the loaded helper and "", or None and why it is None, so that a machine
  that cannot build does not try again at every call;
- a build that fails where the machine could build (a compiler is there and fails) is said once, as a
  RuntimeWarning that names the fallback; a machine without a compiler is not warned about;
- a process forked while another thread built gets a new lock (the parent's may be held by a thread the child
  does not have), and tests can forget the outcome.

How: `BuildOnce(build, warning)` holds them; `get()` answers the kept outcome or builds under the lock.  `build`
answers ``(helper, "")`` or ``(None, why)`` (`tedebug.backends.host_kernels.build_and_load`); `warning(why)`
answers the warning's text, or None when nothing is to be said (no compiler, no headers).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Callable, Generic, Optional, Tuple, TypeVar

T = TypeVar("T")
#: (the helper or None, why it is None: "" when it is there)
Outcome = Tuple[Optional[T], str]

#: every `BuildOnce` of the process, for the fork handler (module-level singletons in practice)
_ALL: "weakref.WeakSet[BuildOnce]" = weakref.WeakSet()


class BuildOnce(Generic[T]):
    """One compiled helper's build in this process (module docstring).  `stacklevel`: the warning's, as
    `warnings.warn` counts it from inside `get` (2 names the line that called `get`, 3 the one above it, ...)."""

    def __init__(
        self, build: Callable[[], Outcome], warning: Callable[[str], Optional[str]], *, stacklevel: int = 2
    ) -> None:
        self._build = build
        self._warning = warning
        self._stacklevel = stacklevel
        self._lock = threading.Lock()
        #: the kept outcome, None before the build ended (read without the lock: one assignment publishes it)
        self.outcome: Optional[Outcome] = None
        _ALL.add(self)

    def get(self, *, warn: bool = True) -> Outcome:
        """The kept outcome, after building now when there is none (`warn` False: a failure is not said, as when
        the caller raises an error of its own)."""
        outcome = self.outcome
        if outcome is not None:
            return outcome
        with self._lock:
            if self.outcome is None:
                built = self._build()
                if built[0] is None and warn:
                    text = self._warning(built[1])
                    if text is not None:
                        warnings.warn(text, RuntimeWarning, stacklevel=self._stacklevel)
                self.outcome = built
            return self.outcome

    def reason(self) -> str:
        """Why there is no helper ("" when there is one, or before the build ended)."""
        outcome = self.outcome
        return outcome[1] if outcome is not None else ""

    def forget(self) -> None:
        """Forget the outcome (tests that point the cache or the compiler elsewhere); the next `get` builds."""
        with self._lock:
            self.outcome = None

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


def _after_fork_in_child() -> None:
    for build in list(_ALL):
        build._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["BuildOnce", "Outcome"]
