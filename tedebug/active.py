"""The active debug session: the one piece of global state that every part of tedebug may read.

`tedebug.debug_api.initialize()` makes a `tedebug.session.DebugSession` active and `end_debug()` clears it; features,
statistics, sinks and the layers' debug gate only read it, through this module.  It is the ground floor of the
package: it imports nothing from tedebug at run time, so any module can import it without an import circle.
`tedebug.debug_api` re-exports its names, and ``debug_api.DEBUG_MANAGER`` reads and writes the very same variable.

Rules:
- `DEBUG_MANAGER` is the active session, or None when tedebug is not initialised.  Paths that run every iteration
  read it directly (one attribute lookup; None means "do nothing"); paths where an uninitialised API is a user error
  call `session()`.
- `session()`, `get_iteration()` and `log_message()` raise RuntimeError (`NOT_INITIALIZED`) when no session is
  active; `is_enabled()` never raises.
- What is set before `initialize` for the next session (statistics sinks, the weight-reduction flag) waits in
  `QUEUED_SINKS` / `QUEUED_SETTINGS`; `initialize` takes it and empties them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:  # the type only: importing tedebug.session here would bring the whole package in
    from tedebug.session import DebugSession

#: the active session, or None
DEBUG_MANAGER: Optional["DebugSession"] = None

#: statistics sinks added before `initialize`, attached to the next session
QUEUED_SINKS: List[Any] = []
#: settings made before `initialize` for the next session (``weight_tensor_tp_group_reduce``)
QUEUED_SETTINGS: dict = {}

NOT_INITIALIZED = "tedebug is not initialized: call tedebug.debug_api.initialize(...) first"


def session() -> "DebugSession":
    """The active session; RuntimeError when tedebug is not initialised."""
    current = DEBUG_MANAGER
    if current is None:
        raise RuntimeError(NOT_INITIALIZED)
    return current


def is_enabled() -> bool:
    """True while a session is active."""
    return DEBUG_MANAGER is not None


def get_iteration() -> int:
    """The active session's iteration counter; RuntimeError when tedebug is not initialised."""
    return session().iteration


def log_message(
    message: str, layer_name: Optional[str] = None, level: int = logging.INFO, extra_cachable_args: Any = None
) -> None:
    """Write `message` to the main log once per distinct (layer, message, extra_cachable_args) in this session."""
    session().log_message(message, layer_name, level, extra_cachable_args)
