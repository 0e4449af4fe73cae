"""The contract every quantizer / quantized tensor honours (docs/internals.md, "Quantization core"), checked over all of
them (CPU).

Each case is a factory, so a reference run can use a quantizer with the same (fresh) state as the one under test:
delayed scaling and seeded stochastic rounding then give reproducible results without sharing state.
"""

import pytest
import torch

from tedebug.quantization import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizedTensor,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedTensor,
    Quantizer,
)

# name -> (factory, stochastic, allows_empty_rows)
#   stochastic: the result depends on how many random bits were drawn before (seeded SR), so a single-direction
#   run is not comparable with a two-direction run.
#   allows_empty_rows: a `[0, K]` input satisfies the format's shape rules (per-tensor, blocks of 32/16/128 along
#   dims whose extent 0 is divisible by anything).
CASES = {
    "fp8_delayed_e4m3": (lambda: Float8Quantizer.from_recipe_defaults("E4M3", history_len=4), False, True),
    "fp8_delayed_e5m2_margin": (lambda: Float8Quantizer.from_recipe_defaults("E5M2", 8, margin=1), False, True),
    "fp8_current_e4m3": (lambda: Float8CurrentScalingQuantizer("E4M3"), False, True),
    "fp8_current_e5m2_pow2": (lambda: Float8CurrentScalingQuantizer("E5M2", force_pow_2_scales=True), False, True),
    "mxfp8_e4m3": (lambda: MXFP8Quantizer("E4M3"), False, True),
    "mxfp8_e5m2": (lambda: MXFP8Quantizer("E5M2"), False, True),
    "nvfp4_1d": (lambda: NVFP4Quantizer(), False, True),
    "nvfp4_2d": (lambda: NVFP4Quantizer(with_2d_quantization=True), False, True),
    "nvfp4_rht": (lambda: NVFP4Quantizer(with_rht=True), False, True),
    "nvfp4_rht_sr": (lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True, seed=5), True, True),
    "fp8_block_1d": (lambda: Float8BlockQuantizer("E4M3", block_scaling_dim=1), False, True),
    "fp8_block_2d": (lambda: Float8BlockQuantizer("E4M3", block_scaling_dim=2), False, True),
    "fp8_block_2d_e5m2_fp32scales": (
        lambda: Float8BlockQuantizer("E5M2", block_scaling_dim=2, force_pow_2_scales=False),
        False,
        True,
    ),
    "identity": (lambda: IdentityQuantizer(), False, True),
    "hybrid_fp8_mxfp8": (lambda: HybridQuantizer(Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer()), False, True),
    "hybrid_mxfp8_nvfp4_double": (
        lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise_source="rowwise_dequantized"),
        False,
        True,
    ),
    "hybrid_identity_mxfp8e5m2": (lambda: HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer("E5M2")), False, True),
}
NAMES = list(CASES)
DTYPES = [torch.float32, torch.bfloat16]
SHAPE = (2, 32, 128)  # 3-D: the logical shape must survive; 2-D view [64, 128] fits every format


def make(name):
    return CASES[name][0]()


