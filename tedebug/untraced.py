"""`untraced(function)`: a function as torch.compile's tracer (Dynamo) leaves it, a graph break at each call.

Why: tedebug's debug path (the gate, the plans, the features, the statistics engine) is host bookkeeping with side
effects.  Traced, Dynamo follows it into the graph and compiles it again for each layer and iteration until its
recompile limit; called untraced it runs as in eager mode, with the same results.  The debug GEMM call
(`tedebug.nn.base.linear_gemm`), a debug call's backward (`_LinearFunction.backward`) and the hook compiled
autograd calls for the compiled linear (`tedebug.nn.compiled_linear.traced_hook`) take it while the tracer runs
(`tedebug.host_numpy.compiling`).

How: ``torch.compiler.disable(function)``, made at the first call and kept.  Only called where torch.compile runs,
so torch._dynamo is loaded by then: wrapping at import would load it with tedebug, over a second for every run.
"""

from __future__ import annotations

from typing import Callable, Dict, TypeVar

import torch

T = TypeVar("T")

#: function -> its untraced form
_UNTRACED: Dict[Callable[..., object], Callable[..., object]] = {}


def untraced(function: Callable[..., T]) -> Callable[..., T]:
    """`function` wrapped by ``torch.compiler.disable`` (made once per function)."""
    wrapped = _UNTRACED.get(function)
    if wrapped is None:
        wrapped = _UNTRACED[function] = torch.compiler.disable(function)
    return wrapped  # type: ignore[return-value]


__all__ = ["untraced"]
