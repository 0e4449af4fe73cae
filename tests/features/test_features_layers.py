"""Built-in features through real tedebug.nn layers: the log schedule over 20 iterations, and the numerics port of
TransformerEngine's test_numerics (a Linear under DelayedScaling with disabled GEMMs, a disabled layer,
PerTensorScaling and FakeQuant on operand subsets; output, dgrad and wgrad against a plain-torch emulation)."""

import itertools
import os
import random
import re

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.recipe import DelayedScaling

from support.features import debug_session, section

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
FP8 = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}
OPERANDS = (
    ("fprop", "activation"),
    ("fprop", "weight"),
    ("dgrad", "weight"),
    ("dgrad", "gradient"),
    ("wgrad", "activation"),
    ("wgrad", "gradient"),
)
FORMAT = {"activation": "E4M3", "weight": "E4M3", "gradient": "E5M2"}  # DelayedScaling HYBRID


def test_logged_exactly_on_iterations_divisible_by_3_or_5(tmp_path):
    debug_api.initialize(os.path.join(CONFIGS, "log_config.yaml"), log_dir=str(tmp_path))
    try:
        torch.manual_seed(0)
        layer = tedebug.nn.Linear(32, 32, name="test_layer")
        for _ in range(20):
            with tedebug.autocast(recipe=DelayedScaling()):
                layer(torch.randn(32, 32)).sum().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()
    text = open(os.path.join(tmp_path, "nvdlfw_inspect_statistics_logs", "nvdlfw_inspect_globalrank-0.log")).read()
    logged = {int(m) for m in re.findall(r"iteration=(\d{6})", text)}
    assert logged == {i for i in range(1, 20) if i % 3 == 0 or i % 5 == 0}
    for i in range(1, 20):
        names = set(re.findall(rf"(test_layer_activation_\S+) \t+ iteration={i:06d}", text))
        expected = set()
        if i % 3 == 0:
            expected |= {f"test_layer_activation_{s}" for s in ("cur_amax", "dynamic_range", "mean", "std", "l1_norm")}
        if i % 5 == 0:
            expected.add("test_layer_activation_underflows%")
        assert names == expected, i


# ------------------------------------------------------------------------------------------------ numerics
def cast(t, fmt, scale=1.0):
    """Per-tensor FP8 quantize-dequantize with a given scale (saturating), in fp32."""
    dtype, fp8_max = FP8[fmt]
    scale = torch.tensor(scale, dtype=torch.float32)
    return torch.clamp(t * scale, -fp8_max, fp8_max).to(dtype).float() * (torch.tensor(1.0) / scale)


def current(t, fmt):
    """Per-tensor current scaling: scale = fp8_max / amax."""
    return cast(t, fmt, (torch.tensor(FP8[fmt][1]) / t.abs().max()).item())


def emulate(x, w, dy, operand, quantized_gemm):
    """(y, dx, dw) where `operand[(gemm, tensor)]` is the value a GEMM uses and `quantized_gemm[gemm]` says whether
    it runs on FP8 operands (the emulation is the same fp32 matmul of the given operand values either way)."""
    op = {key: operand(key) for key in OPERANDS}
    y = op[("fprop", "activation")] @ op[("fprop", "weight")].t()
    dx = op[("dgrad", "gradient")] @ op[("dgrad", "weight")]
    dw = op[("wgrad", "gradient")].t() @ op[("wgrad", "activation")]
    return y, dx, dw


def run_layer(config, tmp_path, x, w, dy):
    with debug_session(config, tmp_path):
        layer = tedebug.nn.Linear(w.shape[1], w.shape[0], bias=False, name="decoder.1.fc1")
        with torch.no_grad():
            layer.weight.copy_(w)
        xg = x.clone().requires_grad_(True)
        with tedebug.autocast(recipe=DelayedScaling(amax_history_len=16)):
            y = layer(xg)
        y.backward(dy)
        return y.detach(), xg.grad, layer.weight.grad


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * 2
    w = torch.randn(64, 128, generator=g) * 0.5
    dy = torch.randn(64, 64, generator=g) * 4
    return x, w, dy


def values(x, w, dy):
    return {"activation": x, "weight": w, "gradient": dy}


def check(got, expected):
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "disabled", [c for n in range(4) for c in itertools.combinations(("fprop", "dgrad", "wgrad"), n)]
)
def test_disable_quantization_gemms(disabled, tmp_path):
    x, w, dy = data()
    features = (
        {"DisableQuantizationGEMM": {"enabled": True, "gemms": list(disabled)}}
        if disabled
        else {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}}
    )
    got = run_layer(section(features), tmp_path, x, w, dy)
    v = values(x, w, dy)
    expected = emulate(x, w, dy, lambda k: v[k[1]] if k[0] in disabled else cast(v[k[1]], FORMAT[k[1]]), None)
    check(got, expected)
    if disabled != ("fprop",) and "fprop" not in disabled:
        assert not torch.equal(got[0], x @ w.t())  # the FP8 path really differs from high precision


def test_disable_quantization_layer(tmp_path):
    x, w, dy = data(1)
    got = run_layer(section({"DisableQuantizationLayer": {"enabled": True}}), tmp_path, x, w, dy)
    check(got, (x @ w.t(), dy @ w, dy.t() @ x))


