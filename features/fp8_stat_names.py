"""The statistic names LogFp8TensorStats accepts: ``[<recipe>_]<stat>[_columnwise]``.

- ``<recipe>`` (optional): an FP8 recipe name (`tedebug.recipe.FP8_RECIPE_NAMES`: fp8_delayed_scaling,
  fp8_current_scaling, mxfp8, fp8_block_scaling).  Without it the statistic is about the recipe the tensor is
  trained with; with it, a "what-if": the tensor quantized by that recipe.
- ``<stat>``: underflows%, scale_inv_min, scale_inv_max, scale_inv_std, mse, and overflows% (delayed scaling
  only: bare under delayed scaling, or fp8_delayed_scaling_overflows%).
- ``_columnwise`` (optional): read the columnwise operand instead of the rowwise one.  Not for the per-tensor
  recipes (their columnwise data is the transpose of the rowwise data) and not for overflows%.
- ``nvfp4_...`` is rejected with a pointer to LogNvfp4TensorStats.

The name is logged as written in the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from tedebug.recipe import FP8_RECIPE_NAMES, PER_TENSOR_RECIPE_NAMES, RecipeName

FP8_STATS = ("underflows%", "scale_inv_min", "scale_inv_max", "scale_inv_std", "mse", "overflows%")
COLUMNWISE_SUFFIX = "_columnwise"
#: statistics computed from the high-precision tensor as well as the quantized one
STATS_NEEDING_TENSOR = ("underflows%", "overflows%", "mse")

_RECIPE_VALUES = [recipe.value for recipe in FP8_RECIPE_NAMES]


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


def supported_fp8_stat_names() -> List[str]:
    """Every spelling the grammar accepts (for error messages)."""
    names = []
    for recipe in (None,) + FP8_RECIPE_NAMES:
        for stat in FP8_STATS:
            if stat == "overflows%" and recipe not in (None, RecipeName.DELAYED):
                continue
            for columnwise in (False, True):
                if columnwise and (recipe in PER_TENSOR_RECIPE_NAMES or stat == "overflows%"):
                    continue
                prefix = "" if recipe is None else recipe.value + "_"
                names.append(prefix + stat + (COLUMNWISE_SUFFIX if columnwise else ""))
    return names


def parse_fp8_stat(name: Any) -> Fp8StatName:
    """Parse one statistic name (see the module docstring); ValueError listing the supported names when invalid."""
    if not isinstance(name, str):
        raise ValueError(f"LogFp8TensorStats: a statistic must be a string, got {name!r}")
    body, columnwise = name, False
    if body.endswith(COLUMNWISE_SUFFIX):
        body, columnwise = body[: -len(COLUMNWISE_SUFFIX)], True
    recipe = None
    for candidate in FP8_RECIPE_NAMES + (RecipeName.NVFP4,):
        if body.startswith(candidate.value + "_"):
            recipe, body = candidate.value, body[len(candidate.value) + 1 :]
            break
    delayed = RecipeName.DELAYED.value
    if recipe == RecipeName.NVFP4:
        raise ValueError(
            f"LogFp8TensorStats: statistic {name!r} uses the nvfp4 recipe; NVFP4 statistics are logged "
            f"by the LogNvfp4TensorStats feature (stats: [underflows%, mse])"
        )
    if body not in FP8_STATS:
        raise ValueError(
            f"LogFp8TensorStats: statistic {name!r} is not supported. Grammar: [<recipe>_]<stat>"
            f"[_columnwise] with recipe in {_RECIPE_VALUES} and stat in {list(FP8_STATS)}; "
            f"supported: {supported_fp8_stat_names()}"
        )
    if body == "overflows%" and recipe not in (None, delayed):
        raise ValueError(
            f"LogFp8TensorStats: statistic {name!r}: overflows% exists only for the "
            f"{delayed} recipe (bare overflows% under delayed scaling, or {delayed}_overflows%)"
        )
    if columnwise and body == "overflows%":
        raise ValueError(
            f"LogFp8TensorStats: statistic {name!r} is not supported: overflows% (delayed scaling, "
            f"per tensor) has no '_columnwise' form; supported: {supported_fp8_stat_names()}"
        )
    if columnwise:
        check_columnwise_recipe(name, recipe)
    return Fp8StatName(name, recipe, body, columnwise)


def check_columnwise_recipe(name: str, recipe: Optional[str]) -> None:
    """ValueError for a ``_columnwise`` statistic of a per-tensor recipe."""
    if recipe in PER_TENSOR_RECIPE_NAMES:
        raise ValueError(
            f"LogFp8TensorStats: statistic {name!r}: '_columnwise' is not supported for the {recipe} "
            f"recipe (per-tensor scaling: the columnwise data is the transpose of the rowwise data; use "
            f"the statistic without '_columnwise')"
        )
