"""Machinery shared by the `tedebug.nn` layers.

- layer naming: ``name=`` or ``Layer_<n>`` from one global counter starting at 1 (one number per unnamed layer);
- `GemmState`: per-GEMM quantizer state (quantizers built from the active recipe, rebuilt when the recipe
  changes; delayed-scaling ``update_scale()`` before every use but the first; the debug gate);
- `linear_gemm`: the custom autograd function running one quantized linear GEMM (fprop, dgrad, wgrad), with the
  debug hooks (`process_gemm_output` on the GEMM outputs) and saving of quantized operands for backward; torch's
  own linear where nothing is quantized or modified (`_inspected_linear` when the debug path only inspects);
- `BaseLayer`: the `torch.nn.Module` base with `name`, `default_recipe` and the recipe resolution.

Activation checkpointing (`torch.utils.checkpoint`, reentrant or not, and what Hugging Face's
``gradient_checkpointing_enable`` uses): a forward that runs while autograd executes a backward pass with grad mode
on is a recompute (`in_recompute`).  A GEMM then *replays* its layer's most recent forward call (`GemmState.last`):
the same recipe, quantizers and debug quantizers - not the autocast state of the backward, which is usually off -
so the recomputed operands equal the original ones; the forward roles are quantized without `before_use`
(delayed scaling is not advanced twice) and without inspection (statistics are counted once).  The backward roles
(grad_output and the dgrad / wgrad outputs) run as usual, also in a reentrant checkpoint's recomputed graph.
"""

from __future__ import annotations

import copy
import functools
import itertools
import types
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from tedebug import active
from tedebug.autocast import INNERMOST, default_recipe
from tedebug.debug_quantization import inspect_group
from tedebug.host_numpy import compiling
from tedebug.nn import compiled_linear
from tedebug.nn.gemm import gemm
from tedebug.nn.state import all_reduce_max, check_history, register_state_hooks, several_ranks
from tedebug.quantization.tensor import UnsupportedShapeError
from tedebug.stats import launch_group
from tedebug.untraced import untraced
from tedebug.usage_checks import note_functorch_call

__all__ = [
    "ROLES",
    "QUANTIZED_ROLES",
    "next_layer_name",
    "is_debug_quantizer",
    "GemmState",
    "linear_gemm",
    "BaseLayer",
    "activation_dtype",
    "resolve_dtype",
]

ROLES = ("input", "weight", "output", "grad_output", "grad_input", "grad_weight")
#: the roles whose quantizers a layer builds; GEMM outputs stay in high precision (TE: no fp8_output / fp8_grad)
QUANTIZED_ROLES = ("input", "weight", "grad_output")

_LAYER_NUMBERS = itertools.count(1)
#: the quantizers of a high-precision GEMM (no recipe): every role None, shared by every call
_NO_QUANTIZERS = types.MappingProxyType({role: None for role in ROLES})
#: `GemmState.plan` of a high-precision GEMM
_HIGH_PRECISION = (_NO_QUANTIZERS, _NO_QUANTIZERS, False)
#: whether a torch.func transform (grad, vmap, ...) is running (30 ns; asked by a debug call only)
_functorch_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def next_layer_name() -> str:
    """``Layer_<n>``; n counts unnamed layers from 1 for the whole process (never reset)."""
    return f"Layer_{next(_LAYER_NUMBERS)}"


def is_debug_quantizer(q) -> bool:
    return q is not None and (getattr(q, "is_debug", False) is True or type(q).__name__ == "DebugQuantizer")


def _delayed_leaves(q) -> Iterator[object]:
    """The quantizers with delayed scaling state inside `q` (itself, or the children of a hybrid)."""
    if q is None:
        return
    if callable(getattr(q, "update_scale", None)):
        yield q
        return
    for child in (getattr(q, "rowwise_quantizer", None), getattr(q, "columnwise_quantizer", None)):
        yield from _delayed_leaves(child)


def _same_recipe(a, b) -> bool:
    return a is b or (a is not None and b is not None and type(a) is type(b) and a == b)