def _subsets(n, seed):
    rng = random.Random(seed)
    every = [c for k in range(1, 7) for c in itertools.combinations(OPERANDS, k)]
    return rng.sample(every, n)


@pytest.mark.parametrize("scaled", _subsets(8, seed=5))
def test_per_tensor_scaling_on_operand_subsets(scaled, tmp_path):
    x, w, dy = data(2)
    gemms_struct = {}
    for gemm, tensor in scaled:
        gemms_struct.setdefault(gemm, []).append({"tensor": tensor})
    config = section(
        {
            "PerTensorScaling": {
                "enabled": True,
                "gemms_struct": [{"gemm": g, "tensors_struct": entries} for g, entries in gemms_struct.items()],
            }
        }
    )
    got = run_layer(config, tmp_path, x, w, dy)
    v = values(x, w, dy)
    expected = emulate(
        x, w, dy, lambda k: current(v[k[1]], FORMAT[k[1]]) if k in scaled else cast(v[k[1]], FORMAT[k[1]]), None
    )
    check(got, expected)


def _fake_quant_cases(n, seed):
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        case = tuple(rng.choice(("FP8E4M3", "FP8E5M2", None)) for _ in OPERANDS)
        if any(case) and case not in cases:
            cases.append(case)
    return cases


@pytest.mark.parametrize("formats", _fake_quant_cases(6, seed=3))
def test_fake_quant_on_operand_subsets(formats, tmp_path):
    x, w, dy = data(3)
    chosen = {k: f for k, f in zip(OPERANDS, formats) if f is not None}
    gemms_struct = {}
    for (gemm, tensor), fmt in chosen.items():
        gemms_struct.setdefault(gemm, []).append({"tensor": tensor, "quant_format": fmt})
    config = section(
        {
            "FakeQuant": {
                "enabled": True,
                "gemms_struct": [{"gemm": g, "tensors_struct": entries} for g, entries in gemms_struct.items()],
            }
        }
    )
    got = run_layer(config, tmp_path, x, w, dy)
    v = values(x, w, dy)
    fake_gemms = {g for g, _ in chosen}

    def operand(key):
        gemm, tensor = key
        if key in chosen:
            return current(v[tensor], chosen[key][3:])
        if gemm in fake_gemms:
            return v[tensor]  # the partner of a fake-quantized operand runs in high precision
        return cast(v[tensor], FORMAT[tensor])

    check(got, emulate(x, w, dy, operand, None))


def test_fake_quant_gemm_without_fake_operand_stays_high_precision_every_iteration(tmp_path):
    # FakeQuant routes wgrad, but the weight is not a wgrad operand: only fp8_gemm_enabled applies.  tedebug
    # answers (False, iteration + 1) so the layer re-checks every iteration (TE's (False, None) would let the
    # layer leave debug mode after one iteration and quantize wgrad again).
    x, w, dy = data(4)
    config = section(
        {"FakeQuant": {"enabled": True, "gemms": ["wgrad"], "tensors": ["weight"], "quant_format": "FP8E4M3"}}
    )
    with debug_session(config, tmp_path):
        layer = tedebug.nn.Linear(128, 64, bias=False, name="decoder.1.fc1")
        with torch.no_grad():
            layer.weight.copy_(w)
        for _ in range(3):
            layer.weight.grad = None
            with tedebug.autocast(recipe=DelayedScaling(amax_history_len=16)):
                y = layer(x)
            y.backward(dy)
            torch.testing.assert_close(layer.weight.grad, dy.t() @ x)
            debug_api.step()


def test_fp8_stats_with_a_mixed_plan_in_a_real_layer(tmp_path):
    from tedebug.recipe import MXFP8BlockScaling
    from support.features import RecordingSink

    x, w, dy = data(5)
    sink = RecordingSink()
    config = section(
        {
            "DisableQuantizationGEMM": {"enabled": True, "gemms": ["fprop"]},
            "LogFp8TensorStats": {
                "enabled": True,
                "tensors": ["activation"],
                "stats": ["underflows%", "mse_columnwise", "fp8_current_scaling_mse"],
            },
        }
    )
    with debug_session(config, tmp_path, sink):
        layer = tedebug.nn.Linear(128, 64, bias=False, name="decoder.1.fc1")
        with torch.no_grad():
            layer.weight.copy_(w)
        with tedebug.autocast(recipe=MXFP8BlockScaling()):
            layer(x).backward(dy)
        debug_api.step()
        log = open(tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read()
    got = {n: v for (n, _), v in sink.values().items()}
    assert set(got) == {"decoder.1.fc1_activation_mse_columnwise", "decoder.1.fc1_activation_fp8_current_scaling_mse"}
    from tedebug.quantization.mxfp8 import MXFP8Quantizer

    deq = MXFP8Quantizer("E4M3").quantize(x).dequantize(usage="columnwise", dtype=torch.float64)
    assert got["decoder.1.fc1_activation_mse_columnwise"] == pytest.approx(
        ((deq - x.double()) ** 2).mean().item(), rel=1e-12
    )
    assert "its rowwise GEMM operand runs in high precision" in log
