"""`compat_imports()`: while a user feature file executes, its nvdlfw-inspect / TE imports resolve to tedebug.

Inside the context, ``sys.modules`` maps ``nvdlfw_inspect`` and each of its public submodules to the modules of
`tedebug.compat.nvdlfw_inspect`, and ``transformer_engine.debug.features.api`` to `tedebug.compat.te_features_api`.
Entries that were there before (a real nvdlfw-inspect or TransformerEngine imported by the process) are put back
when the context ends, and the aliases are removed, so that code outside feature files (TE checks
``"nvdlfw_inspect" in sys.modules``) never sees them.  A feature file keeps the objects it imported; an import
statement that a feature runs later, inside a function, is not redirected.

Supported import forms: ``import nvdlfw_inspect.api as debug_api``, ``from nvdlfw_inspect.registry import Registry,
api_method`` (any public nvdlfw module), and ``from transformer_engine.debug.features.api import TEConfigAPIMapper``
(the ``from`` form only: the parent packages ``transformer_engine``, ``transformer_engine.debug`` are not provided).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Dict, Iterator

COMPAT_ROOT = "tedebug.compat.nvdlfw_inspect"
NVDLFW_MODULES = (
    "",
    ".api",
    ".registry",
    ".base",
    ".logging",
    ".utils",
    ".config_manager",
    ".debug_features",
    ".debug_features.log_tensor_stats",
    ".debug_features.generic_feature_api",
)
TE_API = "transformer_engine.debug.features.api"


def alias_table() -> Dict[str, object]:
    """Module name seen by feature files -> the tedebug module it resolves to."""
    table = {f"nvdlfw_inspect{suffix}": importlib.import_module(COMPAT_ROOT + suffix) for suffix in NVDLFW_MODULES}
    table[TE_API] = importlib.import_module("tedebug.compat.te_features_api")
    return table


_MISSING = object()


@contextlib.contextmanager
def compat_imports() -> Iterator[None]:
    """Redirect the nvdlfw-inspect / TE module names to tedebug's compatibility modules (see the module docstring)."""
    table = alias_table()
    # Submodules of a real nvdlfw_inspect that the table does not cover would still be found through the real
    # package object; hide every entry under the names for the duration.
    hidden = {
        name: module
        for name, module in list(sys.modules.items())
        if name == "nvdlfw_inspect" or name.startswith("nvdlfw_inspect.")
    }
    saved = {name: sys.modules.get(name, _MISSING) for name in table}
    for name in hidden:
        del sys.modules[name]
    sys.modules.update(table)
    try:
        yield
    finally:
        for name, module in table.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        for name, module in saved.items():
            if module is not _MISSING:
                sys.modules[name] = module
        sys.modules.update(hidden)
