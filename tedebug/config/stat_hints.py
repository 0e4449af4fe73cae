"""Hints for a rejected `stats` entry: the closest statistic the feature accepts, or the feature it belongs to.

`stat_hint(entry, namespace, feature, validators)` asks the features' own validators (never a copy of their
vocabulary): a candidate statistic is "accepted by F" when F's validator passes a minimal block
``{enabled: True, tensors: [activation], stats: [candidate]}``.  Candidates are every statistic kind of
`tedebug.stats.definitions` in its plain, recipe-prefixed (``mxfp8_mse``) and ``_columnwise`` forms; the answers
are cached per (validator, name) in the `cache` dict the caller passes (one per config load).  Runs only on the
error path.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Tuple

from .errors import closest

_RECIPE_PREFIXES = ("fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_block_scaling", "nvfp4")
_COLUMNWISE = "_columnwise"


def candidate_stats() -> Tuple[str, ...]:
    """Every statistic name a built-in feature could accept (a superset; each feature's validator decides)."""
    from tedebug.stats.definitions import KINDS, QUANTIZED_KINDS

    names = list(KINDS)
    for kind in QUANTIZED_KINDS:
        names.append(kind + _COLUMNWISE)
        for prefix in _RECIPE_PREFIXES:
            names += [f"{prefix}_{kind}", f"{prefix}_{kind}{_COLUMNWISE}"]
    return tuple(names)


def accepts(validator: Callable[[dict], None], stat: str, cache: Dict[tuple, bool]) -> bool:
    """True when `validator` accepts a minimal block logging `stat` (answers kept in `cache`)."""
    key = (validator, stat)
    answer = cache.get(key)
    if answer is None:
        try:
            validator({"enabled": True, "tensors": ["activation"], "stats": [stat]})
            answer = True
        except Exception:  # noqa: BLE001 - any failure means "not accepted"
            answer = False
        cache[key] = answer
    return answer


def stat_hint(
    entry: str,
    namespace: str,
    feature: str,
    validators: Mapping[tuple, Callable[[dict], None]],
    cache: Dict[tuple, bool],
) -> Tuple[Optional[str], Optional[str]]:
    """`(suggestion, note)`: the closest statistic `feature` accepts, or else a note naming the other features of
    `namespace` that accept `entry` as it is (``"'underflows%' belongs to LogFp8TensorStats"``)."""
    own = validators.get((namespace, feature))
    if own is not None:
        suggestion = closest(entry, [name for name in candidate_stats() if accepts(own, name, cache)])
        if suggestion is not None and suggestion != entry:
            return suggestion, None
    owners = sorted(
        name
        for (ns, name), validator in validators.items()
        if ns == namespace and name != feature and accepts(validator, entry, cache)
    )
    if owners:
        return None, f"'{entry}' belongs to " + " or ".join(owners)
    return None, None
