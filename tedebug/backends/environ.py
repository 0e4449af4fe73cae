"""Reading an environment variable on a hot path (every logged tensor, every launch) without a Python call.

`environ_value(name)` gives ``EnvironValue(raw, decode)``: ``raw()`` is the variable's stored value as
``os.environ`` keeps it (its encoded mapping's bytes object, or None when unset), read at every call, so
``monkeypatch.setenv`` or ``os.environ[name] = ...`` in the middle of a run takes effect at once; ``decode(raw)`` is
the string ``os.environ.get(name)`` gives for it.  ``raw`` is a C-level call (a `functools.partial` of the mapping's
own ``get``): no Python frame, where ``os.environ.get`` encodes the key and, for an unset variable, raises and catches
a KeyError (about a microsecond).  The bytes object stays the same while the variable is not set again, so a caller
that keeps the last raw value it saw (a reference: a new value can never be that object) decodes and checks a value
once per change: ``raw is last`` means unchanged.  Interpreters whose ``os.environ`` lacks that mapping get
``os.environ.get`` itself, whose strings are new objects at each call (decoded and checked every time: correct,
slower).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple, Optional


class EnvironValue(NamedTuple):
    """``raw()``: the variable's stored value or None; ``decode(raw)``: its string (see the module docstring);
    ``text(raw)``: that string, empty for an unset variable."""

    raw: Callable[[], Optional[Any]]
    decode: Callable[[Any], str]

    def text(self, raw: Optional[Any]) -> str:
        """The string of a value `raw()` returned: ``decode(raw)``, or ``""`` for an unset variable (None)."""
        return "" if raw is None else self.decode(raw)


def environ_value(name: str) -> EnvironValue:
    """The readers of variable `name` (see the module docstring)."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    decode = getattr(os.environ, "decodevalue", None)
    if not (isinstance(data, dict) and callable(encode) and callable(decode)):
        return EnvironValue(functools.partial(os.environ.get, name), str)
    return EnvironValue(functools.partial(data.get, encode(name)), decode)
