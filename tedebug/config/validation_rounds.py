"""Every problem of one feature block, from a feature validator that stops at its first error.

A feature's `validate_feature_config(cfg)` raises one `ValueError` (with an optional `.key_path` below the block).
`collect_validator_issues` runs it again on a copy of the block without the offending key or list item, until it
passes, so a block with several mistakes is reported in one load instead of one mistake per run.  Key paths are
reported in the coordinates of the original block (a removed list item does not shift the indices of later ones).
It stops when an error has no key path, when its key cannot be removed, when an error lands on a container of an
item already removed (a consequence of the removal, e.g. "stats must not be empty"), or after `MAX_ROUNDS` rounds.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Tuple

#: at most this many problems are collected per feature block
MAX_ROUNDS = 20

Issue = Tuple[str, tuple]  # (message, key path below the feature block)


def _to_original(path: tuple, removed: Dict[tuple, List[int]]) -> tuple:
    """Map a key path of the pruned copy to the original block."""
    original: list = []
    for key in path:
        if isinstance(key, int) and not isinstance(key, bool):
            for index in sorted(removed.get(tuple(original), ())):
                if index <= key:
                    key += 1
        original.append(key)
    return tuple(original)


def _remove(data, path: tuple) -> bool:
    """Delete the element at `path` in `data`; False when there is none."""
    if not path:
        return False
    parent = data
    for key in path[:-1]:
        try:
            parent = parent[key]
        except (KeyError, IndexError, TypeError):
            return False
    last = path[-1]
    if isinstance(parent, dict) and last in parent:
        del parent[last]
        return True
    if isinstance(parent, list) and isinstance(last, int) and not isinstance(last, bool) and 0 <= last < len(parent):
        del parent[last]
        return True
    return False


def collect_validator_issues(validator: Callable[[dict], None], cfg: dict) -> List[Issue]:
    """`(message, key path)` of every problem `validator` finds in `cfg` (see the module docstring)."""
    work = copy.deepcopy(cfg)
    removed: Dict[tuple, List[int]] = {}
    found: List[Issue] = []
    for _ in range(MAX_ROUNDS):
        try:
            validator(copy.deepcopy(work))
            return found
        except ValueError as err:
            path = tuple(getattr(err, "key_path", ()) or ())
            original = _to_original(path, removed)
            if found and any(reported[: len(original)] == original for _, reported in found):
                return found  # a consequence of an earlier removal
            found.append((str(err), original))
            if not _remove(work, path):
                return found
            if isinstance(original[-1], int) and not isinstance(original[-1], bool):
                removed.setdefault(original[:-1], []).append(original[-1])
    return found
