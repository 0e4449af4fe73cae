"""Reading an environment variable on a hot path (every logged tensor) at the cost of one dict lookup.

`environ_reader(name)` returns a function giving ``os.environ.get(name)``: the same value, read at every call (so
``monkeypatch.setenv`` or ``os.environ[name] = ...`` in the middle of a run takes effect at once), but looked up in
``os.environ``'s own encoded mapping instead of going through its ``Mapping.get`` (which encodes the key and, for an
unset variable, raises and catches a KeyError: about a microsecond, paid by every kernel dispatch).  Interpreters
whose ``os.environ`` lacks that mapping get ``os.environ.get`` itself.
"""

from __future__ import annotations

import os
from typing import Callable, Optional


def environ_reader(name: str) -> Callable[[], Optional[str]]:
    """A function returning ``os.environ.get(name)`` (None when unset)."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    decode = getattr(os.environ, "decodevalue", None)
    if not (isinstance(data, dict) and callable(encode) and callable(decode)):
        return lambda: os.environ.get(name)
    key = encode(name)
    lookup = data.get
    last = [None, None]  # (encoded value, decoded value) of the previous call

    def read() -> Optional[str]:
        raw = lookup(key)
        if raw is None:
            return None
        if raw is not last[0]:
            last[0], last[1] = raw, decode(raw)
        return last[1]

    return read
