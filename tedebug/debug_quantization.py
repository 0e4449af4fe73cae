"""The debug path of one tensor of one GEMM layer: `DebugQuantizer` and `DebugQuantizedTensor`.

A `DebugQuantizer` stands in for a layer's normal quantizer (its *parent*, possibly None) for one of the six tensor
names (activation, weight, gradient, output, wgrad, dgrad) during a debug iteration.  At construction it asks the
`transformer_engine` hooks what to do with the tensor and fixes a *plan* per GEMM direction (rowwise / columnwise):

* ``"modify_tensor()"``  - a feature's `modify_tensor` produces that GEMM operand;
* ``"Quantize"``         - the parent quantizes it as usual (one parent call shared by both directions);
* ``"High Precision"``   - the operand is the high-precision tensor.

`quantize` then produces a `DebugQuantizedTensor` holding one object per direction (possibly the same object) and
runs the inspection hooks.  GEMM-output tensors (output, wgrad, dgrad) go through `process_gemm_output` instead.

Every hook is called through the cached namespace object; routing (config lookup) is the namespace's business.

Host cost: a layer builds six DebugQuantizers per GEMM call of a debug iteration.  When, for a (layer, tensor,
parent or not), every hook but `inspect_tensor_enabled` has a session-constant answer (no feature serves it), the
first construction stores a *route template* in the session memo (`TEMPLATE_TABLE`); later constructions ask only
`inspect_tensor_enabled` and copy the plans.  Features observe the same calls either way (the namespace never calls
a feature for those constant answers); a hook overridden on the namespace instance, or a stand-in installed as
``debug_api.transformer_engine``, disables templates, so it sees every call.  A quantizer routed that way
(`from_template`) can also be *renewed* for a later call (`renew`: the iteration set and `inspect_tensor_enabled`
asked again, exactly what a new construction from the template does), which `tedebug.nn.debug_gate` does instead of
building six new quantizers per GEMM call.  `inspect_tensor` goes through the namespace once per quantizer; later
calls go straight to the one feature method serving it (`TransformerEngineNamespace.direct_route`), which is what the
namespace would do with them, or to the feature's own bound form of that call when it offers one
(``prepare_inspect_tensor(config, layer_name, tensor_name)``, e.g. LogTensorStats: its plan looked up once).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from tedebug import debug_api
from tedebug.config.parsing import GEMMS_OF_TENSOR
from tedebug.namespace import HOOKS, TE_NAMESPACE, check_output
from tedebug.quantization.tensor import QuantizedTensor, Quantizer

#: plan constants; their values are the strings written in the plan log lines.
API_CALL_MODIFY = "modify_tensor()"
STANDARD_QUANTIZE = "Quantize"
HIGH_PRECISION = "High Precision"

GemmOperand = Union[torch.Tensor, QuantizedTensor, None]


def enabled_and_next(result, iteration: int, *, hook: str, layer_name: str) -> Tuple[bool, Optional[int]]:
    """Normalise a `*_enabled` hook result to ``(enabled, next_iteration_or_None)``.

    A tuple ``(bool, next)`` is taken as is; a bare bool (deprecated form) means "ask again next iteration".
    """
    if isinstance(result, tuple):
        if len(result) != 2:
            raise TypeError(
                f"{hook}() for layer {layer_name!r} returned a tuple of length {len(result)}; "
                f"expected (bool, Optional[int])"
            )
        enabled, nxt = result
        if nxt is not None and not isinstance(nxt, int):
            raise TypeError(
                f"{hook}() for layer {layer_name!r} returned next iteration {nxt!r}; expected an int or None"
            )
        return bool(enabled), nxt
    if isinstance(result, bool):
        return result, iteration + 1
    raise TypeError(
        f"{hook}() for layer {layer_name!r} returned {type(result).__name__}; expected bool or (bool, Optional[int])"
    )


def _min_next(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


#: the one hook a route template still asks at every construction (schedule-driven: its answer varies)
_LIVE_HOOK = "inspect_tensor_enabled"
_INSPECT_HOOK = "inspect_tensor"
#: the attributes `_route` fixes besides `inspect_tensor_enabled`, copied from a route template
_TEMPLATE_ATTRS = ("rowwise_tensor_plan", "columnwise_tensor_plan", "rowwise_postquantize_enabled",
                   "columnwise_postquantize_enabled")
#: the session memo table of route templates, keyed by (layer, tensor, parent is not None)
TEMPLATE_TABLE = "DebugQuantizer.route_templates"


class RouteTemplate(NamedTuple):
    """What `_route` found for one (layer, tensor, parent or not) when every hook but `inspect_tensor_enabled` had
    a session-constant answer (no feature serves it: the namespace's `unrouted_answer`)."""

    attrs: Dict[str, Any]  # the `_TEMPLATE_ATTRS` values


_DEBUG_API_ATTRS = vars(debug_api)
_UNSET = object()


def te_namespace():
    """``debug_api.transformer_engine``: a module attribute set on `debug_api` (a test's spy) first, as attribute
    lookup does, else the module's ``__getattr__`` (the session's namespace; RuntimeError when not initialised)."""
    api = _DEBUG_API_ATTRS.get("transformer_engine", _UNSET)
    if api is _UNSET:
        current = debug_api.DEBUG_MANAGER
        api = current.namespaces.get(TE_NAMESPACE, _UNSET) if current is not None else _UNSET
        if api is _UNSET:
            return debug_api.transformer_engine
    return api


def route_templates(api) -> Optional[dict]:
    """The active session's route-template table, or None when templates may not be used: `api` is not the
    session's own `transformer_engine` namespace (a spy or wrapper sees every call), or a hook is overridden on
    the namespace instance (an override is always called)."""
    current = debug_api.DEBUG_MANAGER
    if current is None or current.namespaces.get(TE_NAMESPACE) is not api:
        return None
    if not api.__dict__.keys().isdisjoint(HOOKS):
        return None
    return current.memo(TEMPLATE_TABLE)


class DebugQuantizer(Quantizer):
    """Quantizer used in place of a layer's normal quantizer for one tensor during a debug iteration.

    `parent_quantizer` is the layer's normal quantizer for that tensor (None when the GEMM runs in high precision).
    Both usage flags start True.  The plans and enabled flags are fixed at construction for `self.iteration`.
    """

    is_debug = True

    def __init__(self, layer_name: str, tensor_name: str, parent_quantizer: Optional[Quantizer], tp_group,
                 tp_size: int = 1) -> None:
        super().__init__(rowwise=True, columnwise=True)
        gemms = GEMMS_OF_TENSOR.get(tensor_name)
        if gemms is None:
            raise ValueError(
                f"DebugQuantizer for layer {layer_name!r}: unknown tensor name {tensor_name!r}; "
                f"expected one of {sorted(GEMMS_OF_TENSOR)}"
            )
        if parent_quantizer is not None:
            if not isinstance(parent_quantizer, Quantizer):
                raise TypeError(
                    f"DebugQuantizer for {layer_name!r}/{tensor_name}: parent_quantizer must be a Quantizer or None, "
                    f"got {type(parent_quantizer).__name__}"
                )
            if getattr(parent_quantizer, "is_debug", False):
                raise TypeError(
                    f"DebugQuantizer for {layer_name!r}/{tensor_name}: the parent is already a DebugQuantizer")
        self.layer_name = layer_name
        self.tensor_name = tensor_name
        self.parent_quantizer = parent_quantizer
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.rowwise_gemm_name, self.columnwise_gemm_name = gemms
        self.iteration = debug_api.get_iteration()
        api = self._api = te_namespace()
        # the namespace's known-answer shortcut; absent on stand-ins (spies, wrappers), which see every call
        self._known_answer = getattr(type(api), "known_answer", None)
        self._next_debug_iter: Optional[int] = None
        #: the feature route `_inspect` calls directly after its first call through the namespace (None: through
        #: the namespace; see `TransformerEngineNamespace.direct_route`)
        self._inspect_route = None
        #: the route feature's `prepare_inspect_tensor` result for this tensor (None: call `_inspect_route`)
        self._inspect_prepared = None
        self._inspect_asked = False  # `direct_route` was asked (its None answer is not asked again)
        #: True when every hook but `inspect_tensor_enabled` has a session-constant answer here (a route template
        #: exists for this tensor): `renew` may then stand in for a new construction
        self.from_template = False
        if parent_quantizer is not None:
            # Full tensor objects in the usual layout: debug features may run any op on them.
            parent_quantizer.internal = False
            parent_quantizer.optimize_for_gemm = False
        templates = route_templates(api) if self._known_answer is not None else None
        if templates is None:
            self._route()
            return
        key = (layer_name, tensor_name, parent_quantizer is not None)
        template = templates.get(key)
        if template is not None:
            self._route_from(template)
            self.from_template = True
            return
        asked: List[Tuple[str, Optional[str], Optional[str], Optional[int]]] = []
        self._route(asked)
        template = self._make_template(api, asked)
        if template is not None:
            templates[key] = template
            self.from_template = True

    def renew(self) -> None:
        """Make this quantizer what a new construction with the same arguments would be now: the current iteration,
        both usages on, `inspect_tensor_enabled` asked again (its next iteration recomputed).  Only for a quantizer
        `from_template` while the session still uses route templates for its namespace (`renewable`); the plans
        are session constants then."""
        self.iteration = debug_api.get_iteration()
        self.rowwise_usage = self.columnwise_usage = True
        self._next_debug_iter = None
        self.inspect_tensor_enabled = self._ask(_LIVE_HOOK, None, self.tensor_name)

    def renewable(self) -> bool:
        """True when `renew` may stand in for a new construction: routed from a template, and the active session's
        namespace is still the one it asks and still allows templates (no hook overridden since)."""
        return self.from_template and te_namespace() is self._api and route_templates(self._api) is not None

    # ------------------------------------------------------------------ construction-time routing
    @property
    def is_output_type(self) -> bool:
        """True for GEMM outputs (output, wgrad, dgrad): only `process_gemm_output` applies."""
        return self.columnwise_gemm_name is None

    def _ask(self, hook: str, gemm: Optional[str] = None, tensor_name: Optional[str] = None,
             asked: Optional[list] = None) -> bool:
        """Call a `*_enabled` hook, fold its next iteration into `_next_debug_iter`, return the bool.

        The hook gets ``gemm`` / ``tensor_name`` when given (not None).  After the first call for a (layer, gemm,
        tensor), the namespace answers without calling the features when none serves the hook (its constant
        default) or when the serving features answer from their schedules alone
        (`TransformerEngineNamespace.known_answer`).  `asked` (when given) receives ``(hook, gemm, tensor_name,
        next)`` for the route template.
        """
        known = self._known_answer
        result = None if known is None else known(self._api, hook, self.layer_name, gemm, tensor_name,
                                                  self.iteration)
        if result is None:
            kwargs = {}
            if gemm is not None:
                kwargs["gemm"] = gemm
            if tensor_name is not None:
                kwargs["tensor_name"] = tensor_name
            result = getattr(self._api, hook)(self.layer_name, iteration=self.iteration, **kwargs)
        enabled, nxt = enabled_and_next(result, self.iteration, hook=hook, layer_name=self.layer_name)
        self._next_debug_iter = _min_next(self._next_debug_iter, nxt)
        if asked is not None:
            asked.append((hook, gemm, tensor_name, nxt))
        return enabled

    def _plan(self, gemm: str, asked: Optional[list]) -> str:
        """Plan of one direction: modify > Quantize (parent exists and quantized GEMM enabled) > High Precision."""
        if self._ask("modify_tensor_enabled", gemm, self.tensor_name, asked):
            return API_CALL_MODIFY
        if self.parent_quantizer is not None and self._ask("fp8_gemm_enabled", gemm, None, asked):
            return STANDARD_QUANTIZE
        return HIGH_PRECISION

    def _route(self, asked: Optional[list] = None) -> None:
        """Ask every `*_enabled` hook of this tensor and fix the plans (hook order: spec E.2)."""
        self.inspect_tensor_enabled = self._ask("inspect_tensor_enabled", None, self.tensor_name, asked)
        if self.is_output_type:
            modify = self._ask("modify_tensor_enabled", self.rowwise_gemm_name, self.tensor_name, asked)
            self.rowwise_tensor_plan = API_CALL_MODIFY if modify else HIGH_PRECISION
            self.columnwise_tensor_plan = None
            self.rowwise_postquantize_enabled = self.columnwise_postquantize_enabled = False
            return
        self.rowwise_postquantize_enabled = self._ask(
            "inspect_tensor_postquantize_enabled", self.rowwise_gemm_name, self.tensor_name, asked)
        self.columnwise_postquantize_enabled = self._ask(
            "inspect_tensor_postquantize_enabled", self.columnwise_gemm_name, self.tensor_name, asked)
        self.rowwise_tensor_plan = self._plan(self.rowwise_gemm_name, asked)
        self.columnwise_tensor_plan = self._plan(self.columnwise_gemm_name, asked)
        self._log_plans()

    def _make_template(self, api, asked: list) -> Optional["RouteTemplate"]:
        """The route template of this (layer, tensor, parent or not) after a full `_route`, or None when a hook other
        than `inspect_tensor_enabled` is served by a feature (its answer may change, so every construction asks
        again).  The constant answers (the spec defaults) name no next iteration, so they add nothing to
        `_next_debug_iter`."""
        for hook, gemm, tensor_name, nxt in asked:
            if hook == _LIVE_HOOK:
                continue
            if nxt is not None or api.unrouted_answer(hook, self.layer_name, gemm, tensor_name) is None:
                return None
        return RouteTemplate({name: getattr(self, name) for name in _TEMPLATE_ATTRS})

    def _route_from(self, template: "RouteTemplate") -> None:
        """`_route` for a tensor whose hooks, but `inspect_tensor_enabled`, have session-constant answers: ask that
        one hook (as `_route` would: through the namespace's known answer or a call), copy the rest.  Its plan
        lines were written by the construction that made the template."""
        self.inspect_tensor_enabled = self._ask(_LIVE_HOOK, None, self.tensor_name)
        self.__dict__.update(template.attrs)

    def _log_plans(self) -> None:
        """The plan lines of both directions (written once per session and distinct line; the session memo skips
        building lines that were already written)."""
        logged = debug_api.session().memo("DebugQuantizer.plan_lines")
        key = (self.layer_name, self.tensor_name, self.rowwise_tensor_plan, self.columnwise_tensor_plan)
        if key in logged:
            return
        for gemm, plan in ((self.rowwise_gemm_name, self.rowwise_tensor_plan),
                           (self.columnwise_gemm_name, self.columnwise_tensor_plan)):
            debug_api.log_message(f"Tensor: {self.tensor_name}, gemm {gemm} - {plan}", layer_name=self.layer_name)
        logged[key] = True

    # ------------------------------------------------------------------ gate queries
    def any_feature_enabled(self) -> bool:
        """True when this tensor needs the debug path in this iteration."""
        if self.is_output_type:
            return self.inspect_tensor_enabled or self.rowwise_tensor_plan == API_CALL_MODIFY
        plans = (self.rowwise_tensor_plan, self.columnwise_tensor_plan)
        if (self.inspect_tensor_enabled or self.rowwise_postquantize_enabled or self.columnwise_postquantize_enabled
                or API_CALL_MODIFY in plans):
            return True
        # Quantization disabled for a GEMM also needs the debug path (the normal path would quantize).
        return self.parent_quantizer is not None and any(p != STANDARD_QUANTIZE for p in plans)

    def get_next_debug_iter(self) -> Optional[int]:
        """Earliest iteration at which any hook of this tensor may become active (None: never again)."""
        return self._next_debug_iter

    @property
    def recipe_name(self) -> str:  # type: ignore[override]
        return self.parent_quantizer.recipe_name if self.parent_quantizer is not None else ""

    # ------------------------------------------------------------------ usage
    def _parent_usage(self) -> Tuple[bool, bool]:
        """(rowwise, columnwise) the parent must produce: own usage restricted to the Quantize directions."""
        return (self.rowwise_usage and self.rowwise_tensor_plan == STANDARD_QUANTIZE,
                self.columnwise_usage and self.columnwise_tensor_plan == STANDARD_QUANTIZE)

    def _uses_parent(self) -> bool:
        return self.parent_quantizer is not None and STANDARD_QUANTIZE in (
            self.rowwise_tensor_plan, self.columnwise_tensor_plan)

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Set own usage flags and synchronise the parent's flags to the Quantize directions."""
        super().set_usage(rowwise=rowwise, columnwise=columnwise)
        if not self.is_output_type and self._uses_parent():
            row, col = self._parent_usage()
            self.parent_quantizer.set_usage(rowwise=row, columnwise=col)

    def supports_only_rowwise_all_gather(self) -> bool:
        fn = getattr(self.parent_quantizer, "supports_only_rowwise_all_gather", None)
        return bool(fn()) if fn is not None else False

    # ------------------------------------------------------------------ quantize
    def _check_not_output(self, what: str) -> None:
        if self.is_output_type:
            raise RuntimeError(
                f"DebugQuantizer.{what}: {self.layer_name!r}/{self.tensor_name} is a GEMM output; "
                f"use process_gemm_output() for output, wgrad and dgrad"
            )

    def _quantize(self, tensor: torch.Tensor) -> "DebugQuantizedTensor":
        return self.quantize(tensor)

    def quantize(self, tensor: torch.Tensor, *, out: Optional["DebugQuantizedTensor"] = None,
                 dtype: Optional[torch.dtype] = None) -> "DebugQuantizedTensor":
        """Build the GEMM operands of `tensor` following the plans, run the inspect hooks, wrap them.

        With `out` (a DebugQuantizedTensor made by this quantizer) the operands are refreshed in place.
        """
        self._check_not_output("quantize")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"DebugQuantizer.quantize ({self.layer_name!r}/{self.tensor_name}) expects a "
                            f"torch.Tensor, got {type(tensor).__name__}")
        if out is not None:
            return self.update_quantized(tensor, out)
        rowwise, columnwise = self._gemm_operands(tensor, dtype)
        self._inspect(tensor, rowwise, columnwise)
        return DebugQuantizedTensor(rowwise, columnwise, self, self.layer_name, self.tensor_name)

    def __call__(self, tensor: torch.Tensor) -> "DebugQuantizedTensor":
        return self.quantize(tensor)

    def quantize_without_inspection(self, tensor: torch.Tensor) -> "DebugQuantizedTensor":
        """The GEMM operands of `tensor` following the plans, without the inspection hooks: for an activation
        recompute (`tedebug.nn`), whose operands were inspected in the original forward."""
        self._check_not_output("quantize")
        rowwise, columnwise = self._gemm_operands(tensor, None)
        return DebugQuantizedTensor(rowwise, columnwise, self, self.layer_name, self.tensor_name)

    def _gemm_operands(self, tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> Tuple[GemmOperand, GemmOperand]:
        row_plan, col_plan = self.rowwise_tensor_plan, self.columnwise_tensor_plan
        rowwise = columnwise = None
        if self._uses_parent():
            quantized = self._parent_quantize(tensor)
            if row_plan == STANDARD_QUANTIZE:
                rowwise = quantized
            if col_plan == STANDARD_QUANTIZE:
                columnwise = quantized
        if col_plan == API_CALL_MODIFY:
            columnwise = self._modify(tensor, self.columnwise_gemm_name, dtype)
        if row_plan == API_CALL_MODIFY:
            rowwise = self._modify(tensor, self.rowwise_gemm_name, dtype)
        if HIGH_PRECISION in (row_plan, col_plan):
            high_precision = tensor if dtype is None else tensor.to(dtype)
            if row_plan == HIGH_PRECISION:
                rowwise = high_precision
            if col_plan == HIGH_PRECISION:
                columnwise = high_precision
        return rowwise, columnwise

    def _parent_quantize(self, tensor: torch.Tensor) -> QuantizedTensor:
        """One parent quantization shared by the Quantize directions.

        Columnwise-only quantization is not supported, so the parent always produces the rowwise representation;
        it produces the columnwise one iff a Quantize direction needs it (columnwise usage on).
        """
        _, col = self._parent_usage()
        self.parent_quantizer.set_usage(rowwise=True, columnwise=col)
        return self.parent_quantizer.quantize(tensor)

    def _modify(self, tensor: torch.Tensor, gemm: str, dtype: Optional[torch.dtype], out=None):
        kwargs = dict(gemm=gemm, tensor_name=self.tensor_name, tensor=tensor,
                      default_quantizer=self.parent_quantizer, iteration=self.iteration)
        if dtype is not None:
            kwargs["dtype"] = dtype
        if out is not None:
            kwargs["out"] = out
        result = self._api.modify_tensor(self.layer_name, **kwargs)
        where = f"modify_tensor() for layer {self.layer_name!r}, tensor {self.tensor_name}, gemm {gemm}"
        if out is not None:
            if result is not None:
                raise ValueError(f"{where} was given out= and must fill it in place and return None, "
                                 f"got {type(result).__name__}")
            return None
        if not isinstance(result, (torch.Tensor, QuantizedTensor)):
            raise TypeError(f"{where} returned {type(result).__name__}; expected a torch.Tensor or QuantizedTensor")
        if dtype is not None and result.dtype != dtype:
            raise ValueError(f"{where} returned dtype {result.dtype}; expected {dtype}")
        return result

    # ------------------------------------------------------------------ inspection
    def _inspect(self, tensor: Optional[torch.Tensor], rowwise: GemmOperand, columnwise: GemmOperand) -> None:
        iteration = debug_api.get_iteration()
        if self.inspect_tensor_enabled:
            api = self._api
            route = self._inspect_route
            if route is None or _INSPECT_HOOK in api.__dict__:
                api.inspect_tensor(
                    self.layer_name, tensor=tensor, tensor_name=self.tensor_name, iteration=iteration,
                    tp_group=self.tp_group, tp_size=self.tp_size, rowwise_quantized_tensor=rowwise,
                    columnwise_quantized_tensor=columnwise, quantizer=self.parent_quantizer,
                )
                direct_route = None if self._inspect_asked else getattr(type(api), "direct_route", None)
                self._inspect_asked = True  # routing is fixed for the session: ask for a direct route once
                if direct_route is not None:
                    route = self._inspect_route = direct_route(api, _INSPECT_HOOK, self.layer_name, None,
                                                               self.tensor_name)
                    prepare = getattr(route.method.__self__, "prepare_inspect_tensor", None) if route else None
                    self._inspect_prepared = (None if prepare is None else
                                              prepare(route.config, self.layer_name, self.tensor_name))
            elif self._inspect_prepared is not None:  # the feature's own bound form of the same call
                self._inspect_prepared(iteration, tensor, self.tp_group, self.tp_size, rowwise, columnwise,
                                       self.parent_quantizer)
            else:  # what the namespace would do with this call (`TransformerEngineNamespace.direct_route`)
                result = route.method(
                    route.config, self.layer_name, tensor=tensor, tensor_name=self.tensor_name, iteration=iteration,
                    tp_group=self.tp_group, tp_size=self.tp_size, rowwise_quantized_tensor=rowwise,
                    columnwise_quantized_tensor=columnwise, quantizer=self.parent_quantizer,
                )
                if result is not None:
                    check_output(HOOKS[_INSPECT_HOOK], route.feature, self.layer_name, {}, result)
        if not (self.rowwise_postquantize_enabled or self.columnwise_postquantize_enabled):
            return
        for operand, plan, enabled, is_rowwise in (
            (rowwise, self.rowwise_tensor_plan, self.rowwise_postquantize_enabled, True),
            (columnwise, self.columnwise_tensor_plan, self.columnwise_postquantize_enabled, False),
        ):
            if enabled and operand is not None and plan in (STANDARD_QUANTIZE, API_CALL_MODIFY):
                self._api.inspect_tensor_postquantize(
                    self.layer_name, tensor=operand, tensor_name=self.tensor_name, iteration=iteration,
                    tp_group=self.tp_group, tp_size=self.tp_size, rowwise=is_rowwise,
                )

    # ------------------------------------------------------------------ GEMM outputs
    def process_gemm_output(self, tensor: torch.Tensor) -> torch.Tensor:
        """Modify (if planned) and inspect a GEMM result; returns the tensor the layer should use."""
        if not self.is_output_type:
            raise RuntimeError(f"DebugQuantizer.process_gemm_output: {self.layer_name!r}/{self.tensor_name} is not a "
                               f"GEMM output (expected output, wgrad or dgrad)")
        if self.parent_quantizer is not None:
            raise RuntimeError(
                f"Layer {self.layer_name!r}, tensor {self.tensor_name}: quantized GEMM outputs "
                f"({type(self.parent_quantizer).__name__}) are not supported in debug mode"
            )
        if self.rowwise_tensor_plan == API_CALL_MODIFY:
            tensor = self._modify(tensor, self.rowwise_gemm_name, None)
        if self.inspect_tensor_enabled:
            self._inspect(tensor, None, None)
        return tensor

    def process_gemm_output_without_inspection(self, tensor: torch.Tensor) -> torch.Tensor:
        """`process_gemm_output` without the inspection (an activation recompute of a GEMM output)."""
        if self.rowwise_tensor_plan == API_CALL_MODIFY:
            tensor = self._modify(tensor, self.rowwise_gemm_name, None)
        return tensor

    # ------------------------------------------------------------------ other quantizer methods
    def update_quantized(self, src: torch.Tensor, dst: "DebugQuantizedTensor", *,
                         noop_flag: Optional[torch.Tensor] = None) -> "DebugQuantizedTensor":
        """Refresh the operands of `dst` in place from `src` (weight cache), then run the inspect hooks."""
        self._check_not_output("update_quantized")
        if noop_flag is not None:
            raise RuntimeError(
                "DebugQuantizer.update_quantized: noop_flag (CUDA graphs) is not supported in debug mode"
            )
        if not isinstance(dst, DebugQuantizedTensor):
            raise TypeError(f"DebugQuantizer.update_quantized expects a DebugQuantizedTensor destination, "
                            f"got {type(dst).__name__}")
        directions = ((dst.rowwise_gemm_tensor, self.rowwise_tensor_plan, self.rowwise_gemm_name),
                      (dst.columnwise_gemm_tensor, self.columnwise_tensor_plan, self.columnwise_gemm_name))
        done: List[object] = []
        for operand, plan, gemm in directions:
            if operand is None or any(operand is d for d in done):
                continue
            done.append(operand)
            if plan == STANDARD_QUANTIZE:
                self.parent_quantizer.update_quantized(src, operand)
            elif plan == API_CALL_MODIFY:
                self._modify(src, gemm, None, out=operand)
            elif operand is not src:
                operand.copy_(src)
        self._inspect(src, dst.rowwise_gemm_tensor, dst.columnwise_gemm_tensor)
        return dst

    def wrap_quantized_tensor(self, qtensor: QuantizedTensor) -> "DebugQuantizedTensor":
        """Wrap a weight that exists only in quantized form (no high-precision copy) and inspect it."""
        self._check_not_output("wrap_quantized_tensor")
        if not (self.rowwise_tensor_plan == STANDARD_QUANTIZE and self.columnwise_tensor_plan == STANDARD_QUANTIZE):
            raise RuntimeError(
                f"Layer {self.layer_name!r}, tensor {self.tensor_name}: a tensor stored only in quantized form "
                f"cannot be modified by any feature nor run in high precision (plans: rowwise "
                f"{self.rowwise_tensor_plan}, columnwise {self.columnwise_tensor_plan}); expected Quantize for both"
            )
        self._inspect(None, qtensor, qtensor)
        return DebugQuantizedTensor(qtensor, qtensor, self, self.layer_name, self.tensor_name)

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None):
        if self.parent_quantizer is not None:
            return self.parent_quantizer.make_empty(shape, dtype=dtype, device=device)
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def calibrate(self, tensor: torch.Tensor) -> None:
        raise RuntimeError("DebugQuantizer: calibration is not supported in debug mode")

    @classmethod
    def multi_tensor_quantize(cls, tensor: torch.Tensor, quantizers: Sequence[Quantizer], m_splits: Sequence[int],
                              activation_dtype: Optional[torch.dtype]) -> list:
        """Grouped GEMMs: split `tensor` along dim 0 by `m_splits` and quantize chunk i with quantizer i."""
        if len(quantizers) != len(m_splits):
            raise ValueError(f"multi_tensor_quantize: {len(quantizers)} quantizers for {len(m_splits)} splits")
        if sum(m_splits) != tensor.shape[0]:
            raise ValueError(f"multi_tensor_quantize: m_splits sum to {sum(m_splits)}, "
                             f"but the tensor has {tensor.shape[0]} rows")
        chunks = torch.split(tensor, list(m_splits))
        return [q.quantize(c, dtype=activation_dtype) if getattr(q, "is_debug", False) else q.quantize(c)
                for q, c in zip(quantizers, chunks)]

    def __repr__(self) -> str:
        return (f"DebugQuantizer(layer={self.layer_name!r}, tensor={self.tensor_name}, "
                f"parent={self.parent_quantizer!r}, plans=({self.rowwise_tensor_plan}, {self.columnwise_tensor_plan}))")


