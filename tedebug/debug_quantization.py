"""The debug path of one tensor of one GEMM layer: `DebugQuantizer` and `DebugQuantizedTensor`.

A `DebugQuantizer` stands in for a layer's normal quantizer (its *parent*, possibly None) for one of the six tensor
names (activation, weight, gradient, output, wgrad, dgrad) during a debug iteration.  It is a compiled
`tedebug.plan.TensorPlan` plus an iteration: at construction (and `renew`) it takes from the plan, for its
iteration, whether the tensor is inspected and the `Plan` of each GEMM direction (rowwise / columnwise):

* ``"modify_tensor()"``  - a feature's `modify_tensor` produces that GEMM operand;
* ``"Quantize"``         - the parent quantizes it as usual (one parent call shared by both directions);
* ``"High Precision"``   - the operand is the high-precision tensor.

`quantize` then produces a `DebugQuantizedTensor` holding one object per direction (possibly the same object) and
runs the inspection through the plan's bound ``inspect_tensor``.  GEMM-output tensors (output, wgrad, dgrad) go
through `process_gemm_output` instead.  `modify_tensor` and the deprecated post-quantization inspection go through
the namespace at every call.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from tedebug import active, debug_api
from tedebug.config.parsing import GEMMS_OF_TENSOR
from tedebug.plan import (  # noqa: F401 (TensorPlan and enabled_and_next re-exported)
    INSPECT,
    PLANS_KEY,
    Plan,
    TensorPlan,
    compile_plan,
    enabled_and_next,
    plan_table,
)
from tedebug.quantization.tensor import QuantizedTensor, Quantizer
from tedebug.stats import launch_group

#: plan constants (`tedebug.plan.Plan` members); their values are the strings written in the plan log lines.
API_CALL_MODIFY = Plan.MODIFY
STANDARD_QUANTIZE = Plan.QUANTIZE
HIGH_PRECISION = Plan.HIGH_PRECISION

GemmOperand = Union[torch.Tensor, QuantizedTensor, None]


def tensor_plan(layer_name: str, tensor_name: str, has_parent: bool) -> Tuple[TensorPlan, Optional[tuple]]:
    """The active session's plan of (layer, tensor, has a parent) and, when it was compiled just now, the answers
    of the compiling iteration (see `tedebug.plan.compile_plan`); RuntimeError when tedebug is not initialised.
    With the plan cache off (``initialize(..., plan_cache=False)``) every call compiles a plan that asks
    ``debug_api.transformer_engine`` every question."""
    current = active.session()
    if not current.plan_cache:
        return compile_plan(
            current,
            debug_api.transformer_engine,
            layer_name,
            tensor_name,
            has_parent,
            current.iteration,
            cacheable=False,
        )
    api = current.transformer_engine
    table = plan_table(api)
    key = (layer_name, tensor_name, has_parent)
    plan = table.get(key)
    if plan is not None:
        return plan, None
    plan, answers = compile_plan(current, api, layer_name, tensor_name, has_parent, current.iteration, cacheable=True)
    table[key] = plan
    return plan, answers


def current_plans() -> Optional[dict]:
    """The active session's table of compiled plans (its identity changes whenever the plans are dropped), or None
    when there is no session, its plan cache is off or no plan was compiled since the plans were last dropped.  A
    `DebugQuantizer` whose plan came from a table that is still current may be renewed instead of built again.
    (Every logged GEMM call asks: the table is looked up where `plan_table` keeps it, without creating it.)"""
    current = active.DEBUG_MANAGER
    if current is None or not current.plan_cache:
        return None
    return current.transformer_engine.compiled.get(PLANS_KEY)


def renew_quantizers(quantizers: Sequence["DebugQuantizer"], iteration: int) -> Tuple[Optional[int], bool]:
    """Make each of `quantizers`, in order, what a new construction with the same arguments would be at `iteration`:
    both usages on, its plan's answers taken again.  Returns the earliest of their next debug iterations (None:
    never) and whether any of them needs the debug path at `iteration` (`any_feature_enabled`).

    `tedebug.nn.debug_gate` does this for a GEMM call's six quantizers instead of building six new ones while the
    session's plans are still theirs (`current_plans`).  A fixed plan's directions never change, so only its question
    1 is asked; and an answer object that the quantizer before asked (the tensors of a layer that one config
    section selects share one schedule answer, `tedebug.plan.compile_answer`; no other answer object is shared) is
    not asked again: the same question at the same iteration, whose note to the statistics engine would write the
    same value again."""
    earliest: Optional[int] = None
    needed = False
    asked: object = None
    answer: Tuple[bool, Optional[int]] = (False, None)
    for q in quantizers:
        q.iteration = iteration
        q.rowwise_usage = q.columnwise_usage = True
        plan = q.plan
        if plan.fixed is not None:
            question = plan.inspect_enabled
            if question is not asked:
                answer = question.ask(iteration)
                asked = question
            q.inspect_tensor_enabled, nxt = answer
            q._next_debug_iter = nxt
        else:
            q._resolve()
            nxt = q._next_debug_iter
            asked = None  # (its direction questions may have noted other values since)
        if nxt is not None and (earliest is None or nxt < earliest):
            earliest = nxt
        if not needed:
            needed = q.inspect_tensor_enabled or q._directions_need_path  # (`any_feature_enabled`, without its call)
    return earliest, needed


#: one tensor of `inspect_group`: (its quantizer, the tensor or None, its rowwise and columnwise GEMM operands)
InspectEntry = Tuple["DebugQuantizer", Optional[torch.Tensor], "GemmOperand", "GemmOperand"]


def inspect_group(entries: Sequence[InspectEntry]) -> None:
    """``q._inspect(tensor, rowwise, columnwise)`` for each entry, in order, whose quantizer inspects its tensor this
    iteration and whose tensor is not None (a gradient autograd did not compute): the tensors a GEMM call of
    inspect-only quantizers logs together (`tedebug.nn.base._inspected_linear`, forward and backward).

    The statistics of the group's tensors are one launch where the backend has a group launch: the group of
    `tedebug.stats.launch_group` is open around the calls (closed, and what it deferred launched, also when a call
    raises).

    The same calls with fewer steps per tensor: the iteration is read once, and an inspect-only quantizer
    (`DebugQuantizer.inspect_only`: no parent, nothing to inspect after a quantization) calls its plan's bound
    ``inspect_tensor`` (`tedebug.plan.InspectCall.target`) itself, binding it as a call of the `InspectCall` would.
    Inside a host-bound GPU step each Python call level costs a logged tensor about a microsecond
    (docs/performance.md, section 29)."""
    current = active.DEBUG_MANAGER
    iteration = current.iteration if current is not None else active.get_iteration()  # (raises: no session)
    opened = launch_group.open_group()
    try:
        for q, tensor, rowwise, columnwise in entries:
            if tensor is None or not q.inspect_tensor_enabled:
                continue
            if not q.inspect_only:
                q._inspect(tensor, rowwise, columnwise)
                continue
            call = q.plan.inspect
            target = call.target
            if target is None or INSPECT in call.api.__dict__:  # not bound yet, or the namespace's call replaced
                target = call.bind()
            target(iteration, tensor, q.tp_group, q.tp_size, rowwise, columnwise, None)
    finally:
        launch_group.close_group(opened)


class DebugQuantizer(Quantizer):
    """Quantizer used in place of a layer's normal quantizer for one tensor during a debug iteration.

    `parent_quantizer` is the layer's normal quantizer for that tensor (None when the GEMM runs in high precision).
    Both usage flags start True.  The plans and enabled flags are fixed at construction for `self.iteration`.
    """

    is_debug = True

    def __init__(
        self, layer_name: str, tensor_name: str, parent_quantizer: Optional[Quantizer], tp_group, tp_size: int = 1
    ) -> None:
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
                    f"DebugQuantizer for {layer_name!r}/{tensor_name}: the parent is already a DebugQuantizer"
                )
        self.layer_name = layer_name
        self.tensor_name = tensor_name
        self.parent_quantizer = parent_quantizer
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.rowwise_gemm_name, self.columnwise_gemm_name = gemms
        if parent_quantizer is not None:
            # Full tensor objects in the usual layout: debug features may run any op on them.
            parent_quantizer.internal = False
            parent_quantizer.optimize_for_gemm = False
        self.plan, answers = tensor_plan(layer_name, tensor_name, parent_quantizer is not None)
        self.iteration = active.get_iteration()
        if answers is None:
            self._resolve()
        else:  # the plan was compiled at this iteration: take its answers (each question asked once)
            (self.inspect_tensor_enabled, nxt), directions = answers
            self._take(directions, nxt)

    def renew(self, iteration: Optional[int] = None) -> Optional[int]:
        """Make this quantizer what a new construction with the same arguments would be at `iteration` (default: the
        current one): both usages on, the plan's answers taken again; returns `get_next_debug_iter()`
        (`renew_quantizers` of this one quantizer)."""
        renew_quantizers((self,), active.get_iteration() if iteration is None else iteration)
        return self._next_debug_iter

    def _resolve(self) -> None:
        """Take the plan's answers at `self.iteration`."""
        plan = self.plan
        self.inspect_tensor_enabled, nxt = plan.inspect_enabled.ask(self.iteration)
        fixed = plan.fixed
        if fixed is not None:
            self._set_directions(*fixed)
            self._next_debug_iter = nxt
            return
        directions = plan.directions(self.iteration)
        plan.log_directions(directions[0], directions[1])
        self._take(directions, nxt)

    def _take(self, directions: tuple, nxt: Optional[int]) -> None:
        row, col, post_row, post_col, later = directions
        self._set_directions(row, col, post_row, post_col)
        if nxt is None or (later is not None and later < nxt):
            nxt = later
        self._next_debug_iter = nxt

    def _set_directions(self, row: Plan, col: Optional[Plan], post_row: bool, post_col: bool) -> None:
        """The plans and postquantize flags of both directions, and whether they alone need the debug path."""
        self.rowwise_tensor_plan = row
        self.columnwise_tensor_plan = col
        self.rowwise_postquantize_enabled = post_row
        self.columnwise_postquantize_enabled = post_col
        #: both GEMM operands are the high-precision tensor (what `_gemm_operands` gives without a dtype)
        self._high_precision_only = row == HIGH_PRECISION and col == HIGH_PRECISION
        #: the GEMMs take the tensor as it is (no parent quantizer, no modification) and nothing is inspected after
        #: a quantization: all this quantizer may do is inspect the tensor (`inspect_only_gemm` in `tedebug.nn`)
        self.inspect_only = (
            self.parent_quantizer is None
            and not (post_row or post_col)
            and row == HIGH_PRECISION
            and (col is None or col == HIGH_PRECISION)
        )
        #: `set_usage` passes the usages on to the parent (it quantizes a direction of this tensor)
        self._syncs_parent = col is not None and self.parent_quantizer is not None and STANDARD_QUANTIZE in (row, col)
        if col is None:  # a GEMM output: only a modification needs the path (besides the inspection)
            self._directions_need_path = row == API_CALL_MODIFY
        else:
            # a modification or a postquantize inspection; or quantization disabled for a GEMM of a tensor that has a
            # normal quantizer (the normal path would quantize)
            self._directions_need_path = (
                post_row
                or post_col
                or API_CALL_MODIFY in (row, col)
                or (self.parent_quantizer is not None and (row != STANDARD_QUANTIZE or col != STANDARD_QUANTIZE))
            )
        #: a GEMM input with a parent whose directions need nothing but the inspection: both GEMM operands are the
        #: parent's quantization as it is, which `layer_operand` hands the GEMMs itself (what the wrapper unwraps to)
        self._parent_operands_only = (
            self.parent_quantizer is not None and col is not None and not self._directions_need_path
        )

    @property
    def is_output_type(self) -> bool:
        """True for GEMM outputs (output, wgrad, dgrad): only `process_gemm_output` applies."""
        return self.columnwise_gemm_name is None

    # ------------------------------------------------------------------ gate queries
    def any_feature_enabled(self) -> bool:
        """True when this tensor needs the debug path in this iteration."""
        return self.inspect_tensor_enabled or self._directions_need_path

    def get_next_debug_iter(self) -> Optional[int]:
        """Earliest iteration at which any hook of this tensor may become active (None: never again)."""
        return self._next_debug_iter

    @property
    def recipe_name(self) -> str:  # type: ignore[override]
        return self.parent_quantizer.recipe_name if self.parent_quantizer is not None else ""

    # ------------------------------------------------------------------ usage
    def _parent_usage(self) -> Tuple[bool, bool]:
        """(rowwise, columnwise) the parent must produce: own usage restricted to the Quantize directions."""
        return (
            self.rowwise_usage and self.rowwise_tensor_plan == STANDARD_QUANTIZE,
            self.columnwise_usage and self.columnwise_tensor_plan == STANDARD_QUANTIZE,
        )

    def _uses_parent(self) -> bool:
        return self.parent_quantizer is not None and STANDARD_QUANTIZE in (
            self.rowwise_tensor_plan,
            self.columnwise_tensor_plan,
        )

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Set own usage flags and synchronise the parent's flags to the Quantize directions (runs for every operand
        of a logged GEMM: what the plans decide is read from one flag set with them)."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)
        if self._syncs_parent:
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

    def quantize(
        self, tensor: torch.Tensor, *, out: Optional["DebugQuantizedTensor"] = None, dtype: Optional[torch.dtype] = None
    ) -> "DebugQuantizedTensor":
        """Build the GEMM operands of `tensor` following the plans, run the inspect hooks, wrap them.

        With `out` (a DebugQuantizedTensor made by this quantizer) the operands are refreshed in place.
        """
        self._check_not_output("quantize")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"DebugQuantizer.quantize ({self.layer_name!r}/{self.tensor_name}) expects a "
                f"torch.Tensor, got {type(tensor).__name__}"
            )
        if out is not None:
            return self.update_quantized(tensor, out)
        if self._high_precision_only and dtype is None:  # both operands are the tensor itself
            rowwise = columnwise = tensor
        else:
            rowwise, columnwise = self._gemm_operands(tensor, dtype)
        self._inspect(tensor, rowwise, columnwise)
        return DebugQuantizedTensor(rowwise, columnwise, self, self.layer_name, self.tensor_name)

    def __call__(self, tensor: torch.Tensor) -> "DebugQuantizedTensor":
        return self.quantize(tensor)

    def layer_operand(self, tensor: torch.Tensor) -> Union[torch.Tensor, "DebugQuantizedTensor"]:
        """What a `tedebug.nn` layer hands its GEMMs for `tensor`: `quantize(tensor)`, or - when both directions
        use one object as it is - that object after the same inspection: the high-precision tensor itself, or the
        parent's quantization of it when both directions take the standard quantization and nothing is inspected
        after it (a GEMM unwraps a `DebugQuantizedTensor` whose directions hold one object into that object anyway,
        so the numbers are the same, without the wrapper and its save / restore around the backward)."""
        if self.columnwise_gemm_name is not None and isinstance(tensor, torch.Tensor):
            if self._high_precision_only:
                self._inspect(tensor, tensor, tensor)
                return tensor
            if self._parent_operands_only:
                quantized = self._parent_quantize(tensor)
                self._inspect(tensor, quantized, quantized)
                return quantized
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
        parent = self.parent_quantizer
        parent.set_usage(rowwise=True, columnwise=col)
        if not self.inspect_tensor_enabled:
            return parent.quantize(tensor)
        # the statistics features this call inspects with may read the quantization-error statistics: the
        # quantizer computes them (a layer's own quantizers skip the costly ones outside the debug path,
        # `Quantizer.error_stats`; a feed without them computes them from the tensor, the same values); and when
        # one of them feeds the tensor's basic statistics, the amax pass computes those on the way (one read)
        error_stats = parent.error_stats
        parent.error_stats = True
        parent.high_precision_stats = self.plan.inspect.feeds_basic_statistics()
        try:
            return parent.quantize(tensor)
        finally:
            parent.error_stats = error_stats
            parent.high_precision_stats = False

    def _modify(self, tensor: torch.Tensor, gemm: str, dtype: Optional[torch.dtype], out=None):
        kwargs = dict(
            gemm=gemm,
            tensor_name=self.tensor_name,
            tensor=tensor,
            default_quantizer=self.parent_quantizer,
            iteration=self.iteration,
        )
        if dtype is not None:
            kwargs["dtype"] = dtype
        if out is not None:
            kwargs["out"] = out
        result = self.plan.api.modify_tensor(self.layer_name, **kwargs)
        where = f"modify_tensor() for layer {self.layer_name!r}, tensor {self.tensor_name}, gemm {gemm}"
        if out is not None:
            if result is not None:
                raise ValueError(
                    f"{where} was given out= and must fill it in place and return None, got {type(result).__name__}"
                )
            return None
        if not isinstance(result, (torch.Tensor, QuantizedTensor)):
            raise TypeError(f"{where} returned {type(result).__name__}; expected a torch.Tensor or QuantizedTensor")
        if dtype is not None and result.dtype != dtype:
            raise ValueError(f"{where} returned dtype {result.dtype}; expected {dtype}")
        return result

    # ------------------------------------------------------------------ inspection
    def _inspect(self, tensor: Optional[torch.Tensor], rowwise: GemmOperand, columnwise: GemmOperand) -> None:
        current = active.DEBUG_MANAGER
        iteration = current.iteration if current is not None else active.get_iteration()  # (raises: no session)
        if self.inspect_tensor_enabled:
            self.plan.inspect(
                iteration, tensor, self.tp_group, self.tp_size, rowwise, columnwise, self.parent_quantizer
            )
        if not (self.rowwise_postquantize_enabled or self.columnwise_postquantize_enabled):
            return
        api = self.plan.api
        for operand, plan, enabled, is_rowwise in (
            (rowwise, self.rowwise_tensor_plan, self.rowwise_postquantize_enabled, True),
            (columnwise, self.columnwise_tensor_plan, self.columnwise_postquantize_enabled, False),
        ):
            if enabled and operand is not None and plan in (STANDARD_QUANTIZE, API_CALL_MODIFY):
                api.inspect_tensor_postquantize(
                    self.layer_name,
                    tensor=operand,
                    tensor_name=self.tensor_name,
                    iteration=iteration,
                    tp_group=self.tp_group,
                    tp_size=self.tp_size,
                    rowwise=is_rowwise,
                )

    # ------------------------------------------------------------------ GEMM outputs
    def process_gemm_output(self, tensor: torch.Tensor) -> torch.Tensor:
        """Modify (if planned) and inspect a GEMM result; returns the tensor the layer should use."""
        if not self.is_output_type:
            raise RuntimeError(
                f"DebugQuantizer.process_gemm_output: {self.layer_name!r}/{self.tensor_name} is not a "
                f"GEMM output (expected output, wgrad or dgrad)"
            )
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
    def update_quantized(
        self, src: torch.Tensor, dst: "DebugQuantizedTensor", *, noop_flag: Optional[torch.Tensor] = None
    ) -> "DebugQuantizedTensor":
        """Refresh the operands of `dst` in place from `src` (weight cache), then run the inspect hooks."""
        self._check_not_output("update_quantized")
        if noop_flag is not None:
            raise RuntimeError(
                "DebugQuantizer.update_quantized: noop_flag (CUDA graphs) is not supported in debug mode"
            )
        if not isinstance(dst, DebugQuantizedTensor):
            raise TypeError(
                f"DebugQuantizer.update_quantized expects a DebugQuantizedTensor destination, got {type(dst).__name__}"
            )
        directions = (
            (dst.rowwise_gemm_tensor, self.rowwise_tensor_plan, self.rowwise_gemm_name),
            (dst.columnwise_gemm_tensor, self.columnwise_tensor_plan, self.columnwise_gemm_name),
        )
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
    def multi_tensor_quantize(
        cls,
        tensor: torch.Tensor,
        quantizers: Sequence[Quantizer],
        m_splits: Sequence[int],
        activation_dtype: Optional[torch.dtype],
    ) -> list:
        """Grouped GEMMs: split `tensor` along dim 0 by `m_splits` and quantize chunk i with quantizer i."""
        if len(quantizers) != len(m_splits):
            raise ValueError(f"multi_tensor_quantize: {len(quantizers)} quantizers for {len(m_splits)} splits")
        if sum(m_splits) != tensor.shape[0]:
            raise ValueError(
                f"multi_tensor_quantize: m_splits sum to {sum(m_splits)}, but the tensor has {tensor.shape[0]} rows"
            )
        chunks = torch.split(tensor, list(m_splits))
        return [
            q.quantize(c, dtype=activation_dtype) if getattr(q, "is_debug", False) else q.quantize(c)
            for q, c in zip(quantizers, chunks)
        ]

    def __repr__(self) -> str:
        return (
            f"DebugQuantizer(layer={self.layer_name!r}, tensor={self.tensor_name}, "
            f"parent={self.parent_quantizer!r}, plans=({self.rowwise_tensor_plan}, {self.columnwise_tensor_plan}))"
        )


_PLAIN = object()  # marks a saved plain tensor (or None) in DebugQuantizedTensor's save layout


class DebugQuantizedTensor:
    """The GEMM operands of one tensor under debug: one object per direction (possibly one shared object).

    Each direction holds a plain tensor, a `QuantizedTensor` or None (dropped).  The GEMM picks the rowwise object
    or the columnwise one (`get_tensor(transpose)`); a quantized object then gives its matching representation.
    """

    is_debug = True

    def __init__(
        self,
        rowwise_gemm_tensor: GemmOperand,
        columnwise_gemm_tensor: GemmOperand,
        quantizer: Optional[DebugQuantizer],
        layer_name: Optional[str] = None,
        tensor_name: Optional[str] = None,
    ) -> None:
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
            raise RuntimeError(
                f"DebugQuantizedTensor ({self.layer_name}/{self.tensor_name}) holds no tensor in either direction"
            )
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
        return (
            f"DebugQuantizedTensor(layer={self.layer_name!r}, tensor={self.tensor_name}, "
            f"rowwise={describe(self.rowwise_gemm_tensor)}, "
            f"columnwise={describe(self.columnwise_gemm_tensor)}{shared})"
        )