def in_recompute() -> bool:
    """True while this thread runs a backward pass with grad mode on: a forward seen now is an activation
    recompute (torch.utils.checkpoint re-running a checkpointed region)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class GemmState:
    """Quantizers and debug state of one GEMM of a layer (a LayerNormMLP has two, a GroupedLinear one per expert)."""

    def __init__(self) -> None:
        self.recipe = None
        self.quantizers: Dict[str, Optional[object]] = {role: None for role in ROLES}
        self._used: set = set()
        #: role -> (quantizer, its delayed-scaling leaves): `before_use` walks a quantizer's tree once
        self._leaves: Dict[str, Tuple[object, Tuple[object, ...]]] = {}
        self._debug_state = None
        #: (normal quantizers, quantizers used, delayed) of the most recent forward call that was not a recompute
        self.last: Optional[Tuple[Dict[str, Optional[object]], Dict[str, Optional[object]], bool]] = None
        #: (quantizers, quantizers, whether any holds delayed-scaling state) for `self.recipe`: what a call without
        #: a debug path uses, built once per recipe (`plan`)
        self._plan: Tuple[Dict[str, Optional[object]], Dict[str, Optional[object]], bool] = _HIGH_PRECISION
        #: loaded delayed-scaling state waiting for its quantizer ("<role>.<leaf>" -> entry; `tedebug.nn.state`)
        self._pending: Dict[str, dict] = {}
        #: tensor-parallel group and size handed to the debug quantizers (`tedebug.nn.parallel.configure`)
        self.tp_group = None
        self.tp_size = 1
        #: optional callable adjusting a freshly built {role: quantizer} dict in place (TP amax reduction)
        self.customize_quantizers = None

    # ---------------------------------------------------------------- quantizers
    def _build(self, recipe) -> None:
        quantizers: Dict[str, Optional[object]] = {role: None for role in ROLES}
        if recipe is not None:
            # made outside torch.inference_mode, which the first call may run in (a validation step before
            # training): a recipe's state made in it (delayed scaling's amax history and scale) could not be
            # updated in place by the training steps after it
            with torch.inference_mode(False):
                for role in QUANTIZED_ROLES:
                    quantizers[role] = recipe.make_quantizer(role)
            if self.customize_quantizers is not None:
                self.customize_quantizers(quantizers)
            for q in quantizers.values():
                if q is not None:  # nothing reads them outside the debug path (DebugQuantizer turns them on)
                    q.error_stats = False
        self.recipe = recipe
        self.quantizers = quantizers
        self._used = set()
        self._leaves = {}
        delayed = any(True for role in QUANTIZED_ROLES for _ in _delayed_leaves(quantizers[role]))
        self._plan = (quantizers, quantizers, delayed)
        pending, self._pending = self._pending, {}
        for key, entry in pending.items():
            role, _, leaf = key.rpartition(".")
            self.load_delayed_state(role, int(leaf), entry, where=f"delayed-scaling state {key!r}")

    def normal_quantizers(self, recipe) -> Dict[str, Optional[object]]:
        """The layer's own quantizers for `recipe` (all None for None: one shared read-only mapping); reused while
        the recipe stays equal."""
        return self.plan(recipe)[0]

    def plan(self, recipe) -> Tuple[Dict[str, Optional[object]], Dict[str, Optional[object]], bool]:
        """(normal quantizers, the same, whether they hold delayed-scaling state) for `recipe`: a call without a
        debug path.  One shared tuple per recipe (rebuilt when the recipe changes), so a call decides nothing."""
        if recipe is None:
            return _HIGH_PRECISION
        if recipe is not self.recipe and not _same_recipe(recipe, self.recipe):
            self._build(recipe)
        return self._plan

    def before_use(self, role: str, quantizers: Dict[str, Optional[object]]) -> None:
        """Delayed scaling: roll the amax history and refresh the scale before every use but the very first."""
        q = quantizers.get(role)
        if q is None:
            return
        if role not in self._used:
            self._used.add(role)
            return
        cached = self._leaves.get(role)
        if cached is None or cached[0] is not q:  # (current scaling, the common case, has no leaves)
            cached = self._leaves[role] = (q, tuple(_delayed_leaves(q)))
        for leaf in cached[1]:
            leaf.update_scale()

    def skip_use(self, role: str, recipe) -> None:
        """Bookkeeping of a use that does not happen on this rank (an expert that got no tokens): the delayed
        scaling state advances as if it did, so every data-parallel rank keeps the same history and scales."""
        self.before_use(role, self.normal_quantizers(recipe))

    def amax_rows(self, recipe) -> List[torch.Tensor]:
        """History row 0 (the amax being accumulated) of every delayed quantizer of `recipe` (built if needed)."""
        quantizers = self.normal_quantizers(recipe)
        return [
            leaf.amax_history.view(-1)[:1] for role in QUANTIZED_ROLES for leaf in _delayed_leaves(quantizers.get(role))
        ]

    # ---------------------------------------------------------------- state_dict (tedebug.nn.state)
    def delayed_state(self) -> Dict[str, dict]:
        """``"<role>.<leaf>" -> {"scale", "amax_history", "used"}`` of every delayed-scaling quantizer (copies),
        plus loaded state still waiting for its quantizer."""
        out: Dict[str, dict] = {}
        for role in QUANTIZED_ROLES:
            for i, leaf in enumerate(_delayed_leaves(self.quantizers.get(role))):
                out[f"{role}.{i}"] = {
                    "scale": leaf.scale.detach().clone(),
                    "amax_history": leaf.amax_history.detach().clone(),
                    "used": role in self._used,
                }
        for key, entry in self._pending.items():
            out.setdefault(key, entry)
        return out

    def load_delayed_state(self, role: str, leaf_index: int, entry: dict, *, where: str) -> None:
        """Copy a saved delayed-scaling state into the quantizer it belongs to, or keep it until that is built."""
        leaves = list(_delayed_leaves(self.quantizers.get(role)))
        if leaf_index >= len(leaves):
            self._pending[f"{role}.{leaf_index}"] = entry
            return
        leaf = leaves[leaf_index]
        history = torch.as_tensor(entry["amax_history"])
        if not check_history(where, leaf.amax_history, history):
            return
        leaf.amax_history.copy_(history.reshape(leaf.amax_history.shape))
        leaf.scale.copy_(torch.as_tensor(entry["scale"]).reshape(leaf.scale.shape))
        if entry.get("used", True):
            self._used.add(role)
        else:
            self._used.discard(role)

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> dict:
        """What a copy keeps (`copy.deepcopy(model)`, as for an EMA model, and ``torch.save(model)``): the recipe's
        quantizers with their delayed-scaling state, as the layer's ``state_dict`` does.  Not the debug session's
        state (`_debug_state`, and the debug quantizers `last` may hold): it is the session's, holds its sinks and
        locks, and the copy makes its own at its first call.  The shared high-precision plan is this module's
        (`__setstate__` puts it back)."""
        state = self.__dict__.copy()
        state["_debug_state"] = None
        state["last"] = None
        if state["_plan"] is _HIGH_PRECISION:
            state["_plan"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._plan is None:
            self._plan = _HIGH_PRECISION

    def __deepcopy__(self, memo: dict) -> "GemmState":
        # the tensor-parallel group is shared with the copy, not copied: a communicator (torch cannot copy one)
        if self.tp_group is not None:
            memo.setdefault(id(self.tp_group), self.tp_group)
        twin = GemmState.__new__(GemmState)
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return twin

    # ---------------------------------------------------------------- debug
    def _debug(self):
        if self._debug_state is None:
            from tedebug.nn.debug_gate import LayerDebugState

            self._debug_state = LayerDebugState()
        return self._debug_state

    def debug_plan(
        self, layer_name: str, recipe
    ) -> Tuple[Dict[str, Optional[object]], Dict[str, Optional[object]], bool]:
        """`plan` with the quantizers to use this call in the middle: the debug ones when the debug gate says so."""
        plan = self.plan(recipe)
        gate = self._debug_state
        if gate is None:
            gate = self._debug()
        debug = gate.debug_quantizers(layer_name, plan[0], self.tp_group, self.tp_size)  # (every GEMM call asks)
        if debug is None:
            return plan
        if _functorch_active():  # torch.func.grad / vmap: tensors without data to read (`note_functorch_call`)
            note_functorch_call(active.DEBUG_MANAGER, layer_name)
            return plan
        return (plan[0], debug, plan[2])


# ------------------------------------------------------------------------------------------------ autograd
def _saved_parts(obj) -> Tuple[Tuple[Optional[torch.Tensor], ...], Optional[object]]:
    """(tensors for `save_for_backward`, the object that takes them back or None for a plain tensor / None)."""
    if obj is None or isinstance(obj, torch.Tensor):
        return (obj,), None
    saved, holder = obj.prepare_for_saving()
    return tuple(saved), holder


def _restored(holder, chunk: Tuple[Optional[torch.Tensor], ...]):
    """Inverse of `_saved_parts`: the plain tensor, or `holder` with its tensors put back."""
    if holder is None:
        return chunk[0]
    leftover = holder.restore_from_saved(list(chunk))
    if leftover:
        raise RuntimeError(f"{type(holder).__name__}.restore_from_saved left {len(leftover)} tensors unused")
    return holder


def _process_output(q, tensor: torch.Tensor, replay: bool = False) -> torch.Tensor:
    if not is_debug_quantizer(q):
        return tensor
    return q.process_gemm_output_without_inspection(tensor) if replay else q.process_gemm_output(tensor)


class _Call:
    """Non-tensor arguments of one linear GEMM call, decided before `_LinearFunction` runs (read there without
    further look-ups)."""

    __slots__ = ("state", "normal", "qs", "dtype", "grad_enabled", "replay", "debug", "delayed")

    def __init__(
        self,
        state: GemmState,
        normal,
        qs,
        dtype: torch.dtype,
        grad_enabled: bool,
        replay: bool,
        delayed: bool,
    ) -> None:
        self.state, self.normal, self.qs, self.dtype = state, normal, qs, dtype
        self.grad_enabled = grad_enabled  # autograd records this call (False under torch.no_grad)
        self.replay = replay  # an activation recompute of an earlier call (see the module docstring)
        self.debug = qs is not normal  # the debug gate handed debug quantizers for this call
        self.delayed = delayed  # the normal quantizers hold delayed-scaling state (`GemmState.before_use` needed)


class _LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b through `gemm` (fprop TN, dgrad NN, wgrad NT) with per-role quantizers.

    `linear_gemm` casts x, W and b to the call's dtype first, so the gradients come out in that dtype.  The
    quantized operands are saved with `save_for_backward` (their raw tensors; saved-tensor hooks see them)."""

    @classmethod
    def apply(cls, x, weight, bias, call):  # type: ignore[override]
        """`torch.autograd.Function.apply` without its per-call Python wrapper: this function has no
        ``setup_context`` and no default arguments, so the wrapper would only unwrap dead functorch wrappers
        (done here with the same call) before the C++ apply; under a functorch transform the public path runs
        (and explains that the function does not support it)."""
        if _C_APPLY is None or torch._C._are_functorch_transforms_active():
            return super().apply(x, weight, bias, call)
        return _C_APPLY(
            _unwrap_if_dead(x), _unwrap_if_dead(weight), bias if bias is None else _unwrap_if_dead(bias), call
        )

    @staticmethod
    def forward(ctx, x, weight, bias, call: _Call):
        if not call.debug:
            return _LinearFunction._forward(ctx, x, weight, bias, call)
        opened = launch_group.open_group()  # the statistics of x, W and y: one launch (tedebug.stats.launch_group)
        try:
            return _LinearFunction._forward(ctx, x, weight, bias, call)
        finally:
            launch_group.close_group(opened)

    @staticmethod
    def _forward(ctx, x, weight, bias, call: _Call):
        if call.grad_enabled:
            need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        else:
            need_dgrad = need_wgrad = False
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        xq = _quantize(call, "input", x2, True, need_wgrad)
        wq = _quantize(call, "weight", weight, True, need_dgrad)
        y = gemm(
            wq, xq, layout="TN", out_dtype=call.dtype, gemm_name="fprop", bias=bias, roles=("weight", "activation")
        )
        if call.debug:
            y = _process_output(call.qs["output"], y, replay=call.replay)
        x_saved, x_holder = _saved_parts(xq if need_wgrad else None)
        w_saved, w_holder = _saved_parts(wq if need_dgrad else None)
        ctx.save_for_backward(*x_saved, *w_saved)
        ctx.meta = (call, x.shape, x_holder, len(x_saved), w_holder)
        return y if x2 is x else y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.meta[0].debug:
            return _LinearFunction._backward(ctx, grad_out)
        if compiling():  # compiled autograd traces a debug call's backward: it runs untraced (as `linear_gemm`)
            return untraced(_LinearFunction._debug_backward)(ctx, grad_out)
        return _LinearFunction._debug_backward(ctx, grad_out)

    @staticmethod
    def _debug_backward(ctx, grad_out):
        opened = launch_group.open_group()  # the statistics of dy, dx and dW: one launch
        try:
            return _LinearFunction._backward(ctx, grad_out)
        finally:
            launch_group.close_group(opened)

    @staticmethod
    def _backward(ctx, grad_out):
        needs = ctx.needs_input_grad
        need_dgrad, need_wgrad, need_bgrad = needs[0], needs[1], needs[2]
        call, x_shape, x_holder, x_count, w_holder = ctx.meta
        saved = ctx.saved_tensors
        xq = _restored(x_holder, saved[:x_count])
        wq = _restored(w_holder, saved[x_count:])
        dy = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
        if not dy.is_contiguous():
            dy = dy.contiguous()
        dx = dw = db = None
        if need_bgrad:
            db = dy.sum(dim=0)
            if db.dtype != call.dtype:
                db = db.to(call.dtype)
        if need_dgrad or need_wgrad:
            dyq = _quantize(call, "grad_output", dy, need_dgrad, need_wgrad)
            if need_dgrad:
                dx = gemm(wq, dyq, layout="NN", out_dtype=call.dtype, gemm_name="dgrad", roles=("weight", "gradient"))
                if call.debug:
                    dx = _process_output(call.qs["grad_input"], dx)
                if len(x_shape) != 2:
                    dx = dx.reshape(x_shape)
            if need_wgrad:
                dw = gemm(
                    xq, dyq, layout="NT", out_dtype=call.dtype, gemm_name="wgrad", roles=("activation", "gradient")
                )
                if call.debug:
                    dw = _process_output(call.qs["grad_weight"], dw)
        return dx, dw, db, None


