"""Transitional re-exports: the names that lived here, at their new homes.  Import from the new homes.

This module only remains because `tedebug.namespace` (being rewritten on another branch) still imports
`ScheduledInspectFeature` and `cached_schedule` from here; once that import points at `tedebug.features.base`, this
module is deleted.  New homes:

- feature base classes and run-time helpers: `tedebug.features.base` (`cached_schedule` is now `schedule_of`);
- config checks of feature blocks: `tedebug.features.config_checks`;
- per-session memoisation: `tedebug.memo` (`memoized`, `exact_key`; `config_memoized` is gone: `memoized` keyed by
  the config's values does its work);
- the LogFp8TensorStats statistic names: `tedebug.features.fp8_stat_names`;
- recipe names: `tedebug.recipe.RecipeName` (`DELAYED` is `RecipeName.DELAYED`, ...);
- `sanitize_name`: `tedebug.features.dump_tensors`.
"""

from __future__ import annotations

from tedebug.active import session
from tedebug.features.base import (
    ScheduledInspectFeature,
    ValidatedFeature,
    log_once,
    reduction_args,
    schedule_of,
    schedule_options,
    scheduled_now,
    stat_list,
    storage_for,
)
from tedebug.features.config_checks import (
    FeatureConfigError,
    check_known_keys,
    effective_configs,
    require_param,
    require_stats_list,
)
from tedebug.features.fp8_stat_names import (
    COLUMNWISE_SUFFIX,
    FP8_STATS,
    STATS_NEEDING_TENSOR,
    Fp8StatName,
    check_columnwise_recipe,
    parse_fp8_stat,
    supported_fp8_stat_names,
)
from tedebug.memo import exact_key, memoized
from tedebug.recipe import FP8_RECIPE_NAMES as FP8_RECIPES
from tedebug.recipe import PER_TENSOR_RECIPE_NAMES as PER_TENSOR_RECIPES
from tedebug.recipe import RecipeName

cached_schedule = schedule_of
DELAYED = RecipeName.DELAYED
CURRENT = RecipeName.CURRENT
MXFP8 = RecipeName.MXFP8
BLOCK = RecipeName.BLOCK
NVFP4 = RecipeName.NVFP4

__all__ = [
    "session", "ScheduledInspectFeature", "ValidatedFeature", "log_once", "reduction_args", "schedule_of",
    "schedule_options", "scheduled_now", "stat_list", "storage_for", "FeatureConfigError", "check_known_keys",
    "effective_configs", "require_param", "require_stats_list", "COLUMNWISE_SUFFIX", "FP8_STATS",
    "STATS_NEEDING_TENSOR", "Fp8StatName", "check_columnwise_recipe", "parse_fp8_stat", "supported_fp8_stat_names",
    "exact_key", "memoized", "FP8_RECIPES", "PER_TENSOR_RECIPES", "RecipeName", "cached_schedule", "DELAYED",
    "CURRENT", "MXFP8", "BLOCK", "NVFP4",
]
