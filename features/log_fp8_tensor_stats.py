"""`LogFp8TensorStats`: statistics of quantized tensors, for the training recipe and "what-if" recipes.

Statistic grammar ``[<recipe>_]<stat>[_columnwise]`` (`tedebug.features.fp8_stat_names`): recipe in
fp8_delayed_scaling, fp8_current_scaling, mxfp8, fp8_block_scaling (none = the recipe the tensor is trained with);
stat in underflows%, scale_inv_min, scale_inv_max, scale_inv_std, mse, overflows% (delayed scaling only).  The
logged name is the string as written in the config.

Where the values come from, per statistic (each GEMM direction separately, so mixed plans and hybrid quantizers
work): a rowwise statistic reads the rowwise GEMM operand, a ``_columnwise`` one the columnwise operand, each in
its own format.  The training recipe of a direction is the format of that operand.  A statistic naming another
recipe is a what-if: the high-precision tensor is quantized with a fresh quantizer of that recipe (both
directions, once per distinct recipe per feed) by emulation on any device.  What-if quantizers: per-tensor current
scaling (no power-of-two, epsilon 0), MXFP8 (1x32, E8M0), FP8 block (128x128 tiles, power-of-two scales, epsilon 0);
their element format is the training quantizer's FP8 format when that is per-tensor or block FP8, else E4M3.
On a layer or direction that runs in high precision (outside `tedebug.autocast`, a bf16 run, a GEMM with
quantization disabled) what-if statistics quantize the high-precision tensor all the same, so a bf16 run can ask
"what would MXFP8 / FP8 block / current scaling do to these tensors" (a tedebug extension).

A statistic never stops training.  One that cannot be computed for a tensor - a training-recipe statistic of a
high-precision direction, an NVFP4 operand (use LogNvfp4TensorStats), overflows% outside delayed scaling, a
what-if ``fp8_delayed_scaling_`` statistic (it needs an amax history), a shape the what-if format cannot take, a
statistic needing the high-precision tensor when only the quantized weight exists - is skipped with one warning in
the main log naming the layer, tensor, statistics and the reason.  Errors that can be known at config load
(unknown statistic names, ``nvfp4_`` prefixes, ``_columnwise`` of per-tensor recipes) stay load errors.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from tedebug import active
from tedebug.features.base import (
    ScheduledInspectFeature,
    feed_statistics,
    log_once,
    schedule_of,
    schedule_options,
    scheduled_now,
    stat_list,
    storage_for,
)
from tedebug.features.config_checks import FeatureConfigError, require_stats_list
from tedebug.features.fp8_stat_names import STATS_NEEDING_TENSOR, Fp8StatName, parse_fp8_stat
from tedebug.memo import memoized
from tedebug.quantization.tensor import QuantizedTensor, Quantizer
from tedebug.recipe import PER_TENSOR_RECIPE_NAMES, RecipeName
from tedebug.registry import api_method, register_feature
from tedebug.stats import StatRequest

MARKER = "fp8"
CURRENT_KEY = ""  # key of the training-recipe operands in StatsEngine.feed(quantized=...)
#: the recipes whose quantizers have an FP8 element format a what-if quantizer can take over
FP8_FORMAT_RECIPES = (RecipeName.DELAYED, RecipeName.CURRENT, RecipeName.BLOCK)


# ------------------------------------------------------------------------------------------------ operands
def recipe_of(storage: QuantizedTensor) -> str:
    """The statistic-prefix recipe name of a quantized storage (from the quantizer that made it)."""
    name = getattr(getattr(storage, "quantizer", None), "recipe_name", "")
    if name:
        return name
    from tedebug.quantization.float8 import Float8Tensor
    from tedebug.quantization.float8_block import Float8BlockwiseTensor
    from tedebug.quantization.mxfp8 import MXFP8Tensor
    from tedebug.quantization.nvfp4 import NVFP4Tensor

    by_type = (
        (MXFP8Tensor, RecipeName.MXFP8),
        (NVFP4Tensor, RecipeName.NVFP4),
        (Float8BlockwiseTensor, RecipeName.BLOCK),
        (Float8Tensor, RecipeName.CURRENT),
    )
    for cls, recipe in by_type:
        if isinstance(storage, cls):
            return recipe.value
    raise ValueError(f"LogFp8TensorStats: unsupported quantized tensor type {type(storage).__name__}")


def what_if_format(quantizer: Optional[Quantizer]) -> str:
    """FP8 element format of what-if quantizers: the training quantizer's when it is per-tensor or block FP8
    (for a hybrid: its rowwise child first, then its columnwise child), else E4M3."""
    candidates = [quantizer]
    if quantizer is not None and hasattr(quantizer, "rowwise_quantizer"):
        candidates = [quantizer.rowwise_quantizer, quantizer.columnwise_quantizer]
    for q in candidates:
        if getattr(q, "recipe_name", "") in FP8_FORMAT_RECIPES and getattr(q, "fp8_format", None):
            return q.fp8_format
    return "E4M3"


def make_what_if_quantizer(recipe: str, fp8_format: str) -> Quantizer:
    """A fresh quantizer of `recipe` (both directions on) for what-if statistics."""
    if recipe == RecipeName.CURRENT:
        from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

        return Float8CurrentScalingQuantizer(fp8_format, amax_epsilon=0.0, force_pow_2_scales=False)
    if recipe == RecipeName.MXFP8:
        from tedebug.quantization.mxfp8 import MXFP8Quantizer

        return MXFP8Quantizer(fp8_format)
    if recipe == RecipeName.BLOCK:
        from tedebug.quantization.float8_block import Float8BlockQuantizer

        return Float8BlockQuantizer(fp8_format, block_scaling_dim=2, amax_epsilon=0.0, force_pow_2_scales=True)
    if recipe == RecipeName.DELAYED:
        raise ValueError(
            "LogFp8TensorStats: fp8_delayed_scaling statistics can only be computed when the tensor "
            "is trained with delayed scaling (a what-if delayed-scaling quantization needs the amax "
            "history, which does not exist)"
        )
    raise ValueError(f"LogFp8TensorStats: no what-if quantizer for recipe {recipe!r}")


# ------------------------------------------------------------------------------------------------ planning
class _Plan:
    """What one feed computes: the requests, the quantized tensors by key, and usages to restore afterwards."""

    def __init__(self) -> None:
        self.requests: List[StatRequest] = []
        self.quantized: Dict[str, QuantizedTensor] = {}
        self.what_if: List[str] = []  # recipes to quantize, in first-use order
        self.current: Dict[str, QuantizedTensor] = {}  # usage -> training storage read by current stats
        self.restore: List[Tuple[QuantizedTensor, str]] = []
        self.skipped: Dict[str, List[str]] = {}  # reason -> stat names skipped for it


def _current_problem(stat: Fp8StatName, recipe: str) -> Optional[str]:
    """Why a training-recipe statistic cannot be computed for an operand trained with `recipe` (None: it can)."""
    if recipe == RecipeName.NVFP4:
        return (
            f"the {stat.usage} operand is NVFP4; use LogNvfp4TensorStats for NVFP4 statistics, or prefix an FP8 "
            f"recipe (mxfp8_, fp8_block_scaling_, fp8_current_scaling_) for a what-if statistic"
        )
    if stat.columnwise and recipe in PER_TENSOR_RECIPE_NAMES:
        return (
            f"'_columnwise' does not exist for the per-tensor recipe {recipe} (its columnwise data is the "
            f"transpose of the rowwise data)"
        )
    if stat.stat == "overflows%" and recipe != RecipeName.DELAYED:
        return f"overflows% exists only for delayed scaling, but the tensor is trained with {recipe}"
    return None


def _ensure_usage(plan: _Plan, storage: QuantizedTensor, usage: str) -> Optional[str]:
    """Make sure `storage` holds `usage` (added temporarily when it can be derived, e.g. the transposed bytes of
    per-tensor FP8, as TransformerEngine does); the reason it cannot, or None."""
    present = storage.has_rowwise if usage == "rowwise" else storage.has_columnwise
    if present:
        return None
    try:
        storage.update_usage(**{f"{usage}_usage": True})
    except RuntimeError as err:  # this format cannot derive one direction from the other: reported and skipped
        return f"the {usage} representation was not produced in this pass and cannot be derived ({err})"
    plan.restore.append((storage, usage))
    return None


def _skip(plan: _Plan, reason: str, stat: Fp8StatName) -> None:
    plan.skipped.setdefault(reason, []).append(stat.name)


@functools.lru_cache(maxsize=4096)
def _request(stat: Fp8StatName, key: str) -> StatRequest:
    """The (immutable) request of `stat` reading the quantized tensor `key`, made once."""
    return StatRequest(stat.name, stat.stat, recipe=key, columnwise=stat.columnwise)


def _fill_plan(
    plan: _Plan,
    stats: Tuple[Fp8StatName, ...],
    tensor: Optional[torch.Tensor],
    storages: Dict[str, Optional[QuantizedTensor]],
) -> None:
    """Requests of the statistics that can be computed; the others go to `plan.skipped` with their reason (a
    statistic never stops training: what cannot be known at config load is reported and skipped here).
    `storages`: the quantized storage of each usage's GEMM operand (`storage_for`), None for high precision."""
    for stat in stats:
        if tensor is None and stat.stat in STATS_NEEDING_TENSOR:
            _skip(
                plan,
                "the high-precision tensor is not available (weight kept only in quantized form); only "
                "scale_inv_min / scale_inv_max / scale_inv_std can be logged",
                stat,
            )
            continue
        storage = storages[stat.usage]
        current = recipe_of(storage) if storage is not None else None
        if stat.recipe is None or stat.recipe == current:
            if storage is None:
                _skip(
                    plan,
                    f"its {stat.usage} GEMM operand runs in high precision (recipe-prefixed what-if "
                    f"statistics such as mxfp8_mse work on high-precision tensors)",
                    stat,
                )
                continue
            reason = _current_problem(stat, current) or _ensure_usage(plan, storage, stat.usage)
            if reason is not None:
                _skip(plan, reason, stat)
                continue
            plan.current[stat.usage] = storage
            key = CURRENT_KEY
        else:
            if stat.recipe == RecipeName.DELAYED:
                _skip(
                    plan,
                    "fp8_delayed_scaling statistics need a tensor trained with delayed scaling (a what-if "
                    "delayed-scaling quantization would need an amax history, which does not exist)",
                    stat,
                )
                continue
            if tensor is None:
                _skip(
                    plan,
                    "a what-if statistic quantizes the high-precision tensor, which is not available "
                    "(weight kept only in quantized form)",
                    stat,
                )
                continue
            if stat.recipe not in plan.what_if:
                plan.what_if.append(stat.recipe)
            key = stat.recipe
        plan.requests.append(_request(stat, key))