#: the C++ apply of `_LinearFunction` (what `torch.autograd.Function.apply` ends in) and torch's unwrapping of
#: tensors left over from a finished functorch transform (what its wrapper does to every tensor argument)
_C_APPLY: Optional[Callable] = super(torch.autograd.Function, _LinearFunction).apply
try:
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    torch._C._are_functorch_transforms_active  # noqa: B018 - present with the line above in the torch we test
except AttributeError:  # a torch without these private calls: its public apply, wrapper and all
    _C_APPLY = None


def _quantize(call: _Call, role: str, tensor: torch.Tensor, rowwise: bool, columnwise: bool):
    """Quantize `tensor` with the call's quantizer for `role` (plain tensor when there is none)."""
    q = call.qs[role]
    if q is None:
        return tensor
    replay = call.replay and role != "grad_output"  # the forward roles of a recompute: see the module docstring
    if call.delayed and not replay:
        call.state.before_use(role, call.normal)
    if not (rowwise or columnwise):
        rowwise = True  # a quantizer must produce something; only reached for unused operands
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    if call.debug and is_debug_quantizer(q):
        if replay:
            return q.quantize_without_inspection(tensor)
        layer_operand = getattr(q, "layer_operand", None)  # (tedebug's DebugQuantizer; a stand-in may lack it)
        if layer_operand is not None:
            return layer_operand(tensor)
    return q.quantize(tensor)


