"""The final formulas of a statistics buffer as code: compile the source `tedebug.stats.definitions.row_evaluator`
generates into its ``values_of(row)`` function.

Why a module of its own, importing nothing from tedebug: the statistics writer process
(`tedebug.sinks.writer_child`) evaluates the formulas of the rows it receives, and it imports no torch
(`definitions` does).  The training process sends the source of each buffer layout's function once (`compiled`
keeps it as the function's ``source``), the writer process compiles the same source with the same names, so both
compute the same floats with the same Python arithmetic.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

#: the names the formulas use besides the row
FORMULA_NAMES: Dict[str, Any] = {
    "_nan": math.nan,
    "_inf": math.inf,
    "_sqrt": math.sqrt,
    "_log2": math.log2,
    "float": float,
}
#: the file name of the generated functions (in tracebacks and profiles)
FORMULAS_FILE = "<tedebug statistics formulas>"

#: source -> its compiled function (buffers of one layout share one)
_COMPILED: Dict[str, Callable[[Sequence[float]], List[float]]] = {}


def compiled(source: str) -> Callable[[Sequence[float]], List[float]]:
    """The ``values_of`` function that `source` defines (compiled once per source), with ``source`` set on it."""
    function = _COMPILED.get(source)
    if function is None:
        namespace: Dict[str, Any] = dict(FORMULA_NAMES)
        exec(compile(source, FORMULAS_FILE, "exec"), namespace)
        function = namespace["values_of"]
        function.source = source  # what a writer process compiles again
        _COMPILED[source] = function
    return function


def source_of(function: Callable[..., Any]) -> Optional[str]:
    """The source `compiled` made `function` from, or None for any other function."""
    source = getattr(function, "source", None)
    return source if isinstance(source, str) and _COMPILED.get(source) is function else None


__all__ = ["FORMULAS_FILE", "FORMULA_NAMES", "compiled", "source_of"]
