"""Helpers shared by the built-in features (`tedebug.features`).

- `ValidatedFeature`: a `FeatureMapper` base whose `validate_feature_config` checks, at config load, every key at
  every level of a feature block (feature level, `gemms_struct` entries, `tensors_struct` entries) against the
  feature's declared parameters, and runs the feature's value checks on every *effective* config (the feature
  level merged with one GEMM entry and one tensor entry, as the B.3 parser would merge them);
- scheduling: `scheduled_enabled` answers `inspect_tensor_enabled` from the schedule keys and (for statistics
  features) records the layer's next enabled iteration in the stats engine; `scheduled_now` re-checks a feature's
  own schedule in `inspect_tensor`; `schedule_options` is the buffer-key part of F.5;
- `reduction_params`: the reduction group / skip flag / weight flag of spec F.6 (`reduction_args`: the same as a
  plain tuple, for the hot path);
- the quantized-statistic grammar ``[<recipe>_]<stat>[_columnwise]`` of LogFp8TensorStats (`parse_fp8_stat`);
- `storage_for`: the quantized storage behind one direction of a GEMM operand (hybrids unwrapped);
- `sanitize_name`: file-name-safe layer / tensor names for tensor dumps;
- `log_once`: a main-log message written once per (layer, message);
- session memos: `exact_key` (a hashable key equal only for equal, same-typed config values) and `memoized`,
  through which the per-call work that depends only on the config (schedules, statistic requests, buffer-key
  options) is done once per session (the memo tables live in the `DebugSession` and die with it);
  `config_memoized` finds such a value by the config object's identity (checking, at every call, that the config
  still holds the very same immutable values), which is cheaper than building the content key on every call.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterator, Optional, Sequence, Tuple

from tedebug import debug_api
from tedebug.config.errors import closest
from tedebug.config.schedule import SCHEDULE_KEYS, Schedule
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.registry import FeatureMapper, api_method

# ------------------------------------------------------------------------------------------------ config validation
FEATURE_LEVEL_KEYS = ("enabled",)
GEMM_LIST_KEYS = ("gemms", "gemms_struct")
TENSOR_LIST_KEYS = ("tensors", "tensors_struct")
STRUCTURAL_KEYS = frozenset(("enabled", "gemms", "gemms_struct", "tensors", "tensors_struct", "gemm", "tensor"))


class FeatureConfigError(ValueError):
    """A bad feature parameter; `key_path` locates it inside the feature block (the config loader prefixes the
    section / namespace / feature path and the line)."""

    def __init__(self, message: str, key_path: Sequence = ()):
        super().__init__(message)
        self.key_path = tuple(key_path)


def _levels(cfg: dict, uses_gemms: bool, uses_tensors: bool) -> Iterator[Tuple[tuple, dict, Tuple[str, ...]]]:
    """Every level of a feature block: (key path, the dict, its structural keys)."""
    top = FEATURE_LEVEL_KEYS + (GEMM_LIST_KEYS if uses_gemms else ()) + (TENSOR_LIST_KEYS if uses_tensors else ())
    yield (), cfg, top
    entry_tensor_keys = TENSOR_LIST_KEYS if uses_tensors else ()
    if uses_gemms:
        for i, entry in enumerate(_entries(cfg, "gemms_struct")):
            path = ("gemms_struct", i)
            yield path, entry, ("gemm",) + entry_tensor_keys
            if uses_tensors:
                for j, tensor_entry in enumerate(_entries(entry, "tensors_struct")):
                    yield path + ("tensors_struct", j), tensor_entry, ("tensor",)
    if uses_tensors:
        for j, tensor_entry in enumerate(_entries(cfg, "tensors_struct")):
            yield ("tensors_struct", j), tensor_entry, ("tensor",)


def _entries(cfg: dict, key: str) -> list:
    value = cfg.get(key)
    if not isinstance(value, list):
        return []
    return [e for e in value if isinstance(e, dict)]


def _without(cfg: dict, keys) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


def effective_configs(cfg: dict, uses_gemms: bool, uses_tensors: bool) -> Iterator[Tuple[tuple, dict]]:
    """(key path of the innermost entry, merged parameters) for every GEMM / tensor entry combination.

    Merging follows the B.3 parser: entry keys override the feature-level keys.  Structural keys are dropped.
    """
    top = _without(cfg, STRUCTURAL_KEYS)
    gemm_levels = [((), cfg, top)]
    if uses_gemms and isinstance(cfg.get("gemms_struct"), list):
        gemm_levels = [(("gemms_struct", i), e, {**top, **_without(e, STRUCTURAL_KEYS)})
                       for i, e in enumerate(_entries(cfg, "gemms_struct"))]
    for path, level, merged in gemm_levels:
        tensor_entries = _entries(level, "tensors_struct") if uses_tensors else []
        if uses_tensors and isinstance(level.get("tensors_struct"), list):
            for j, entry in enumerate(tensor_entries):
                yield path + ("tensors_struct", j), {**merged, **_without(entry, STRUCTURAL_KEYS),
                                                     "tensor": entry.get("tensor")}
        else:
            yield path, merged


class ValidatedFeature(FeatureMapper):
    """Base of the built-in features: declared parameters, checked at config load.

    Subclasses set `PARAMS` (feature parameter names), `USES_GEMMS` / `USES_TENSORS` (which selection keys the
    feature takes), `SCHEDULED` (whether freq / start_step / end_step / start_end_list are accepted) and may override
    `check_params(cls, params, path)` to check the values of one effective config.
    """

    PARAMS: Tuple[str, ...] = ()
    USES_GEMMS = False
    USES_TENSORS = True
    SCHEDULED = False

    @classmethod
    def param_names(cls) -> Tuple[str, ...]:
        return tuple(cls.PARAMS) + (SCHEDULE_KEYS if cls.SCHEDULED else ())

    @classmethod
    def validate_feature_config(cls, cfg: dict) -> None:
        if not isinstance(cfg, dict):
            raise FeatureConfigError(f"{cls.__name__}: the feature config must be a mapping, got {type(cfg).__name__}")
        for path, level, structural in _levels(cfg, cls.USES_GEMMS, cls.USES_TENSORS):
            check_known_keys(cls.__name__, level, structural + cls.param_names(), path)
        cls._check_selection(cfg)
        for path, params in effective_configs(cfg, cls.USES_GEMMS, cls.USES_TENSORS):
            if cls.SCHEDULED:
                _check_schedule(cls.__name__, params, path)
            cls.check_params(params, path)

    @classmethod
    def _check_selection(cls, cfg: dict) -> None:
        """The GEMM / tensor selection the hooks will parse must exist (te_debug_reference B.3, B.6): gemms or
        gemms_struct when the feature takes GEMMs; tensors or tensors_struct when it takes tensors — inside every
        gemms_struct entry, since a GEMM entry's tensors are parsed from that entry."""
        name = cls.__name__

        def has_tensors(level: dict) -> bool:
            return "tensors" in level or "tensors_struct" in level

        tensors_hint = "provide 'tensors: [...]' or 'tensors_struct: [...]' (the tensors it applies to)"
        if cls.USES_GEMMS:
            if "gemms_struct" in cfg:
                if cls.USES_TENSORS:
                    for i, entry in enumerate(_entries(cfg, "gemms_struct")):
                        if not has_tensors(entry):
                            raise FeatureConfigError(
                                f"{name}: the gemms_struct entry of gemm {entry.get('gemm')!r} lists no tensors; "
                                f"{tensors_hint} inside the entry", ("gemms_struct", i))
                return
            if "gemms" not in cfg:
                raise FeatureConfigError(f"{name}: provide 'gemms: [...]' or 'gemms_struct: [...]' (the GEMMs it "
                                         f"applies to)", ())
        if cls.USES_TENSORS and not has_tensors(cfg):
            raise FeatureConfigError(f"{name}: {tensors_hint}", ())

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        """Check the parameter values of one effective config (raise `FeatureConfigError`)."""