def reduce_amaxes(states: Sequence[GemmState], recipe) -> None:
    """`DelayedScaling(reduce_amax=True)`: one MAX all-reduce of the amax rows of every delayed quantizer of
    `states` over the default process group (several ranks only; never in a recompute).  Called once per forward
    of a layer, before its GEMMs, with all its GEMM states - on every rank, whatever rows reach which GEMM."""
    if not getattr(recipe, "reduce_amax", False) or not several_ranks() or in_recompute():
        return
    rows = [row for state in states for row in state.amax_rows(recipe)]
    if rows:
        all_reduce_max(rows)


def activation_dtype(x: torch.Tensor, params_dtype: torch.dtype) -> torch.dtype:
    """The dtype the GEMMs compute in: torch.autocast's dtype when it is on for x's device, else the params'."""
    if not torch._C._is_any_autocast_enabled():  # (the common answer, without parsing x's device type)
        return params_dtype
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return params_dtype


def linear_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: GemmState,
    layer_name: str,
    recipe,
    *,
    reduce_amax: bool = True,
) -> torch.Tensor:
    """One linear GEMM ``x·Wᵀ + b`` with the quantizers of `state` for `recipe` (None: high precision).

    `reduce_amax`: reduce the delayed-scaling amaxes of `state` first (`reduce_amaxes`); grouped layers, whose
    GEMMs may not all run on every rank, pass False and reduce all their states once per forward instead."""
    dtype = activation_dtype(x, weight.dtype) if torch._C._is_any_autocast_enabled() else weight.dtype
    if x.dtype != dtype:  # (compared first: a `.to` call costs host time even when it returns its input)
        x = x.to(dtype)
    if weight.dtype != dtype:
        weight = weight.to(dtype)
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if x.numel() == 0 or weight.numel() == 0:  # an empty GEMM (e.g. in_features 0): nothing to quantize or inspect
        return torch.nn.functional.linear(x, weight, bias)
    grad_enabled = torch.is_grad_enabled()
    tracing = compiling()  # (asked once: two questions below)
    last = state.last
    if last is not None and grad_enabled and not tracing and torch._C._current_graph_task_id() != -1:
        # `in_recompute()`, asked outside tracing only: torch.compile cannot trace the graph task's id (a graph break
        # per GEMM call, and a compiled frame per weight shape up to the recompile limit) and traces a
        # checkpoint's recompute as part of the graph
        normal, qs, delayed = last
        if qs is normal:
            if normal is _NO_QUANTIZERS:
                # the original call ran torch's own linear (high precision, no debug path: below), and so does its
                # recompute: a non-reentrant checkpoint checks that the recompute saves the tensors it saved
                return torch.nn.functional.linear(x, weight, bias)
        elif _only_inspects(qs) and _FAST_DEVICES.get(x.device.type, False):
            y = _inspected_linear(x, weight, bias, qs, True)  # as the original call: no forward inspection
            if y is not None:
                return y
        return _LinearFunction.apply(x, weight, bias, _Call(state, normal, qs, dtype, True, True, delayed))
    if tracing and active.DEBUG_MANAGER is not None:
        # torch.compile traces a GEMM call of a debug session: it runs untraced (a graph break per call), where the
        # tracer would follow the gate, the plans, the features and the statistics engine, and compile them again
        # for each layer and iteration
        return untraced(linear_gemm)(x, weight, bias, state, layer_name, recipe, reduce_amax=reduce_amax)
    if recipe is not None and reduce_amax and getattr(recipe, "reduce_amax", False):
        reduce_amaxes((state,), recipe)
    if active.DEBUG_MANAGER is None:  # no debug session: the layer's own quantizers (the gate would answer None)
        last = state.last = _HIGH_PRECISION if recipe is None else state.plan(recipe)
    else:
        last = state.last = state.debug_plan(layer_name, recipe)
    if last[1] is last[0]:
        if recipe is None:
            # high precision and no debug path: torch's own linear, the same numbers (forward and backward) as
            # `_LinearFunction` with no quantizer, without its Python autograd function
            return torch.nn.functional.linear(x, weight, bias)
    elif _only_inspects(last[1]) and _FAST_DEVICES.get(x.device.type, False):
        y = _inspected_linear(x, weight, bias, last[1], False)
        if y is not None:
            return y
    try:
        return _LinearFunction.apply(
            x, weight, bias, _Call(state, last[0], last[1], dtype, grad_enabled, False, last[2])
        )
    except UnsupportedShapeError as err:
        raise _named_shape_error(err, layer_name, recipe, x, weight) from err


