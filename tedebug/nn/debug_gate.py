"""The per-GEMM debug gate: decides, once per iteration and at O(1) cost, whether a GEMM runs the debug path.

One `LayerDebugState` belongs to one GEMM of a layer (Linear and LayerNormLinear have one; LayerNormMLP has two,
named ``<name>.fc1`` and ``<name>.fc2``; GroupedLinear one per ``<name>.gemm_<i>``).  The layer calls
`debug_quantizers(layer_name, quantizers)` before each forward:

* debug not initialised -> None after one attribute check;
* the first call of an iteration decides ``active = next_iter is not None and iteration >= next_iter``; the
  decision is reused by every later call (microbatch) of that iteration;
* when active, six `DebugQuantizer`s are built from the layer's normal quantizers (roles input, weight, output,
  grad_input, grad_weight, grad_output -> tensors activation, weight, output, dgrad, wgrad, gradient, constructed
  in that order); ``next_iter`` becomes the minimum of their non-None next iterations (None: this GEMM never
  enters debug again in the session); if none of them has a feature enabled, None is returned (the rest of the
  iteration then also returns None).
* the six of the previous call are renewed (`tedebug.debug_quantization.renew_quantizers`: iteration set, usages
  reset, the plans' answers taken again, an answer shared by consecutive quantizers asked once) instead of built
  again when that is the same thing: same layer name, the very same normal quantizers and TP group, and each
  quantizer's `tedebug.plan.TensorPlan` still the session's plan for its tensor.  So a logged GEMM does not
  allocate six quantizers per call; the returned dict is then the same object as the previous call's.

Returning None means "use the normal quantizers and the normal fused path".  A role missing from `quantizers`
(or mapped to None) gets parent None; for LayerNormMLP the GEMM-output roles (grad_input -> dgrad,
grad_weight -> wgrad) of both fc1 and fc2 therefore get parent None, like every GEMM output.

A new `debug_api.initialize()` (after `end_debug()`) starts a new session; the state notices it by comparing a
weak reference to the session object, and starts over (next_iter 0, no remembered decision).
"""

from __future__ import annotations

import operator
import weakref
from typing import Dict, Mapping, Optional, Tuple

from tedebug import active
from tedebug.debug_quantization import DebugQuantizer, current_plans, renew_quantizers
from tedebug.usage_checks import note_layer

#: (layer role, tensor name) in construction order.
ROLE_TO_TENSOR = (
    ("input", "activation"),
    ("weight", "weight"),
    ("output", "output"),
    ("grad_input", "dgrad"),
    ("grad_weight", "wgrad"),
    ("grad_output", "gradient"),
)
_ROLES = frozenset(role for role, _ in ROLE_TO_TENSOR)
_ROLES_IN_ORDER = tuple(role for role, _ in ROLE_TO_TENSOR)


def _dead_session():
    return None


class LayerDebugState:
    """Debug decision and next debug iteration of one GEMM, for the current debug session."""

    __slots__ = ("next_iter", "_session_ref", "_decided_iteration", "_active", "_last", "__weakref__")

    def __init__(self) -> None:
        self._session_ref = _dead_session
        self._reset()

    def _reset(self) -> None:
        self.next_iter: Optional[int] = 0
        self._decided_iteration: Optional[int] = None
        self._active = False
        #: (layer name, parents in ROLE_TO_TENSOR order, TP group, TP size, the session's plan table or None,
        #: role -> DebugQuantizer, the same quantizers as a tuple) of the last build: renewed while all of it holds
        self._last: Optional[
            Tuple[str, tuple, object, int, Optional[dict], Dict[str, DebugQuantizer], Tuple[DebugQuantizer, ...]]
        ] = None

    def debug_quantizers(
        self, layer_name: str, quantizers: Mapping[str, object], tp_group=None, tp_size: int = 1
    ) -> Optional[Dict[str, DebugQuantizer]]:
        """Role -> DebugQuantizer for this call, or None when the layer uses its normal quantizers."""
        session = active.DEBUG_MANAGER
        if session is None:
            return None
        if self._session_ref() is not session:
            self._session_ref = weakref.ref(session)
            self._reset()
            # for the session's warnings: "selected no layer", "no step()", "two modules under one name"
            note_layer(session, layer_name, self)
        iteration = session.iteration
        if iteration != self._decided_iteration:
            self._decided_iteration = iteration
            self._active = self.next_iter is not None and iteration >= self.next_iter
        if not self._active or session.paused:  # (read only in an iteration this layer is debugged in)
            return None
        built = self._build(layer_name, quantizers, tp_group, tp_size, iteration)
        if built is None:
            self._active = False  # nothing enabled: the same answer for the rest of this iteration
        return built

    def _build(
        self,
        layer_name: str,
        quantizers: Mapping[str, object],
        tp_group,
        tp_size: int,
        iteration: Optional[int] = None,
    ) -> Optional[Dict[str, DebugQuantizer]]:
        if not _ROLES.issuperset(quantizers):
            unknown = set(quantizers) - _ROLES
            raise KeyError(
                f"LayerDebugState for layer {layer_name!r}: unknown quantizer roles {sorted(unknown)}; "
                f"expected a subset of {sorted(_ROLES)}"
            )
        parents = tuple(map(quantizers.get, _ROLES_IN_ORDER))
        plans = current_plans()
        last = self._last
        if (
            plans is not None
            and last is not None
            and last[4] is plans
            and last[0] == layer_name
            and last[2] is tp_group
            and last[3] == tp_size
            and all(map(operator.is_, parents, last[1]))
        ):
            # the same plans, parents and TP group: renew (module docstring)
            self.next_iter, needed = renew_quantizers(
                last[6], active.get_iteration() if iteration is None else iteration
            )
            return last[5] if needed else None
        result = {
            role: DebugQuantizer(layer_name, tensor, parent, tp_group, tp_size)
            for (role, tensor), parent in zip(ROLE_TO_TENSOR, parents)
        }
        built = tuple(result.values())
        # the table the new quantizers' plans are in (built after them: compiling may have created it)
        self._last = (layer_name, parents, tp_group, tp_size, current_plans(), result, built)
        next_iter = None  # the earliest next debug iteration of the six
        for q in built:
            nxt = q.get_next_debug_iter()
            if nxt is not None and (next_iter is None or nxt < next_iter):
                next_iter = nxt
        self.next_iter = next_iter
        return result if any(q.any_feature_enabled() for q in built) else None

    @property
    def active(self) -> bool:
        """The decision of the last decided iteration (for layers that branch on it after the call)."""
        return self._active