_PLAIN = object()  # marks a saved plain tensor (or None) in DebugQuantizedTensor's save layout


class DebugQuantizedTensor:
    """The GEMM operands of one tensor under debug: one object per direction (possibly one shared object).

    Each direction holds a plain tensor, a `QuantizedTensor` or None (dropped).  The GEMM picks the rowwise object
    or the columnwise one (`get_tensor(transpose)`); a quantized object then gives its matching representation.
    """

    is_debug = True

    def __init__(self, rowwise_gemm_tensor: GemmOperand, columnwise_gemm_tensor: GemmOperand,
                 quantizer: Optional[DebugQuantizer], layer_name: Optional[str] = None,
                 tensor_name: Optional[str] = None) -> None:
        self.rowwise_gemm_tensor = rowwise_gemm_tensor
        self.columnwise_gemm_tensor = columnwise_gemm_tensor
        self.quantizer = quantizer
        self.layer_name = layer_name
        self.tensor_name = tensor_name
        self._saved_layout: Optional[list] = None

    # ------------------------------------------------------------------ access
    def get_tensor(self, transpose: bool) -> GemmOperand:
        """The columnwise object when `transpose`, else the rowwise object."""
        return self.columnwise_gemm_tensor if transpose else self.rowwise_gemm_tensor

    def _any(self):
        obj = self.rowwise_gemm_tensor if self.rowwise_gemm_tensor is not None else self.columnwise_gemm_tensor
        if obj is None:
            raise RuntimeError(f"DebugQuantizedTensor ({self.layer_name}/{self.tensor_name}) holds no tensor "
                               f"in either direction")
        return obj

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._any().shape)

    def size(self, *dim: int):
        return self._any().size(*dim)

    def dim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self._any().device

    @property
    def dtype(self) -> torch.dtype:
        return self._any().dtype

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """High-precision values from the rowwise object (the columnwise one if rowwise was dropped)."""
        obj = self._any()
        if isinstance(obj, QuantizedTensor):
            return obj.dequantize(dtype=dtype)
        return obj if dtype is None else obj.to(dtype)

    def detach(self) -> "DebugQuantizedTensor":
        return self

    # ------------------------------------------------------------------ usage
    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop (False) or require (True) a direction; never recreates one direction from the other."""
        if rowwise_usage is False and columnwise_usage is False:
            raise ValueError("DebugQuantizedTensor.update_usage would drop both directions")
        row, col = self.rowwise_gemm_tensor, self.columnwise_gemm_tensor
        if row is col and isinstance(row, QuantizedTensor):
            row.update_usage(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage)
            return
        self._require(rowwise_usage, columnwise_usage)
        if rowwise_usage is False:
            self.rowwise_gemm_tensor = None
        if columnwise_usage is False:
            self.columnwise_gemm_tensor = None
        if rowwise_usage and isinstance(row, QuantizedTensor):
            row.update_usage(rowwise_usage=True)
        if columnwise_usage and isinstance(col, QuantizedTensor):
            col.update_usage(columnwise_usage=True)
        self._require(rowwise_usage, columnwise_usage)

    def _require(self, rowwise_usage: Optional[bool], columnwise_usage: Optional[bool]) -> None:
        where = f"(layer {self.layer_name!r}, tensor {self.tensor_name})"
        if rowwise_usage and self.rowwise_gemm_tensor is None:
            raise RuntimeError(f"Cannot recreate rowwise tensor from columnwise tensor in debug mode {where}")
        if columnwise_usage and self.columnwise_gemm_tensor is None:
            raise RuntimeError(f"Cannot recreate columnwise tensor from rowwise tensor in debug mode {where}")

    # ------------------------------------------------------------------ autograd saving
    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "DebugQuantizedTensor"]:
        """Hand every raw tensor to autograd; a shared object is saved once."""
        row, col = self.rowwise_gemm_tensor, self.columnwise_gemm_tensor
        objects = [row] if row is col else [row, col]
        tensors: List[Optional[torch.Tensor]] = []
        layout = []
        for obj in objects:
            if isinstance(obj, QuantizedTensor):
                saved, _ = obj.prepare_for_saving()
                tensors.extend(saved)
                layout.append(obj)
            else:
                tensors.append(obj)
                layout.append(_PLAIN)
        self._saved_layout = layout
        self.rowwise_gemm_tensor = self.columnwise_gemm_tensor = None
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Inverse of `prepare_for_saving`; returns the tensors it did not consume."""
        if self._saved_layout is None:
            raise RuntimeError("DebugQuantizedTensor.restore_from_saved called without prepare_for_saving")
        rest = list(tensors)
        restored = []
        for obj in self._saved_layout:
            if obj is _PLAIN:
                if not rest:
                    raise RuntimeError("DebugQuantizedTensor.restore_from_saved: too few saved tensors")
                restored.append(rest.pop(0))
            else:
                rest = list(obj.restore_from_saved(rest))
                restored.append(obj)
        self.rowwise_gemm_tensor = restored[0]
        self.columnwise_gemm_tensor = restored[-1]
        self._saved_layout = None
        return rest

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> "DebugQuantizedTensor":
        """Refresh in place from `tensor` through the quantizer's `update_quantized`."""
        if self.quantizer is None:
            raise RuntimeError("DebugQuantizedTensor.quantize_: no quantizer attached")
        return self.quantizer.update_quantized(tensor, self, noop_flag=noop_flag)

    def __repr__(self) -> str:
        def describe(obj) -> str:
            if obj is None:
                return "None"
            if isinstance(obj, QuantizedTensor):
                return type(obj).__name__
            return f"Tensor({obj.dtype})"

        shared = " (shared)" if self.rowwise_gemm_tensor is self.columnwise_gemm_tensor else ""
        return (f"DebugQuantizedTensor(layer={self.layer_name!r}, tensor={self.tensor_name}, "
                f"rowwise={describe(self.rowwise_gemm_tensor)}, "
                f"columnwise={describe(self.columnwise_gemm_tensor)}{shared})")