def _named_shape_error(
    err: UnsupportedShapeError, layer_name: str, recipe, x: torch.Tensor, weight: torch.Tensor
) -> UnsupportedShapeError:
    """`err` (a format's shape check, which names only the quantizer) said again with the layer, its operands'
    shapes and what to do: a model-wide recipe meets such layers where the user did not write them (a LoRA
    adapter of rank 8 under MXFP8, a small projection)."""
    what = f"the recipe {type(recipe).__name__}" if recipe is not None else "the debug session's quantization"
    return UnsupportedShapeError(
        f"layer {layer_name!r} (input {tuple(x.shape)}, weight {tuple(weight.shape)}): {what} cannot quantize "
        f"this GEMM's operands: {err}.  Keep this layer in high precision: leave it out of convert_model "
        f"(filter_fn=...), or call it outside tedebug.autocast"
    )


def _only_inspects(qs: Dict[str, Optional[object]]) -> bool:
    """Every debug quantizer of a GEMM call only inspects its tensor (`DebugQuantizer.inspect_only`: no
    quantization, no modification, no postquantize inspection), so torch's own linear computes what
    `_LinearFunction` would (`_inspected_linear`)."""
    for q in qs.values():
        if not getattr(q, "inspect_only", False):
            return False
    return True


#: device type -> whether a 2-D `F.linear` there records the autograd nodes `_inspected_linear` reads (learned at
#: the first call; a device whose linear records something else takes `_LinearFunction`)
_FAST_DEVICES: Dict[str, bool] = {"cpu": True, "cuda": True}
#: the node a 2-D `F.linear` records -> positions of (dx, the gradient of Wᵀ) in its grad_inputs (the compiled
#: linear has the same table: `gradient_positions` in kernels/inspected_linear.cpp; change both together)
_LINEAR_NODES: Dict[str, Tuple[int, int]] = {"AddmmBackward0": (1, 2), "MmBackward0": (0, 1)}
_NODE_POSITIONS: Dict[type, Optional[Tuple[int, int]]] = {}
_UNKNOWN = (-1, -1)  # (a node type not seen yet)