class _Template(NamedTuple):
    """A plan as a function of what decides it (the statistics, whether the high-precision tensor exists, and per
    usage the operand's recipe and whether it holds that usage): the same for every feed of that kind."""

    requests: Tuple[StatRequest, ...]  # one tuple object per template: the engine reuses its parse
    current: Tuple[str, ...]  # usages whose training storage the current-recipe statistics read
    what_if: Tuple[str, ...]
    skipped: Tuple[Tuple[str, Tuple[str, ...]], ...]


def _storage_kind(storage: Optional[QuantizedTensor], usage: str) -> Optional[Tuple[str, int]]:
    """(recipe, 1 if the storage holds `usage` else 0) of a usage's storage, None for high precision."""
    if storage is None:
        return None
    return recipe_of(storage), int(storage.has_rowwise if usage == "rowwise" else storage.has_columnwise)


def _template(stats: Tuple[Fp8StatName, ...], tensor: Optional[torch.Tensor], storages) -> _Template:
    """The plan of storages that hold their usages (`_fill_plan` then changes nothing on them)."""
    plan = _Plan()
    _fill_plan(plan, stats, tensor, storages)
    return _template_of(plan)


def _template_of(plan: _Plan) -> _Template:
    return _Template(
        tuple(plan.requests),
        tuple(plan.current),
        tuple(plan.what_if),
        tuple((reason, tuple(names)) for reason, names in plan.skipped.items()),
    )