def check_known_keys(feature: str, level: dict, allowed: Sequence[str], path: tuple = ()) -> None:
    """`FeatureConfigError` for the first key of `level` not in `allowed`, naming the closest valid key."""
    for key in level:
        if key in allowed:
            continue
        hint = closest(key, allowed)
        hint_text = f"; did you mean {hint!r}?" if hint else ""
        raise FeatureConfigError(
            f"{feature}: unknown key {key!r}{hint_text} (valid keys here: {', '.join(allowed)})", path + (key,))


def _check_schedule(feature: str, params: dict, path: tuple) -> None:
    try:
        Schedule.from_config(params)
    except ValueError as err:
        raise FeatureConfigError(f"{feature}: {err}", path) from err


def require_param(feature: str, params: dict, key: str, path: tuple, expected: str) -> Any:
    """The value of a required parameter; `FeatureConfigError` naming it when it is missing."""
    if key not in params or params[key] is None:
        where = "" if not params.get("tensor") else f" (tensor {params['tensor']!r})"
        raise FeatureConfigError(f"{feature}: missing required parameter {key!r}{where}; expected {expected}",
                                 path + (key,))
    return params[key]


def require_stats_list(feature: str, params: dict, path: tuple) -> list:
    stats = require_param(feature, params, "stats", path, "a list of statistic names")
    if not isinstance(stats, list) or not stats:
        raise FeatureConfigError(f"{feature}: 'stats' must be a non-empty list of statistic names, got {stats!r}",
                                 path + ("stats",))
    return stats


