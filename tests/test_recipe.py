"""Recipes: role -> quantizer mapping, formats per role, fresh state per call, validation (CPU)."""

import dataclasses

import pytest
import torch

from tedebug import recipe as R
from tedebug.quantization import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

OUTPUT_ROLES = ("output", "grad_input", "grad_weight")


def test_roles_constant():
    assert R.ROLES == ("input", "weight", "output", "grad_output", "grad_input", "grad_weight")
    assert set(R.FORWARD_ROLES) | set(R.BACKWARD_ROLES) | set(R.GEMM_OUTPUT_ROLES) == set(R.ROLES)


@pytest.mark.parametrize(
    "recipe,name",
    [
        (R.DelayedScaling(), "fp8_delayed_scaling"),
        (R.Float8CurrentScaling(), "fp8_current_scaling"),
        (R.MXFP8BlockScaling(), "mxfp8"),
        (R.NVFP4BlockScaling(), "nvfp4"),
        (R.Float8BlockScaling(), "fp8_block_scaling"),
        (R.CustomRecipe(lambda role: None), "custom"),
    ],
)
def test_recipe_names(recipe, name):
    assert recipe.name == name


ALL_RECIPES = [
    R.DelayedScaling(),
    R.DelayedScaling(fp8_format="E4M3"),
    R.Float8CurrentScaling(),
    R.Float8CurrentScaling(fp8_format=R.E4M3),
    R.MXFP8BlockScaling(),
    R.MXFP8BlockScaling(fp8_format=R.HYBRID),
    R.NVFP4BlockScaling(),
    R.Float8BlockScaling(),
    R.Float8BlockScaling(fp8_format="HYBRID"),
]


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=repr)
def test_gemm_outputs_are_not_quantized(recipe):
    for role in OUTPUT_ROLES:
        assert recipe.make_quantizer(role) is None


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=repr)
def test_unknown_role_is_rejected(recipe):
    with pytest.raises(ValueError, match="unknown tensor role 'activation'.*'grad_output'"):
        recipe.make_quantizer("activation")


# (recipe, class, {role: fp8 format})
FP8_CASES = [
    (R.DelayedScaling(), Float8Quantizer, {"input": "E4M3", "weight": "E4M3", "grad_output": "E5M2"}),
    (R.DelayedScaling(fp8_format="E4M3"), Float8Quantizer, {"input": "E4M3", "weight": "E4M3", "grad_output": "E4M3"}),
    (
        R.Float8CurrentScaling(),
        Float8CurrentScalingQuantizer,
        {"input": "E4M3", "weight": "E4M3", "grad_output": "E5M2"},
    ),
    (
        R.Float8CurrentScaling(fp8_format="E4M3"),
        Float8CurrentScalingQuantizer,
        {"input": "E4M3", "weight": "E4M3", "grad_output": "E4M3"},
    ),
    (R.MXFP8BlockScaling(), MXFP8Quantizer, {"input": "E4M3", "weight": "E4M3", "grad_output": "E4M3"}),
    (
        R.MXFP8BlockScaling(fp8_format="HYBRID"),
        MXFP8Quantizer,
        {"input": "E4M3", "weight": "E4M3", "grad_output": "E5M2"},
    ),
    (R.Float8BlockScaling(), Float8BlockQuantizer, {"input": "E4M3", "weight": "E4M3", "grad_output": "E4M3"}),
    (
        R.Float8BlockScaling(fp8_format="HYBRID"),
        Float8BlockQuantizer,
        {"input": "E4M3", "weight": "E4M3", "grad_output": "E5M2"},
    ),
]


@pytest.mark.parametrize("recipe,cls,formats", FP8_CASES, ids=lambda v: repr(v) if dataclasses.is_dataclass(v) else "")
def test_fp8_role_formats(recipe, cls, formats):
    for role, fmt in formats.items():
        q = recipe.make_quantizer(role)
        assert type(q) is cls, role
        assert q.fp8_format == fmt, role
        assert q.rowwise_usage and q.columnwise_usage
        assert q.recipe_name == recipe.name
        assert q.quantize(torch.ones(32, 128)).fp8_format == fmt  # the format reaches the quantized data


