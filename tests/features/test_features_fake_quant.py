"""FakeQuant numerics: each quant_format equals quantize-then-dequantize by the quantization core bit for bit, and
the FP8 formats also match a hand-written float64 / torch-float8 reference of the delayed-scaling scale rule (margin 0,
previous scale 1)."""

import pytest
import torch

from tedebug.features.fake_quant import fake_quant_fp8_scale, fake_quantize
from tedebug.quantization.formats import FLT_MAX
from tedebug.quantization.mxfp8 import MXFP8Quantizer
from tedebug.quantization.nvfp4 import NVFP4Quantizer

from support.features import debug_session, section

TORCH_FP8 = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}


def sample(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-12, 6, (64, 96), generator=g).float())
    x[0, :5] = 0.0
    return x.to(dtype)


def fp8_reference(x, fmt):
    """scale = fp8_max / amax (fp32 division), cast with saturation, decode times fp32(1 / scale)."""
    torch_dtype, fp8_max = TORCH_FP8[fmt]
    amax = x.float().abs().max()
    scale = torch.tensor(fp8_max, dtype=torch.float32) / amax
    scaled = torch.clamp(x.float() * scale, -fp8_max, fp8_max)
    return (scaled.to(torch_dtype).float() * (torch.tensor(1.0) / scale)).to(x.dtype)


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fake_quant_matches_the_reference(fmt, dtype):
    x = sample(dtype)
    y = fake_quantize(x, "FP8" + fmt)
    assert y.dtype == dtype
    assert torch.equal(y, fp8_reference(x, fmt))
    assert not torch.equal(y, x)


def test_fp8_scale_guards():
    assert fake_quant_fp8_scale(torch.zeros(4, 4), "E4M3").item() == 1.0
    assert fake_quant_fp8_scale(torch.tensor([[1.0, float("inf")]]), "E4M3").item() == 1.0
    assert fake_quant_fp8_scale(torch.tensor([[1.0, float("nan")]]), "E5M2").item() == 1.0  # NaN amax keeps 1
    assert fake_quant_fp8_scale(torch.tensor([[1e-45, 0.0]]), "E4M3").item() == FLT_MAX  # 448 / denormal = inf
    assert fake_quant_fp8_scale(torch.tensor([[2.0, -8.0]]), "E4M3").item() == 56.0
    x = torch.tensor([[3.0, float("nan"), 1000.0]])
    y = fake_quantize(x, "FP8E4M3")  # scale 1: 1000 saturates to 448, NaN stays NaN
    assert y[0, 0].item() == 3.0 and torch.isnan(y[0, 1]) and y[0, 2].item() == 448.0
    assert torch.equal(fake_quantize(torch.zeros(2, 32), "FP8E5M2"), torch.zeros(2, 32))


@pytest.mark.parametrize(
    "quant_format, make",
    [
        ("MXFP8E4M3", lambda: MXFP8Quantizer("E4M3")),
        ("MXFP8E5M2", lambda: MXFP8Quantizer("E5M2")),
        ("NVFP4", lambda: NVFP4Quantizer()),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_formats_equal_the_quantization_core(quant_format, make, dtype):
    x = sample(dtype, seed=1)
    y = fake_quantize(x, quant_format)
    expected = make().quantize(x).dequantize(usage="rowwise", dtype=dtype)
    assert y.dtype == dtype and torch.equal(y, expected)
    assert not torch.equal(y, x)


def test_mxfp8_fake_quant_against_a_hand_computed_block():
    x = torch.zeros(32, 32)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, 0.3, 1e-6
    x[1, 0], x[1, 1] = 448.0, 1.0  # amax 448 = fp8_max exactly: block scale 2^0
    # row 0: amax 3 -> 3 / 448 rounded up to a power of two = 2^-7: elements x * 2^7 in E4M3, decoded times 2^-7
    expected = x.clone()
    expected[0] = (x[0] * 128).to(torch.float8_e4m3fn).float() / 128
    assert expected[0, 2].item() == 0.0 and expected[0, 1].item() != 0.3  # 1e-6 * 2^7 < 2^-10 underflows; 0.3 rounds
    assert torch.equal(fake_quantize(x, "MXFP8E4M3"), expected)


def test_fake_quant_feature_hooks(tmp_path):
    config = section(
        {
            "FakeQuant": {
                "enabled": True,
                "gemms": ["fprop", "dgrad"],
                "tensors_struct": [
                    {"tensor": "activation", "quant_format": "NVFP4"},
                    {"tensor": "gradient", "quant_format": "FP8E5M2"},
                ],
            }
        }
    )
    with debug_session(config, tmp_path) as te:
        x = sample(seed=2)
        kwargs = dict(gemm="fprop", tensor_name="activation", tensor=x, default_quantizer=None, iteration=0)
        assert torch.equal(te.modify_tensor("L", **kwargs), fake_quantize(x, "NVFP4"))
        half = te.modify_tensor("L", dtype=torch.float16, **kwargs)
        assert half.dtype == torch.float16 and torch.equal(half, fake_quantize(x, "NVFP4").half())
        out = torch.empty_like(x)
        assert te.modify_tensor("L", out=out, **kwargs) is None
        assert torch.equal(out, fake_quantize(x, "NVFP4"))
        y = te.modify_tensor("L", gemm="dgrad", tensor_name="gradient", tensor=x, default_quantizer=None, iteration=0)
        assert torch.equal(y, fp8_reference(x, "E5M2"))
        assert te.fp8_gemm_enabled("L", gemm="dgrad", iteration=4) == (False, 5)
        assert te.fp8_gemm_enabled("L", gemm="wgrad", iteration=4) == (True, None)
        assert te.modify_tensor_enabled("L", gemm="wgrad", tensor_name="gradient", iteration=4) == (False, None)


def test_an_operand_the_format_cannot_take_stays_in_high_precision(tmp_path, no_debug_session):
    """A rank-4 layer under MXFP8 fake quantization: its weight (4 × 32) and the next layer's input (… × 4) have no
    whole 32-element blocks.  Training goes on with those operands in high precision and one warning each in the
    main log; the operands that fit are fake-quantized.  Before, the forward raised (the format's ValueError)."""
    import tedebug
    from tedebug import debug_api

    torch.manual_seed(0)
    model = tedebug.convert_model(torch.nn.Sequential(torch.nn.Linear(32, 4), torch.nn.Linear(4, 32)))
    x = torch.randn(2, 16, 32)
    config = section(
        {
            "FakeQuant": {
                "enabled": True,
                "gemms": ["fprop"],
                "tensors": ["activation", "weight"],
                "quant_format": "MXFP8E4M3",
            }
        }
    )
    with debug_session(config, tmp_path):
        for _ in range(2):  # (one warning per layer, GEMM and tensor, not one per call)
            y = model(x)
            y.sum().backward()
            debug_api.step()
    first, second = model[0], model[1]
    hidden = torch.nn.functional.linear(fake_quantize(x.reshape(-1, 32), "MXFP8E4M3"), first.weight, first.bias)
    want = torch.nn.functional.linear(hidden, second.weight, second.bias).reshape(2, 16, 32)
    assert torch.equal(y.detach(), want)  # layer 0's input fake-quantized; its weight and layer 1's operands not
    log = (tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    skipped = [line for line in log.splitlines() if "Feature=FakeQuant: skipping" in line]
    assert len(skipped) == 3 and all("left in high precision" in line for line in skipped)
    assert sum("LAYER=0" in line and "fprop, weight of shape (4, 32)" in line for line in skipped) == 1