def _parsed(names) -> Tuple[Fp8StatName, ...]:
    """The statistic names of a config parsed (once per session and list)."""
    return memoized("LogFp8TensorStats.stats", names, lambda: tuple(parse_fp8_stat(s) for s in names))


def _plan_from(template: _Template, storages) -> _Plan:
    plan = _Plan()
    plan.requests = list(template.requests)
    plan.current = {usage: storages[usage] for usage in template.current}
    plan.what_if = list(template.what_if)
    plan.skipped = {reason: list(names) for reason, names in template.skipped}
    return plan


def _current_view(plan: _Plan) -> Optional[QuantizedTensor]:
    """One object answering both usages for the training-recipe statistics: the shared storage, or a hybrid view
    of two different storages."""
    row, col = plan.current.get("rowwise"), plan.current.get("columnwise")
    if row is None or col is None or row is col:
        return row if row is not None else col
    from tedebug.quantization.hybrid import HybridQuantizedTensor

    return HybridQuantizedTensor(
        row.shape, row.dtype, row.device, None, rowwise_sub_storage=row, columnwise_sub_storage=col
    )


def _restore(plan: _Plan) -> None:
    for storage, usage in plan.restore:
        storage.update_usage(**{f"{usage}_usage": False})


# ------------------------------------------------------------------------------------------------ feature
@register_feature(namespace="transformer_engine")
class LogFp8TensorStats(ScheduledInspectFeature):
    """Log statistics of quantized tensors (see the module docstring)."""

    PARAMS = ("stats",)

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        stats = require_stats_list(cls.__name__, params, path)
        for i, entry in enumerate(stats):
            try:
                parse_fp8_stat(entry)
            except ValueError as err:
                raise FeatureConfigError(str(err), path + ("stats", i)) from err

    @api_method
    def inspect_tensor(
        self,
        config: dict,
        layer_name: str,
        tensor_name: str,
        iteration: int,
        tensor: Optional[torch.Tensor] = None,
        tp_group: Any = None,
        tp_size: int = 1,
        rowwise_quantized_tensor: Any = None,
        columnwise_quantized_tensor: Any = None,
        quantizer: Optional[Quantizer] = None,
    ) -> None:
        if not scheduled_now(config, iteration):
            return
        name = type(self).__name__
        names = stat_list(config)
        storages = {
            "rowwise": storage_for(rowwise_quantized_tensor, "rowwise"),
            "columnwise": storage_for(columnwise_quantized_tensor, "columnwise"),
        }
        kinds = (_storage_kind(storages["rowwise"], "rowwise"), _storage_kind(storages["columnwise"], "columnwise"))
        interned: Optional[Tuple[StatRequest, ...]] = None
        session = active.DEBUG_MANAGER
        if session is not None and all(kind is None or kind[1] for kind in kinds):
            # the common case: the plan depends only on this key (statistic names, whether the high-precision
            # tensor exists, per usage the storage's recipe and presence), so it is made once per session and key;
            # the key's parts have fixed types, so a plain dict compares it exactly (see tedebug.memo)
            key = (tuple(names), tensor is None, kinds)
            table = session.memo("LogFp8TensorStats.plan")
            template = table.get(key)
            if template is None:
                template = table[key] = _template(_parsed(names), tensor, storages)
            plan = _plan_from(template, storages)
            interned = template.requests
        else:  # a usage to add to a storage for this feed (and remove after it), or no session: planned each time
            plan = _Plan()
        try:
            if interned is None:
                _fill_plan(plan, _parsed(names), tensor, storages)
            fmt = what_if_format(quantizer)
            for recipe in plan.what_if:
                try:
                    plan.quantized[recipe] = _quantize_what_if(recipe, fmt, tensor)
                except (ValueError, TypeError, RuntimeError) as err:  # e.g. a shape the format cannot take
                    dropped = [r.name for r in plan.requests if r.recipe == recipe]
                    plan.requests = [r for r in plan.requests if r.recipe != recipe]
                    interned = None
                    plan.skipped.setdefault(
                        f"the what-if {recipe} quantization of shape {tuple(tensor.shape)} failed: {err}", []
                    ).extend(dropped)
            for reason, names in plan.skipped.items():
                log_once(
                    f"Feature={name}: skipping {names} of tensor {tensor_name}: {reason}", layer_name, logging.WARNING
                )
            if not plan.requests:
                return
            view = _current_view(plan)
            if view is not None:
                plan.quantized[CURRENT_KEY] = view
            # one tuple object per distinct request list: the engine then reuses its parse of the last feed
            requests = interned
            if requests is None:
                requests = tuple(plan.requests)
                requests = memoized("LogFp8TensorStats.requests", requests, lambda: requests)
            feed_statistics(
                name,
                layer_name,
                tensor_name,
                requests,
                tensor,
                iteration=iteration,
                options=schedule_options(config) + (MARKER,),
                quantized=plan.quantized,
                tp_group=tp_group,
                tp_size=tp_size,
            )
        finally:
            _restore(plan)
        log_once(f"Feature={name}, API=inspect_tensor: {tensor_name}", layer_name)

    def bind_inspect_tensor(self, config: dict, layer_name: str, tensor_name: str) -> "_BoundFeed":
        """`inspect_tensor` bound to one routed config, layer and tensor name for the rest of the session, as
        ``call(iteration, tensor, tp_group, tp_size, rowwise_quantized_tensor, columnwise_quantized_tensor,
        quantizer)`` (what `tedebug.plan` calls on the debug path; used only while this class also defines
        `inspect_tensor`)."""
        return _BoundFeed(self, config, layer_name, tensor_name)