# ------------------------------------------------------------------------------------------------ session helpers
def session():
    """The active debug session (RuntimeError when tedebug is not initialised)."""
    return debug_api.session()


_PLAIN_TYPES = frozenset((str, int, type(None)))


def exact_key(value: Any) -> Hashable:
    """A hashable key of a config value that equals another's only when both values are equal *and* of the same
    types throughout (``1``, ``1.0`` and ``True`` get different keys; list / tuple / dict contents are keyed in
    order).  TypeError for a value holding an unhashable object of another kind."""
    kind = type(value)
    if value is None or kind is str or kind is int:
        return value
    if kind is list or kind is tuple:
        items = tuple(value)
        if set(map(type, items)) <= _PLAIN_TYPES:  # the common case (a list of names): no recursion
            return (kind, items)
        return (kind, tuple(map(exact_key, items)))
    if kind is dict:
        return (kind, tuple((exact_key(k), exact_key(v)) for k, v in value.items()))
    hash(value)
    return (kind, value)


def memoized(table: str, key_parts: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, memoised in the active session's memo `table` under ``exact_key(key_parts)``.

    `compute` must depend only on `key_parts`.  Without an active session, or for an unhashable key, it is simply
    called.  A call that raises stores nothing.
    """
    current = debug_api.DEBUG_MANAGER
    if current is None:
        return compute()
    try:
        key = exact_key(key_parts)
    except TypeError:
        return compute()
    memo = current.memo(table)
    try:
        return memo[key]
    except KeyError:
        value = memo[key] = compute()
        return value


#: value types `config_memoized` can check by identity: holding the very same object means holding the same content
_IMMUTABLE_TYPES = frozenset((str, int, float, bool, type(None)))
#: entries a `config_memoized` table keeps before it starts over (callers passing a new dict every call)
CONFIG_MEMO_SIZE = 4096


def _same_items(pair: tuple) -> bool:
    """True when list ``pair[0]`` still holds exactly the objects ``pair[1]`` (a tuple taken from it)."""
    current, items = pair
    return len(current) == len(items) and all(map(operator.is_, current, items))


def _identity_checkable(values: tuple) -> Optional[tuple]:
    """``(list, tuple of its items)`` for each list among `values` when every value is immutable or a list of
    immutable items (then holding the very same objects means holding the same content); None otherwise."""
    lists = []
    for value in values:
        if type(value) is list:
            items = tuple(value)
            if not all(type(item) in _IMMUTABLE_TYPES for item in items):
                return None
            lists.append((value, items))
        elif type(value) not in _IMMUTABLE_TYPES:
            return None
    return tuple(lists)


def config_memoized(table: str, config: dict, keys: Tuple[str, ...], extra: Hashable,
                    compute: Callable[[], Any]) -> Any:
    """``compute()``, memoised in the active session's memo `table` for this very `config` object (and `extra`).

    For the hot path, which sees the same parsed config objects call after call: the entry is found by the
    config's identity and served only while `config` holds the very same objects under `keys` (a list value: the
    same list holding the same items), all of them immutable - so a mutated config is computed afresh, and a config
    holding a mutable value under `keys` (a dict, a nested list) is never stored.  `compute` must depend only on
    `config`'s values under `keys` and on `extra`; going itself through the content-keyed `memoized`, it returns the
    same object either way.  Without an active session it is simply called; a call that raises stores nothing.
    """
    current = debug_api.DEBUG_MANAGER
    if current is None:
        return compute()
    memo = current.memo(table)
    values = tuple(map(config.get, keys))
    key = (id(config), extra)
    entry = memo.get(key)
    if (entry is not None and entry[0] is config and all(map(operator.is_, values, entry[1]))
            and all(map(_same_items, entry[2]))):
        return entry[3]
    value = compute()
    lists = _identity_checkable(values)
    if lists is not None:
        if len(memo) >= CONFIG_MEMO_SIZE:
            memo.clear()
        memo[key] = (config, values, lists, value)  # holds `config`: its id is not reused while the entry lives
    return value


def log_once(message: str, layer_name: Optional[str] = None, level: int = logging.INFO) -> None:
    """Write `message` to the main log once per (layer, message) in this session."""
    session().log_message(message, layer_name, level)


# ------------------------------------------------------------------------------------------------ scheduling
def scheduled_enabled(config: dict, layer_name: str, iteration: int, *, note_stats: bool = True
                      ) -> Tuple[bool, Optional[int]]:
    """`(active now, next active iteration or None)` from the schedule keys of a parsed config.

    With `note_stats`, the next iteration is recorded for the layer in the stats engine (F.6 participation rule;
    last writer wins per layer, as in TransformerEngine).
    """
    active, nxt = cached_schedule(config).query(iteration)
    if note_stats:
        session().stats.note_next_iteration(layer_name, nxt)
    return active, nxt


class ScheduledInspectFeature(ValidatedFeature):
    """Base of the inspecting features (statistics, dumps): accepts the schedule keys and answers
    `inspect_tensor_enabled` from them.  `NOTE_STATS` says whether the next iteration is recorded in the stats engine
    (the statistics features) or not (DumpTensors)."""

    SCHEDULED = True
    NOTE_STATS = True
    #: `*_enabled` hooks answered from the schedule keys alone: `tedebug.plan` evaluates the schedule instead of
    #: calling them (a subclass overriding one is called again unless it declares this itself)
    SCHEDULE_ONLY_HOOKS = frozenset({"inspect_tensor_enabled"})

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int):
        return scheduled_enabled(config, layer_name, iteration, note_stats=self.NOTE_STATS)


def scheduled_now(config: dict, iteration: int) -> bool:
    """True when the feature's own schedule is active at `iteration`.

    `inspect_tensor` reaches every feature that selects the tensor once *any* of them is enabled (the enabled
    answers of several features are OR-ed), so each feature re-checks its own schedule before doing anything.
    """
    return cached_schedule(config).is_active(iteration)


def _schedule_values(config: dict) -> tuple:
    return config.get("freq"), config.get("start_step"), config.get("end_step"), config.get("start_end_list")


def cached_schedule(config: dict) -> Schedule:
    """`Schedule.from_config(config)`, parsed once per session for each distinct set of schedule values (and found
    by the config object's identity while it holds the same values)."""
    return config_memoized("schedule.by_config", config, SCHEDULE_KEYS, None, lambda: _content_schedule(config))


def _content_schedule(config: dict) -> Schedule:
    return memoized("schedule", _schedule_values(config), lambda: Schedule.from_config(config))


def schedule_options(config: dict) -> Tuple[Any, ...]:
    """The schedule part of a statistics buffer key: (start_step, end_step, start_end_list as int tuples)."""
    pairs = config.get("start_end_list") or ()
    return (config.get("start_step"), config.get("end_step"), tuple((int(a), int(b)) for a, b in pairs))



# ------------------------------------------------------------------------------------------------ reduction (F.6)
@dataclass(frozen=True)
class ReductionParams:
    reduction_group: Any
    skip_reduction: bool
    is_weight: bool


def reduction_params(tensor_name: str, tp_group: Any, tp_size: Optional[int]) -> ReductionParams:
    """Non-weight tensors: the session's reduction group (None = world).  Weights: the layer's TP group when
    `weight_tensor_tp_group_reduce` is on and tp_size > 1 (no group -> no reduction); otherwise no reduction."""
    return ReductionParams(*reduction_args(session(), tensor_name, tp_group, tp_size))


def reduction_args(current: Any, tensor_name: str, tp_group: Any, tp_size: Optional[int]) -> Tuple[Any, bool, bool]:
    """`reduction_params` of session `current` as a plain ``(reduction_group, skip_reduction, is_weight)`` tuple
    (the hot path's form)."""
    if tensor_name != "weight":
        return current.reduction_group, False, False
    if current.weight_tensor_tp_group_reduce and (tp_size or 1) > 1 and tp_group is not None:
        return tp_group, False, True
    return None, True, True


# ------------------------------------------------------------------------------------------------ quantized stats
DELAYED = "fp8_delayed_scaling"
CURRENT = "fp8_current_scaling"
MXFP8 = "mxfp8"
BLOCK = "fp8_block_scaling"
NVFP4 = "nvfp4"
FP8_RECIPES = (DELAYED, CURRENT, MXFP8, BLOCK)
PER_TENSOR_RECIPES = (DELAYED, CURRENT)
FP8_STATS = ("underflows%", "scale_inv_min", "scale_inv_max", "scale_inv_std", "mse", "overflows%")
COLUMNWISE_SUFFIX = "_columnwise"
#: statistics computed from the high-precision tensor as well as the quantized one
STATS_NEEDING_TENSOR = ("underflows%", "overflows%", "mse")


@dataclass(frozen=True)
class Fp8StatName:
    """One parsed LogFp8TensorStats statistic: `name` as written, `recipe` (None = the training recipe), the bare
    `stat`, and whether it reads the columnwise representation."""

    name: str
    recipe: Optional[str]
    stat: str
    columnwise: bool

    @property
    def usage(self) -> str:
        return "columnwise" if self.columnwise else "rowwise"


def supported_fp8_stat_names() -> list:
    """Every spelling the grammar accepts (for error messages)."""
    names = []
    for recipe in (None,) + FP8_RECIPES:
        for stat in FP8_STATS:
            if stat == "overflows%" and recipe not in (None, DELAYED):
                continue
            for columnwise in (False, True):
                if columnwise and (recipe in PER_TENSOR_RECIPES or stat == "overflows%"):
                    continue
                prefix = "" if recipe is None else recipe + "_"
                names.append(prefix + stat + (COLUMNWISE_SUFFIX if columnwise else ""))
    return names


def parse_fp8_stat(name: Any) -> Fp8StatName:
    """Parse ``[<recipe>_]<stat>[_columnwise]``; ValueError (listing the supported names) when invalid.

    recipe in fp8_delayed_scaling, fp8_current_scaling, mxfp8, fp8_block_scaling; stat in underflows%,
    scale_inv_min, scale_inv_max, scale_inv_std, mse, and overflows% (delayed scaling only).  ``nvfp4_...`` is
    rejected with a pointer to LogNvfp4TensorStats; ``_columnwise`` is rejected for the per-tensor recipes (their
    columnwise data is the transpose of the rowwise data).
    """
    if not isinstance(name, str):
        raise ValueError(f"LogFp8TensorStats: a statistic must be a string, got {name!r}")
    body, columnwise = name, False
    if body.endswith(COLUMNWISE_SUFFIX):
        body, columnwise = body[: -len(COLUMNWISE_SUFFIX)], True
    recipe = None
    for candidate in FP8_RECIPES + (NVFP4,):
        if body.startswith(candidate + "_"):
            recipe, body = candidate, body[len(candidate) + 1:]
            break
    if recipe == NVFP4:
        raise ValueError(f"LogFp8TensorStats: statistic {name!r} uses the nvfp4 recipe; NVFP4 statistics are logged "
                         f"by the LogNvfp4TensorStats feature (stats: [underflows%, mse])")
    if body not in FP8_STATS:
        raise ValueError(f"LogFp8TensorStats: statistic {name!r} is not supported. Grammar: [<recipe>_]<stat>"
                         f"[_columnwise] with recipe in {list(FP8_RECIPES)} and stat in {list(FP8_STATS)}; "
                         f"supported: {supported_fp8_stat_names()}")
    if body == "overflows%" and recipe not in (None, DELAYED):
        raise ValueError(f"LogFp8TensorStats: statistic {name!r}: overflows% exists only for the "
                         f"{DELAYED} recipe (bare overflows% under delayed scaling, or {DELAYED}_overflows%)")
    if columnwise and body == "overflows%":
        raise ValueError(f"LogFp8TensorStats: statistic {name!r} is not supported: overflows% (delayed scaling, "
                         f"per tensor) has no '_columnwise' form; supported: {supported_fp8_stat_names()}")
    if columnwise:
        check_columnwise_recipe(name, recipe)
    return Fp8StatName(name, recipe, body, columnwise)


def check_columnwise_recipe(name: str, recipe: Optional[str]) -> None:
    """ValueError for a ``_columnwise`` statistic of a per-tensor recipe."""
    if recipe in PER_TENSOR_RECIPES:
        raise ValueError(f"LogFp8TensorStats: statistic {name!r}: '_columnwise' is not supported for the {recipe} "
                         f"recipe (per-tensor scaling: the columnwise data is the transpose of the rowwise data; use "
                         f"the statistic without '_columnwise')")


def storage_for(operand: Any, usage: str) -> Optional[QuantizedTensor]:
    """The quantized storage holding `usage` of a GEMM operand (a hybrid gives its sub-storage), or None when the
    operand is high precision (plain tensor, identity format) or absent."""
    from tedebug.quantization.hybrid import HybridQuantizedTensor
    from tedebug.quantization.identity import IdentityTensor

    while isinstance(operand, HybridQuantizedTensor):
        operand = getattr(operand, f"{usage}_sub_storage")
    if isinstance(operand, QuantizedTensor) and not isinstance(operand, IdentityTensor):
        return operand
    return None



# ------------------------------------------------------------------------------------------------ tensor dumps
_UNSAFE_CHARS = '/\\:*?"<>| .'
_SANITIZE_TABLE = {ord(c): "_" for c in _UNSAFE_CHARS}


def sanitize_name(name: str) -> str:
    """Replace ``/ \\ : * ? " < > |``, space and ``.`` by ``_`` (file-name-safe layer / tensor names)."""
    return str(name).translate(_SANITIZE_TABLE)


def stat_list(config: Dict[str, Any]) -> list:
    """The parsed config's ``stats`` list (ValueError when absent: validation should have caught it)."""
    stats = config.get("stats")
    if not isinstance(stats, list) or not stats:
        raise ValueError(f"the feature config has no 'stats' list (got {stats!r})")
    return stats