def test_delayed_scaling_parameters_reach_the_quantizer():
    r = R.DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent")
    q = r.make_quantizer("weight")
    assert q.margin == 2 and q.amax_compute_algo == "most_recent"
    assert q.amax_history.numel() == 16 and torch.all(q.amax_history == 0)
    assert float(q.scale) == 1.0
    # margin 2, most_recent: after one quantize with amax 3.5, scale = 448 / 4 / 3.5 = 32
    q.quantize(torch.tensor([[3.5, -1.0]]))
    q.update_scale()
    assert float(q.scale) == 32.0


def test_current_scaling_parameters_reach_the_quantizer():
    q = R.Float8CurrentScaling(amax_epsilon=0.5, force_pow_2_scales=True).make_quantizer("input")
    assert q.amax_epsilon == 0.5 and q.force_pow_2_scales
    # amax 0.1 < epsilon 0.5 -> scale 448 / 0.5 = 896 -> pow2 512 -> scale_inv 2^-9
    out = q.quantize(torch.tensor([[0.1, 0.0]]))
    assert float(out.scale_inv) == 2.0**-9


def test_fp8_block_scaling_dims_per_role():
    r = R.Float8BlockScaling()
    assert r.make_quantizer("input").block_scaling_dim == 1
    assert r.make_quantizer("weight").block_scaling_dim == 2
    assert r.make_quantizer("grad_output").block_scaling_dim == 1


def test_nvfp4_defaults_per_role():
    r = R.NVFP4BlockScaling()
    inp, w, g = (r.make_quantizer(role) for role in ("input", "weight", "grad_output"))
    for q in (inp, w, g):
        assert type(q) is NVFP4Quantizer
    assert (inp.with_rht, inp.stochastic_rounding, inp.with_2d_quantization) == (True, False, False)
    assert (w.with_rht, w.stochastic_rounding, w.with_2d_quantization) == (False, False, True)
    assert (g.with_rht, g.stochastic_rounding, g.with_2d_quantization) == (True, True, False)


def test_nvfp4_disable_switches():
    r = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True, seed=7)
    for role in ("input", "weight", "grad_output"):
        q = r.make_quantizer(role)
        assert (q.with_rht, q.stochastic_rounding, q.with_2d_quantization) == (False, False, False), role


def test_nvfp4_seed_reaches_grad_output_quantizer():
    r = R.NVFP4BlockScaling(seed=1234)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(torch.bfloat16)
    a, b = r.make_quantizer("grad_output"), r.make_quantizer("grad_output")
    assert a.seed == 1234 and a is not b
    qa, qb = a.quantize(x), b.quantize(x)
    assert torch.equal(qa.rowwise_data, qb.rowwise_data)  # same seed, own generator each: same stream


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=repr)
def test_every_call_returns_a_fresh_quantizer(recipe):
    for role in ("input", "weight", "grad_output"):
        a, b = recipe.make_quantizer(role), recipe.make_quantizer(role)
        assert a is not b
        a.set_usage(rowwise=False)
        assert b.rowwise_usage


def test_delayed_scaling_state_is_not_shared():
    r = R.DelayedScaling(amax_history_len=4)
    a, b = r.make_quantizer("input"), r.make_quantizer("input")
    assert a.amax_history.data_ptr() != b.amax_history.data_ptr()
    assert a.scale.data_ptr() != b.scale.data_ptr()
    a.quantize(torch.tensor([[2.0, -7.0]]))
    a.update_scale()
    assert float(a.scale) == 64.0  # 448 / 7
    assert float(b.scale) == 1.0 and torch.all(b.amax_history == 0)


@pytest.mark.parametrize("cls", [R.DelayedScaling, R.Float8CurrentScaling, R.MXFP8BlockScaling, R.Float8BlockScaling])
def test_pure_e5m2_is_rejected(cls):
    with pytest.raises(ValueError, match=f"{cls.__name__}: fp8_format E5M2 is not supported"):
        cls(fp8_format="E5M2")
    with pytest.raises(ValueError, match=f"{cls.__name__}: fp8_format E5M2 is not supported"):
        cls(fp8_format=R.Format.E5M2)
    with pytest.raises(ValueError, match="fp8_format must be 'E4M3' or 'HYBRID', got 'E3M4'"):
        cls(fp8_format="E3M4")