def _inspected_linear(x, weight, bias, qs, replay: bool):
    """A GEMM call whose debug quantizers only inspect (`_only_inspects`): torch's own linear, the same numbers as
    `_LinearFunction` with no quantizer (forward and backward: fprop ``F.linear``, dgrad ``dy·W``, wgrad
    ``dyᵀ·x``, the same ops on the same operands), without the Python autograd function, its three `gemm` calls
    and its operand bookkeeping.  The forward tensors are inspected here, in `_LinearFunction`'s order (x, W, y:
    the order the statistics are logged in); the backward ones (dy, dx, dW) by a hook on the node the linear
    recorded, which autograd calls after the node ran (`_inspect_backward`).  A recompute (`replay`) runs the same
    linear (so a non-reentrant checkpoint sees the same saved tensors) without the forward inspection.  None
    (nothing run) for a call this cannot take: a non-contiguous x or W, or a device whose linear records another
    node.

    The reshapes, the linear and the node's hook take one of two paths with the same answer: the compiled linear
    (`tedebug.nn.compiled_linear`, torch's C++ API) where it is built, else (or where it hands the call back)
    `_python_linear`."""
    if (
        qs["grad_output"].inspect_tensor_enabled
        or qs["grad_input"].inspect_tensor_enabled
        or qs["grad_weight"].inspect_tensor_enabled
    ):
        backward = _inspect_backward
    else:
        backward = None
    compiled = compiled_linear.linear_function()
    done = compiled(x, weight, bias, backward, qs) if compiled is not None else None
    if done is None:  # (no compiled linear, or a call it hands back)
        done = _python_linear(x, weight, bias, backward, qs)
        if done is None:
            return None
    x2, y2, y = done
    if not replay:  # x, W and y in `_LinearFunction`'s order, their statistics one launch (`inspect_group`)
        inspect_group(
            ((qs["input"], x2, x2, x2), (qs["weight"], weight, weight, weight), (qs["output"], y2, None, None))
        )
    return y