def sample(seed=0, dtype=torch.float32, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    x.view(-1)[::7] = 0.0  # exact zeros so that nonzero counts are not trivially numel
    return x.to(dtype)


def values(qt, usage):
    return qt.dequantize(dtype=torch.float32, usage=usage)


def same_bits(a, b):
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def single(name, usage):
    q = make(name)
    q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    return q


def leaf_fields(qt):
    """(owner, field) pairs of every raw tensor, hybrid sub-storages included."""
    if isinstance(qt, HybridQuantizedTensor):
        return [p for sub in qt._present_subs() for p in leaf_fields(sub)]
    return [(qt, f) for f in qt._tensor_fields()]


# ------------------------------------------------------------------------------------------------ metadata
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_quantize_keeps_shape_dtype_device(name, dtype):
    q = make(name)
    x = sample(dtype=dtype)
    out = q.quantize(x)
    assert isinstance(q, Quantizer) and isinstance(out, QuantizedTensor)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert out.numel() == x.numel() and out.dim() == 3 and out.size(1) == 32
    assert out.has_rowwise and out.has_columnwise
    assert out.quantizer is q
    for usage in ("rowwise", "columnwise"):
        deq = out.dequantize(usage=usage)
        assert deq.shape == x.shape and deq.dtype == dtype and deq.device == x.device
        assert out.dequantize(usage=usage, dtype=torch.float32).dtype == torch.float32
        assert torch.isfinite(deq).all()
    assert same_bits(out.dequantize(), out.dequantize(usage="rowwise"))
    assert isinstance(q.recipe_name, str)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_is_close_to_the_input(name):
    x = sample(seed=1)
    out = make(name).quantize(x)
    for usage in ("rowwise", "columnwise"):
        err = (values(out, usage) - x).abs().max()
        # the coarsest element grid is E2M1 (relative step 1/2 at the top of a block), double quantized at most
        assert err <= 0.5 * x.abs().max(), (usage, float(err))


# ------------------------------------------------------------------------------------------------ usage flags
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", NAMES)
def test_usage_flags_select_directions(name, usage):
    other = "columnwise" if usage == "rowwise" else "rowwise"
    x = sample(seed=2)
    out = single(name, usage).quantize(x)
    assert getattr(out, f"has_{usage}") and not getattr(out, f"has_{other}")
    with pytest.raises(RuntimeError, match=f"{other}"):
        out.dequantize(usage=other)
    assert same_bits(out.dequantize(), out.dequantize(usage=usage))
    if not CASES[name][1]:
        both = make(name).quantize(x)
        assert same_bits(values(out, usage), values(both, usage))


@pytest.mark.parametrize("name", NAMES)
def test_no_usage_is_an_error(name):
    q = make(name)
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="both rowwise and columnwise usage are off"):
        q.quantize(sample())


@pytest.mark.parametrize("name", NAMES)
def test_copy_has_its_own_usage_flags(name):
    q = make(name)
    twin = q.copy()
    assert type(twin) is type(q) and twin is not q
    twin.set_usage(rowwise=False)
    assert q.rowwise_usage and not twin.rowwise_usage


