"""Per-session memoisation: work that depends only on configuration values is done once per session.

This is the one memo mechanism of tedebug's features (schedules, statistic requests, per-tensor inspect plans).
``memoized(table, key, compute)`` returns ``compute()`` the first time `key` is seen in the active session's memo
`table`, and that same object on every later call with an equal key.  The rules:

- The key is compared by content *and type* (`exact_key`): ``1``, ``1.0`` and ``True`` are different keys, a list
  and a tuple with the same items are different keys, list and dict items count in order.  So a config that was
  changed in place gives a new key (a fresh value), never a stale one, and two config objects with the same
  content share one value.
- `compute` must depend only on what the key holds.
- The tables belong to the active session (`DebugSession.memo`): they start empty at `debug_api.initialize()` and
  are dropped at `end_debug()`, so two sessions never share a value.
- Without an active session, or for a key holding an object that is neither hashable nor a list, tuple or dict,
  nothing is stored: `compute()` is simply called.
- A `compute` that raises stores nothing; the next call computes (and raises) again.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

from tedebug import active

T = TypeVar("T")

_PLAIN_TYPES = frozenset((str, int, type(None)))


def exact_key(value: Any) -> Hashable:
    """A hashable key equal to another's only when both values are equal *and* of the same types throughout
    (list / tuple / dict contents in order).  TypeError for a value holding an unhashable object of another kind."""
    kind = type(value)
    if value is None or kind is str or kind is int:
        return value
    if kind is list or kind is tuple:
        items = tuple(value)
        if set(map(type, items)) <= _PLAIN_TYPES:  # the common case (a list of names): no recursion
            return (kind, items)
        return (kind, tuple(map(exact_key, items)))
    if kind is dict:
        return (kind, tuple((exact_key(k), exact_key(v)) for k, v in value.items()))
    hash(value)
    return (kind, value)


def memoized(table: str, key: Any, compute: Callable[[], T]) -> T:
    """``compute()``, done once per active session for each distinct `key` of `table` (see the module docstring)."""
    current = active.DEBUG_MANAGER
    if current is None:
        return compute()
    try:
        content = exact_key(key)
    except TypeError:
        return compute()
    memo = current.memo(table)
    try:
        return memo[content]
    except KeyError:
        value = memo[content] = compute()
        return value