class _BoundFeed:
    """`LogFp8TensorStats.inspect_tensor` for one config, layer and tensor name.

    What the config alone decides (schedule, statistic names, buffer options) is derived once.  A feed of a kind
    whose plan is a plain session template - no what-if quantization, nothing skipped, every usage present, so
    nothing to quantize, add, restore or warn about - goes straight to the statistics engine with the template's
    requests; any other feed takes `inspect_tensor`, which plans it in full.  The kind is what decides the plan
    (`_storage_kind` of each usage, whether the high-precision tensor exists) and whether both usages are one
    storage."""

    __slots__ = ("feature", "config", "layer_name", "tensor_name", "schedule", "options", "message", "logged", "plans")

    def __init__(self, feature: "LogFp8TensorStats", config: dict, layer_name: str, tensor_name: str) -> None:
        self.feature = feature
        self.config = config
        self.layer_name = layer_name
        self.tensor_name = tensor_name
        self.schedule = schedule_of(config)
        self.options = schedule_options(config) + (MARKER,)
        self.message = f"Feature={type(feature).__name__}, API=inspect_tensor: {tensor_name}"
        self.logged = False
        #: feed kind -> the template's requests when the kind takes the direct path, else None
        self.plans: Dict[tuple, Optional[Tuple[StatRequest, ...]]] = {}

    def __call__(
        self,
        iteration: int,
        tensor: Optional[torch.Tensor],
        tp_group: Any,
        tp_size: int,
        rowwise_quantized_tensor: Any,
        columnwise_quantized_tensor: Any,
        quantizer: Optional[Quantizer],
    ) -> None:
        if not self.schedule.is_active(iteration):
            return
        row = _operand_storage(rowwise_quantized_tensor, "rowwise")
        col = _operand_storage(columnwise_quantized_tensor, "columnwise")
        kind = (tensor is None, _storage_kind(row, "rowwise"), _storage_kind(col, "columnwise"), row is col)
        plans = self.plans
        if kind in plans:
            requests = plans[kind]
        else:
            requests = plans[kind] = self._direct_requests(tensor, row, col)
        if requests is None:
            self.feature.inspect_tensor(
                self.config,
                self.layer_name,
                self.tensor_name,
                iteration,
                tensor,
                tp_group,
                tp_size,
                rowwise_quantized_tensor,
                columnwise_quantized_tensor,
                quantizer,
            )
            return
        feed_statistics(
            type(self.feature).__name__,
            self.layer_name,
            self.tensor_name,
            requests,
            tensor,
            iteration=iteration,
            options=self.options,
            quantized={CURRENT_KEY: row if row is not None else col},
            tp_group=tp_group,
            tp_size=tp_size,
        )
        if not self.logged:  # the session writes it once per layer anyway
            log_once(self.message, self.layer_name)
            self.logged = True

    def _direct_requests(self, tensor, row, col) -> Optional[Tuple[StatRequest, ...]]:
        """The requests of a feed of this kind when it may skip `inspect_tensor` (see the class docstring)."""
        session = active.DEBUG_MANAGER
        if session is None:
            return None
        storages = {"rowwise": row, "columnwise": col}
        kinds = (_storage_kind(row, "rowwise"), _storage_kind(col, "columnwise"))
        names = tuple(stat_list(self.config))
        if all(kind is None or kind[1] for kind in kinds):
            table = session.memo("LogFp8TensorStats.plan")
            key = (names, tensor is None, kinds)
            template = table.get(key)
            if template is None:
                template = table[key] = _template(_parsed(names), tensor, storages)
        else:  # a usage is missing: direct only when no statistic reads it (nothing to add for a feed)
            plan = _Plan()
            try:
                _fill_plan(plan, _parsed(names), tensor, storages)
            finally:
                added, _ = bool(plan.restore), _restore(plan)
            if added:
                return None
            template = _template_of(plan)
        if template.what_if or template.skipped or not template.requests:
            return None
        if len(template.current) == 2 and row is not col:  # two storages: the hybrid view of inspect_tensor
            return None
        return template.requests