def _python_linear(x, weight, bias, backward, qs):
    """The compiled linear's call in Python (kernels/inspected_linear.cpp says what it answers): (x as 2-D, y as
    2-D, y), with `compiled_linear.node_hook` (bound to `backward` and `qs`) on the linear's node when `backward`
    is not None; None for a non-contiguous x or W, or a node of another kind (this device's calls take
    `_LinearFunction` from then on)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if not (weight.is_contiguous() and x2.is_contiguous()):
        # torch's backward of a linear computes dW (dx) of a column-major W (x) as another GEMM than dyᵀ·x (dy·W),
        # whose bits may differ: such calls (Conv1D's weight, a transposed input) keep `_LinearFunction`
        return None
    y2 = torch.nn.functional.linear(x2, weight, bias)
    node = y2.grad_fn
    if node is not None:
        positions = _NODE_POSITIONS.get(type(node), _UNKNOWN)
        if positions is _UNKNOWN:
            positions = _NODE_POSITIONS[type(node)] = _LINEAR_NODES.get(node.name())
        if positions is None:  # not the node expected: this device's calls take `_LinearFunction` from now on
            _FAST_DEVICES[x.device.type] = False
            return None
        if backward is not None:
            node.register_hook(functools.partial(compiled_linear.node_hook, backward, qs, positions[0], positions[1]))
    return x2, y2, (y2 if x2 is x else y2.reshape(*x.shape[:-1], y2.shape[-1]))


def _inspect_backward(qs, dy, dx, dwt) -> None:
    """The backward inspection of `_inspected_linear`, called after its linear's node ran (by the compiled
    linear's hook, or by `compiled_linear.node_hook`: the Python path's, and compiled autograd's in either path):
    dy, dx and dW in `_LinearFunction`'s order, as one statistics group (dWt is the gradient of Wᵀ; dx or dWt
    None where torch computed none)."""
    q_dy, q_dw = qs["grad_output"], qs["grad_weight"]
    if not q_dy.inspect_tensor_enabled:
        dy = None
    elif dy is not None and not dy.is_contiguous():
        dy = dy.contiguous()
    dw = dwt.t() if dwt is not None and q_dw.inspect_tensor_enabled else None  # the gradient of Wᵀ laid out as W
    inspect_group(((q_dy, dy, dy, dy), (qs["grad_input"], dx, None, None), (q_dw, dw, None, None)))


class _SkippedBackwardUses(torch.autograd.Function):
    """Identity on a grouped layer's output whose backward does the grad_output bookkeeping (`skip_use`) of the
    GEMMs that got no rows in the forward, so their delayed scaling advances like everyone else's."""

    @staticmethod
    def forward(ctx, out, states, recipe):
        ctx.states, ctx.recipe = states, recipe
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        for state in ctx.states:
            state.skip_use("grad_output", ctx.recipe)
        return grad, None, None


