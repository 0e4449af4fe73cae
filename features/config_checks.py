"""Checking a feature block of the config at load time, before training starts.

A feature block has up to three levels: the feature level, `gemms_struct` entries and `tensors_struct` entries
(inside the feature level or inside a GEMM entry).  The checks here look at every key of every level and at every
*effective* config: the feature-level parameters overridden by one GEMM entry and then one tensor entry, which is
what a hook receives for that GEMM and tensor.  Errors are `FeatureConfigError`s carrying the key path inside the
block; the config loader adds the file, line, section and feature name (`tedebug.config.loader`).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence, Tuple

from tedebug.config.errors import closest
from tedebug.config.schedule import Schedule

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


def entries(cfg: dict, key: str) -> list:
    """The dict entries of list `key` of a level (anything else is ignored here: the schema rejects it)."""
    value = cfg.get(key)
    if not isinstance(value, list):
        return []
    return [e for e in value if isinstance(e, dict)]


def levels(cfg: dict, uses_gemms: bool, uses_tensors: bool) -> Iterator[Tuple[tuple, dict, Tuple[str, ...]]]:
    """Every level of a feature block: (key path, the dict, the selection keys allowed there)."""
    top = FEATURE_LEVEL_KEYS + (GEMM_LIST_KEYS if uses_gemms else ()) + (TENSOR_LIST_KEYS if uses_tensors else ())
    yield (), cfg, top
    entry_tensor_keys = TENSOR_LIST_KEYS if uses_tensors else ()
    if uses_gemms:
        for i, entry in enumerate(entries(cfg, "gemms_struct")):
            path = ("gemms_struct", i)
            yield path, entry, ("gemm",) + entry_tensor_keys
            if uses_tensors:
                for j, tensor_entry in enumerate(entries(entry, "tensors_struct")):
                    yield path + ("tensors_struct", j), tensor_entry, ("tensor",)
    if uses_tensors:
        for j, tensor_entry in enumerate(entries(cfg, "tensors_struct")):
            yield ("tensors_struct", j), tensor_entry, ("tensor",)


def _without(cfg: dict, keys) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


def effective_configs(cfg: dict, uses_gemms: bool, uses_tensors: bool) -> Iterator[Tuple[tuple, dict]]:
    """(key path of the innermost entry, merged parameters) for every GEMM / tensor entry combination.

    Entry keys override the keys of the level around them, as the hooks' config parsing merges them; the selection
    keys are dropped, except the tensor name of a tensor entry (``tensor``).
    """
    top = _without(cfg, STRUCTURAL_KEYS)
    gemm_levels = [((), cfg, top)]
    if uses_gemms and isinstance(cfg.get("gemms_struct"), list):
        gemm_levels = [
            (("gemms_struct", i), e, {**top, **_without(e, STRUCTURAL_KEYS)})
            for i, e in enumerate(entries(cfg, "gemms_struct"))
        ]
    for path, level, merged in gemm_levels:
        if uses_tensors and isinstance(level.get("tensors_struct"), list):
            for j, entry in enumerate(entries(level, "tensors_struct")):
                yield (
                    path + ("tensors_struct", j),
                    {**merged, **_without(entry, STRUCTURAL_KEYS), "tensor": entry.get("tensor")},
                )
        else:
            yield path, merged


def check_known_keys(feature: str, level: dict, allowed: Sequence[str], path: tuple = ()) -> None:
    """`FeatureConfigError` for the first key of `level` not in `allowed`, naming the closest valid key."""
    for key in level:
        if key in allowed:
            continue
        hint = closest(key, allowed)
        hint_text = f"; did you mean {hint!r}?" if hint else ""
        raise FeatureConfigError(
            f"{feature}: unknown key {key!r}{hint_text} (valid keys here: {', '.join(allowed)})", path + (key,)
        )


def check_selection(feature: str, cfg: dict, uses_gemms: bool, uses_tensors: bool) -> None:
    """The GEMM / tensor selection the hooks will parse must exist: ``gemms`` or ``gemms_struct`` when the feature
    takes GEMMs; ``tensors`` or ``tensors_struct`` when it takes tensors - inside every ``gemms_struct`` entry, since
    the tensors of a GEMM entry are read from that entry."""

    def has_tensors(level: dict) -> bool:
        return "tensors" in level or "tensors_struct" in level

    tensors_hint = "provide 'tensors: [...]' or 'tensors_struct: [...]' (the tensors it applies to)"
    if uses_gemms:
        if "gemms_struct" in cfg:
            if uses_tensors:
                for i, entry in enumerate(entries(cfg, "gemms_struct")):
                    if not has_tensors(entry):
                        raise FeatureConfigError(
                            f"{feature}: the gemms_struct entry of gemm {entry.get('gemm')!r} lists no tensors; "
                            f"{tensors_hint} inside the entry",
                            ("gemms_struct", i),
                        )
            return
        if "gemms" not in cfg:
            raise FeatureConfigError(
                f"{feature}: provide 'gemms: [...]' or 'gemms_struct: [...]' (the GEMMs it applies to)", ()
            )
    if uses_tensors and not has_tensors(cfg):
        raise FeatureConfigError(f"{feature}: {tensors_hint}", ())


def check_schedule(feature: str, params: dict, path: tuple) -> None:
    """`FeatureConfigError` when the schedule keys (freq, start_step, end_step, start_end_list) are invalid."""
    try:
        Schedule.from_config(params)
    except ValueError as err:
        raise FeatureConfigError(f"{feature}: {err}", path) from err


def require_param(feature: str, params: dict, key: str, path: tuple, expected: str) -> Any:
    """The value of a required parameter; `FeatureConfigError` naming it when it is missing."""
    if key not in params or params[key] is None:
        where = "" if not params.get("tensor") else f" (tensor {params['tensor']!r})"
        raise FeatureConfigError(
            f"{feature}: missing required parameter {key!r}{where}; expected {expected}", path + (key,)
        )
    return params[key]


def require_stats_list(feature: str, params: dict, path: tuple) -> list:
    """The non-empty ``stats`` list of an effective config; `FeatureConfigError` otherwise."""
    stats = require_param(feature, params, "stats", path, "a list of statistic names")
    if not isinstance(stats, list) or not stats:
        raise FeatureConfigError(
            f"{feature}: 'stats' must be a non-empty list of statistic names, got {stats!r}", path + ("stats",)
        )
    return stats