def test_format_enum_and_defaults():
    assert R.Format.HYBRID == "HYBRID" and R.HYBRID is R.Format.HYBRID and R.E4M3 is R.Format.E4M3
    assert R.DelayedScaling().fp8_format is R.Format.HYBRID
    assert R.Float8CurrentScaling().fp8_format is R.Format.HYBRID
    assert R.MXFP8BlockScaling().fp8_format is R.Format.E4M3
    assert R.Float8BlockScaling().fp8_format is R.Format.E4M3
    assert R.DelayedScaling(fp8_format="hybrid").fp8_format is R.Format.HYBRID
    d = R.DelayedScaling()
    assert (d.margin, d.amax_history_len, d.amax_compute_algo) == (0, 1024, "max")
    assert R.get_default_recipe() == R.DelayedScaling()
    assert R.get_default_recipe() is not R.get_default_recipe()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: R.DelayedScaling(margin=-1), "margin must be a finite number >= 0"),
        (lambda: R.DelayedScaling(amax_history_len=0), "amax_history_len must be an int >= 1"),
        (lambda: R.DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo must be one of"),
        (lambda: R.Float8CurrentScaling(amax_epsilon=float("nan")), "amax_epsilon must be a finite number >= 0"),
        (lambda: R.NVFP4BlockScaling(seed="abc"), "seed must be an int or None"),
    ],
)
def test_invalid_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        R.DelayedScaling().margin = 3


def test_type_queries():
    assert R.DelayedScaling().delayed() and not R.DelayedScaling().mxfp8()
    assert R.MXFP8BlockScaling().mxfp8() and R.NVFP4BlockScaling().nvfp4()
    assert R.Float8CurrentScaling().float8_current_scaling() and R.Float8BlockScaling().float8_block_scaling()
    assert R.CustomRecipe(lambda role: None).custom()


# ------------------------------------------------------------------------------------------------ CustomRecipe
def test_custom_recipe_calls_the_factory_for_every_role():
    seen = []

    def factory(role):
        seen.append(role)
        if role == "weight":
            return HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer())
        if role == "output":
            return IdentityQuantizer()
        return None

    r = R.CustomRecipe(factory)
    results = {role: r.make_quantizer(role) for role in R.ROLES}
    assert seen == list(R.ROLES)
    assert isinstance(results["weight"], HybridQuantizer)
    assert isinstance(results["output"], IdentityQuantizer)  # a factory may quantize GEMM outputs
    assert results["input"] is None and results["grad_output"] is None


def test_custom_recipe_validation():
    with pytest.raises(TypeError, match="factory must be callable"):
        R.CustomRecipe("mxfp8")
    r = R.CustomRecipe(lambda role: "fp8")
    with pytest.raises(TypeError, match=r"factory\('input'\) returned str; expected a Quantizer or None"):
        r.make_quantizer("input")
    with pytest.raises(ValueError, match="unknown tensor role"):
        r.make_quantizer("bias")


def test_recipe_names_are_one_str_enum_that_behaves_like_its_strings():
    """`RecipeName` members equal, hash, print and format as their values, so mixed str / enum code agrees."""
    values = ["fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_block_scaling", "nvfp4", "custom"]
    assert [member.value for member in R.RecipeName] == values
    for member, value in zip(R.RecipeName, values):
        assert member == value and hash(member) == hash(value) and {value: 1}[member] == 1
        assert str(member) == f"{member}" == "%s" % member == value and repr(member) == repr(value)
        assert R.RecipeName(value) is member
    recipes = (
        R.DelayedScaling(),
        R.Float8CurrentScaling(),
        R.MXFP8BlockScaling(),
        R.Float8BlockScaling(),
        R.NVFP4BlockScaling(),
        R.CustomRecipe(lambda role: None),
    )
    assert [recipe.name for recipe in recipes] == list(R.RecipeName)
    assert all(isinstance(recipe.name, R.RecipeName) for recipe in recipes)
    assert R.FP8_RECIPE_NAMES == ("fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_block_scaling")
    assert R.PER_TENSOR_RECIPE_NAMES == ("fp8_delayed_scaling", "fp8_current_scaling")


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=repr)
def test_quantizers_carry_their_recipes_name(recipe):
    for role in ("input", "weight", "grad_output"):
        assert recipe.make_quantizer(role).recipe_name == recipe.name
