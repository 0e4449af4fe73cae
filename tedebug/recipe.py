"""Training recipes: which quantizer each tensor role of a layer gets.

A recipe is a small frozen dataclass.  `make_quantizer(role)` returns a *new* quantizer (with its own state) for one
of `ROLES`; the GEMM outputs (`output`, `grad_input`, `grad_weight`) get None, as TransformerEngine does not quantize
GEMM outputs by default.  Forward roles (`input`, `weight`) use the forward FP8 format, `grad_output` the backward
one: under `Format.HYBRID` that is E4M3 forward and E5M2 backward.  `name` is the statistic prefix of the recipe
(`fp8_delayed_scaling`, `fp8_current_scaling`, `mxfp8`, `nvfp4`, `fp8_block_scaling`, `custom`): a member of
`RecipeName`, the one list of recipe names.
Defaults follow TransformerEngine's recipes (margin 0, HYBRID format, amax history 1024 with "max", no epsilon).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable, Optional

from .quantization.tensor import Quantizer

ROLES = ("input", "weight", "output", "grad_output", "grad_input", "grad_weight")
FORWARD_ROLES = ("input", "weight")
BACKWARD_ROLES = ("grad_output",)
GEMM_OUTPUT_ROLES = ("output", "grad_input", "grad_weight")

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class RecipeName(str, enum.Enum):
    """The name of a recipe: the prefix of its what-if statistics (``mxfp8_mse``) and a quantizer's `recipe_name`.

    A member *is* its string value: it compares, hashes, prints and formats exactly like the plain string, so code
    holding ``"mxfp8"`` (a quantizer's `recipe_name`, a parsed statistic name) and code holding `RecipeName.MXFP8`
    agree, and log lines do not change.
    """

    DELAYED = "fp8_delayed_scaling"
    CURRENT = "fp8_current_scaling"
    MXFP8 = "mxfp8"
    BLOCK = "fp8_block_scaling"
    NVFP4 = "nvfp4"
    CUSTOM = "custom"

    __str__ = str.__str__
    __repr__ = str.__repr__
    __format__ = str.__format__
    __hash__ = str.__hash__


#: the FP8 recipes (the recipe prefixes of LogFp8TensorStats statistics), in this order
FP8_RECIPE_NAMES = (RecipeName.DELAYED, RecipeName.CURRENT, RecipeName.MXFP8, RecipeName.BLOCK)
#: the recipes with one scale per tensor: their columnwise data is the transpose of the rowwise data
PER_TENSOR_RECIPE_NAMES = (RecipeName.DELAYED, RecipeName.CURRENT)


class Format(str, enum.Enum):
    """FP8 format choice of a recipe (compares equal to its string value)."""

    E4M3 = "E4M3"  # E4M3 in forward and backward
    E5M2 = "E5M2"  # pure E5M2: rejected by every recipe (as in TransformerEngine)
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 backward

    def for_role(self, role: str) -> str:
        """The element format ("E4M3"/"E5M2") used for a forward or backward role."""
        if self is Format.HYBRID:
            return "E5M2" if role in BACKWARD_ROLES else "E4M3"
        return self.value


E4M3 = Format.E4M3
E5M2 = Format.E5M2
HYBRID = Format.HYBRID


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown tensor role {role!r}; expected one of {ROLES}")
    return role


def _fp8_format(recipe: str, value) -> Format:
    """Normalise a recipe's fp8_format (a Format or its name) and reject pure E5M2."""
    try:
        fmt = Format(value.value if isinstance(value, enum.Enum) else str(value).upper())
    except ValueError:
        raise ValueError(f"{recipe}: fp8_format must be 'E4M3' or 'HYBRID', got {value!r}") from None
    if fmt is Format.E5M2:
        raise ValueError(
            f"{recipe}: fp8_format E5M2 is not supported (pure E5M2 training); use 'HYBRID' "
            f"(E4M3 forward, E5M2 backward) or 'E4M3'"
        )
    return fmt


def _non_negative(recipe: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{recipe}: {name} must be a finite number >= 0, got {value!r}")


class Recipe:
    """Base of the recipes: `name` and `make_quantizer(role)`; TE-style type queries."""

    name: str = ""  # a `RecipeName` in every recipe class

    def make_quantizer(self, role: str) -> Optional[Quantizer]:
        _check_role(role)
        if role in GEMM_OUTPUT_ROLES:
            return None
        return self._make(role)

    def _make(self, role: str) -> Quantizer:
        raise NotImplementedError(f"{type(self).__name__} does not define quantizers")

    # TransformerEngine-compatible queries
    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 whose scale comes from the amax history (fp8_max / 2^margin / amax, with the
    amax taken from the history as `amax_compute_algo` says).

    `reduce_amax` (default True, as in TransformerEngine): when torch.distributed runs several ranks, each amax is
    MAX-reduced over the default process group before the history rolls, so all data-parallel ranks use the same
    scales (`tedebug.nn.state`).  The state (scales, histories) is saved in the layers' ``state_dict``."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    name = RecipeName.DELAYED

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _fp8_format("DelayedScaling", self.fp8_format))
        _non_negative("DelayedScaling", "margin", self.margin)
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise ValueError(f"DelayedScaling: amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"DelayedScaling: reduce_amax must be a bool, got {self.reduce_amax!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaling: amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, got {self.amax_compute_algo!r}"
            )

    def _make(self, role: str) -> Quantizer:
        from .quantization.float8 import Float8Quantizer

        return Float8Quantizer.from_recipe_defaults(
            self.fp8_format.for_role(role),
            history_len=self.amax_history_len,
            margin=self.margin,
            amax_compute_algo=self.amax_compute_algo,
        )


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 whose scale comes from the amax of the tensor being quantized (fp8_max / amax)."""

    fp8_format: Format = Format.HYBRID
    amax_epsilon: float = 0.0
    force_pow_2_scales: bool = False

    name = RecipeName.CURRENT

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _fp8_format("Float8CurrentScaling", self.fp8_format))
        _non_negative("Float8CurrentScaling", "amax_epsilon", self.amax_epsilon)

    def _make(self, role: str) -> Quantizer:
        from .quantization.float8 import Float8CurrentScalingQuantizer

        return Float8CurrentScalingQuantizer(
            self.fp8_format.for_role(role),
            amax_epsilon=float(self.amax_epsilon),
            force_pow_2_scales=bool(self.force_pow_2_scales),
        )


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: blocks of 1x32 elements along the quantized dimension, each with a power-of-two (E8M0) scale."""

    fp8_format: Format = Format.E4M3

    name = RecipeName.MXFP8

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _fp8_format("MXFP8BlockScaling", self.fp8_format))

    def _make(self, role: str) -> Quantizer:
        from .quantization.mxfp8 import MXFP8Quantizer

        return MXFP8Quantizer(self.fp8_format.for_role(role))


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-style FP8 blocks with fp32 scales: inputs and gradients 1x128, weights 128x128."""

    fp8_format: Format = Format.E4M3

    name = RecipeName.BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _fp8_format("Float8BlockScaling", self.fp8_format))

    def _make(self, role: str) -> Quantizer:
        from .quantization.float8_block import Float8BlockQuantizer

        return Float8BlockQuantizer(self.fp8_format.for_role(role), block_scaling_dim=2 if role == "weight" else 1)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4 (FP4 E2M1 elements, an E4M3 scale per 16 elements, an fp32 scale per tensor): inputs 1D with RHT on
    the columnwise operand; weights 16x16 2D; grad_output 1D with RHT (columnwise) and stochastic rounding.  The
    `disable_*` switches turn those off."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    seed: Optional[int] = None

    name = RecipeName.NVFP4

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"NVFP4BlockScaling: seed must be an int or None, got {self.seed!r}")

    def _make(self, role: str) -> Quantizer:
        from .quantization.nvfp4 import NVFP4Quantizer

        if role == "weight":
            return NVFP4Quantizer(with_2d_quantization=not self.disable_2d_quantization)
        if role == "input":
            return NVFP4Quantizer(with_rht=not self.disable_rht)
        return NVFP4Quantizer(
            with_rht=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
            seed=self.seed,
        )


@dataclasses.dataclass(frozen=True)
class CustomRecipe(Recipe):
    """`factory(role) -> Optional[Quantizer]` decides every role, GEMM outputs included.

    The factory must return a new quantizer on every call (quantizers carry per-tensor state).
    """

    factory: Callable[[str], Optional[Quantizer]]

    name = RecipeName.CUSTOM

    def __post_init__(self) -> None:
        if not callable(self.factory):
            raise TypeError(
                f"CustomRecipe: factory must be callable (role -> Quantizer or None), got {type(self.factory).__name__}"
            )

    def make_quantizer(self, role: str) -> Optional[Quantizer]:
        quantizer = self.factory(_check_role(role))
        if quantizer is not None and not isinstance(quantizer, Quantizer):
            raise TypeError(
                f"CustomRecipe: factory({role!r}) returned {type(quantizer).__name__}; expected a Quantizer or None"
            )
        return quantizer


def get_default_recipe() -> DelayedScaling:
    """The recipe used when none is given: `DelayedScaling()` (HYBRID, history 1024, "max")."""
    return DelayedScaling()


__all__ = [
    "ROLES",
    "FORWARD_ROLES",
    "BACKWARD_ROLES",
    "GEMM_OUTPUT_ROLES",
    "RecipeName",
    "FP8_RECIPE_NAMES",
    "PER_TENSOR_RECIPE_NAMES",
    "Format",
    "E4M3",
    "E5M2",
    "HYBRID",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "get_default_recipe",
]