#: operand type -> True: the operand is its own storage (a quantized tensor that is neither a hybrid nor the
#: identity format), False: high precision (no storage), None: ask `storage_for` (a hybrid picks a sub-storage)
_OPERAND_KINDS: Dict[type, Optional[bool]] = {}


def _operand_storage(operand: Any, usage: str) -> Optional[QuantizedTensor]:
    """`storage_for(operand, usage)` answered from the operand's type where that decides it (one dict look-up)."""
    cls = type(operand)
    kind = _OPERAND_KINDS.get(cls, _UNKNOWN)
    if kind is _UNKNOWN:
        from tedebug.quantization.hybrid import HybridQuantizedTensor
        from tedebug.quantization.identity import IdentityTensor

        if issubclass(cls, HybridQuantizedTensor):
            kind = None
        else:
            kind = issubclass(cls, QuantizedTensor) and not issubclass(cls, IdentityTensor)
        if len(_OPERAND_KINDS) < 256:
            _OPERAND_KINDS[cls] = kind
    if kind is None:
        return storage_for(operand, usage)
    return operand if kind else None


_UNKNOWN = object()


def _quantize_what_if(recipe: str, fmt: str, tensor: torch.Tensor):
    """The high-precision tensor quantized with a fresh what-if quantizer of `recipe` (both directions)."""
    return make_what_if_quantizer(recipe, fmt).quantize(tensor.detach())
