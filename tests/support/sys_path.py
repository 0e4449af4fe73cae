"""Which entries of sys.path the test session keeps (used by tests/conftest.py before any test module loads).

``python -m pytest`` puts the repository's root first on sys.path.  Its ``kernels/`` folder (installed as
``tedebug.kernels``, which is how tedebug reads it) would then stand in for the Hugging Face ``kernels`` package,
which transformers 5 imports whenever it is installed, so the session drops the root - but only where tedebug is
importable without it (the editable install of ``make test``).  Where tedebug is found only through the root (a
checkout on ``PYTHONPATH``, as on a GPU machine without pip access), the root stays: the processes that the
distributed tests spawn take the parent's sys.path, and without the root they could not import tedebug.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Iterable, List, Optional, Sequence


def found_without(name: str, path: Sequence[str], finders: Iterable[object]) -> bool:
    """Whether one of `finders` (sys.meta_path's) finds the top-level module `name` with sys.path `path`: the path
    finder is asked about `path`, every other finder (an editable install's) as it is."""
    for finder in finders:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, list(path)) if finder is PathFinder else find_spec(name, None)
        except Exception:  # a third-party finder that cannot answer this question
            continue
        if spec is not None:
            return True
    return False


def without_repository_root(path: Sequence[str], root: Path, finders: Optional[Iterable[object]] = None) -> List[str]:
    """`path` without the entries that are `root` ("" is the current directory), when tedebug is importable
    without them; else `path` unchanged."""
    kept = [entry for entry in path if Path(entry or os.curdir).resolve() != root]
    if len(kept) == len(path):
        return list(path)
    return kept if found_without("tedebug", kept, sys.meta_path if finders is None else finders) else list(path)