def skipped_uses(out: torch.Tensor, empty: Sequence[GemmState], recipe) -> torch.Tensor:
    """Delayed-scaling bookkeeping for the GEMMs of a grouped layer that got no rows in this forward (not in a
    recompute): their input / weight uses now, their grad_output use in the backward; returns `out`."""
    if recipe is None or not empty or in_recompute():
        return out
    if not any(state.amax_rows(recipe) for state in empty):
        return out  # no delayed scaling: nothing to keep in step
    for state in empty:
        for role in ("input", "weight"):
            state.skip_use(role, recipe)
    if torch.is_grad_enabled() and out.requires_grad:
        return _SkippedBackwardUses.apply(out, tuple(empty), recipe)
    return out


# ------------------------------------------------------------------------------------------------ module
class BaseLayer(torch.nn.Module):
    """`name` (``Layer_<n>`` when None; may be reassigned, read at forward time) and the recipe resolution."""

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{type(self).__name__}: name must be a str or None, got {type(name).__name__}")
        self.name = name if name is not None else next_layer_name()
        #: recipe used inside `tedebug.autocast()` blocks that give none (set by `convert_model(recipe=...)`)
        self.default_recipe = None
        register_state_hooks(self)  # delayed-scaling state in state_dict (tedebug.nn.state)

    def active_recipe(self):
        """The recipe for this forward: None outside autocast (high precision), else by the autocast precedence."""
        if not INNERMOST.enabled:
            return None
        recipe = INNERMOST.recipe
        if recipe is not None:
            return recipe
        return self.default_recipe if self.default_recipe is not None else default_recipe()

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


def resolve_dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    return params_dtype if params_dtype is not None else torch.get_default_dtype()