# ------------------------------------------------------------------------------------------------ update_usage
@pytest.mark.parametrize("drop", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", NAMES)
def test_update_usage_drops_a_direction(name, drop):
    keep = "columnwise" if drop == "rowwise" else "rowwise"
    out = make(name).quantize(sample(seed=3))
    kept_before = values(out, keep)
    out.update_usage(**{f"{drop}_usage": False})
    assert not getattr(out, f"has_{drop}") and getattr(out, f"has_{keep}")
    assert same_bits(values(out, keep), kept_before)
    with pytest.raises(RuntimeError):
        out.dequantize(usage=drop)
    with pytest.raises(ValueError):
        out.update_usage(rowwise_usage=False, columnwise_usage=False)


# ------------------------------------------------------------------------------------------------ save / restore
@pytest.mark.parametrize("name", NAMES)
def test_prepare_for_saving_and_restore(name):
    out = make(name).quantize(sample(seed=4, dtype=torch.bfloat16))
    before = {u: values(out, u) for u in ("rowwise", "columnwise")}
    fields = leaf_fields(out)
    tensors, obj = out.prepare_for_saving()
    assert obj is out and len(tensors) == len(fields)
    assert any(t is not None for t in tensors)
    assert all(getattr(owner, f) is None for owner, f in fields)
    extra = torch.ones(2)
    rest = out.restore_from_saved(list(tensors) + [extra])
    assert len(rest) == 1 and rest[0] is extra
    for u, v in before.items():
        assert same_bits(values(out, u), v)


# ------------------------------------------------------------------------------------------------ make_empty / out=
@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("name", NAMES)
def test_make_empty_then_fill_with_out(name, usage):
    q = make(name) if usage == "both" else single(name, usage)
    empty = q.make_empty(SHAPE, dtype=torch.bfloat16, device="cpu")
    assert isinstance(empty, QuantizedTensor)
    assert empty.shape == torch.Size(SHAPE) and empty.dtype == torch.bfloat16 and empty.device == torch.device("cpu")
    assert empty.has_rowwise == (usage in ("both", "rowwise"))
    assert empty.has_columnwise == (usage in ("both", "columnwise"))
    x = sample(seed=5, dtype=torch.bfloat16)
    assert q.quantize(x, out=empty) is empty
    ref_q = make(name) if usage == "both" else single(name, usage)
    ref = ref_q.quantize(x)
    for u in ("rowwise", "columnwise"):
        if getattr(empty, f"has_{u}"):
            assert same_bits(values(empty, u), values(ref, u)), u


@pytest.mark.parametrize("name", NAMES)
def test_out_refreshes_in_place(name):
    q, ref_q = make(name), make(name)
    x, y = sample(seed=6), sample(seed=7)
    dst = q.quantize(x)
    ref_q.quantize(x)  # keep the reference's state (history, random stream) in step
    buffers = [(owner, f, getattr(owner, f)) for owner, f in leaf_fields(dst)]
    assert q.quantize(y, out=dst) is dst
    ref = ref_q.quantize(y)
    for u in ("rowwise", "columnwise"):
        assert same_bits(values(dst, u), values(ref, u)), u
    # buffers of unchanged shape are reused (refreshed in place, not replaced)
    for owner, f, buf in buffers:
        if buf is not None:
            assert getattr(owner, f) is buf, f


@pytest.mark.parametrize("name", NAMES)
def test_out_refresh_keeps_only_the_directions_of_out(name):
    q = make(name)
    dst = q.quantize(sample(seed=8))
    dst.update_usage(columnwise_usage=False)
    q.quantize(sample(seed=9), out=dst)
    assert dst.has_rowwise and not dst.has_columnwise
    assert q.rowwise_usage and q.columnwise_usage  # the quantizer's own flags are untouched


# ------------------------------------------------------------------------------------------------ empty input
@pytest.mark.parametrize("name", NAMES)
def test_empty_input(name):
    if not CASES[name][2]:
        pytest.skip("the format's shape rules exclude an empty input")
    x = torch.empty(0, 128)
    out = make(name).quantize(x)
    assert out.shape == (0, 128) and out.numel() == 0
    for usage in ("rowwise", "columnwise"):
        assert out.dequantize(usage=usage).shape == (0, 128)
        assert int(out.nonzero_code_count(usage)) == 0


# ------------------------------------------------------------------------------------------------ statistics helpers
@pytest.mark.parametrize("name", NAMES)
def test_statistics_helpers(name):
    out = make(name).quantize(sample(seed=10))
    for usage in ("rowwise", "columnwise"):
        count = out.nonzero_code_count(usage)
        assert count.dtype == torch.int64 and count.dim() == 0
        # without a column transform, a code is ±0 exactly where the dequantized value is 0 (all scales > 0 here)
        rht = getattr(_leaf(out, usage), "columnwise_rht", False) and usage == "columnwise"
        if not rht:
            assert int(count) == int(torch.count_nonzero(values(out, usage)))
        scales = out.scale_inv_values(usage)
        assert scales.dtype == torch.float32 and scales.dim() == 1
        assert torch.all(torch.isfinite(scales)) and torch.all(scales > 0)
        if type(_leaf(out, usage)).__name__ == "IdentityTensor":
            assert scales.numel() == 0
        else:
            assert scales.numel() >= 1
    out.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError):
        out.nonzero_code_count("columnwise")


def _leaf(qt, usage):
    while isinstance(qt, HybridQuantizedTensor):
        qt = qt.sub_storage(usage)
    return qt


# ------------------------------------------------------------------------------------------------ repr
@pytest.mark.parametrize("name", NAMES)
def test_repr(name):
    q = make(name)
    assert type(q).__name__ in repr(q)
    out = q.quantize(sample(seed=11))
    out.update_usage(columnwise_usage=False)
    text = repr(out)
    assert type(out).__name__ in text and "(2, 32, 128)" in text
    assert "columnwise=None" in text and "NoneType" not in text
