"""The GEMM operands a `tedebug.nn` layer takes through its debug quantizers (`DebugQuantizer.layer_operand`): the
high-precision tensor itself, or the parent's quantization of it, when both directions use that one object as it
is, a `DebugQuantizedTensor` otherwise; the layer's
outputs and gradients are then exactly torch's, and each logged tensor's statistics are those of the tensor."""

import math

import torch
import torch.nn.functional as F

from tedebug import debug_api
from tedebug.debug_quantization import DebugQuantizedTensor, DebugQuantizer
from tedebug.nn import Linear
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

from support.features import RecordingSink, debug_session, section

TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _hand_stats(t):
    """min, max and l1_norm of `t` in float64 (the oracle)."""
    v = t.detach().double().flatten()
    return {"min": v.min().item(), "max": v.max().item(), "l1_norm": v.abs().sum().item()}


def _same_float8(a, b) -> bool:
    return type(a) is type(b) and all(
        torch.equal(getattr(a, field), getattr(b, field)) for field in ("rowwise_data", "columnwise_data", "scale_inv")
    )


def test_high_precision_operand_is_the_tensor_itself(tmp_path):
    config = section({"LogTensorStats": {"enabled": True, "stats": ["min"], "tensors": ["activation"], "freq": 1}})
    x = _randn(4, 8, seed=1)
    with debug_session(config, tmp_path, RecordingSink()):
        q = DebugQuantizer("L", "activation", None, None)
        assert q.layer_operand(x) is x


def test_quantized_operand_is_the_parents_tensor_when_both_directions_take_it(tmp_path):
    """Both directions quantized by the parent and only inspected: the operand is the parent's quantization itself
    (the object a DebugQuantizedTensor would hand each GEMM); with one direction in high precision it stays
    wrapped, each direction holding its own object."""
    x = _randn(4, 8, seed=1)
    alone = Float8CurrentScalingQuantizer("E4M3")(x)
    logged = section({"LogTensorStats": {"enabled": True, "stats": ["min"], "tensors": ["activation"], "freq": 1}})
    with debug_session(logged, tmp_path / "logged", RecordingSink()):
        q = DebugQuantizer("Q", "activation", Float8CurrentScalingQuantizer("E4M3"), None)
        operand = q.layer_operand(x)
        assert _same_float8(operand, alone)
        assert _same_float8(q.quantize(x).get_tensor(False), alone)  # what the wrapper would hand the GEMMs
        debug_api.step()
    fprop_high = section({"DisableQuantizationGEMM": {"enabled": True, "gemms": ["fprop"]}})
    with debug_session(fprop_high, tmp_path / "fprop", RecordingSink()):
        q = DebugQuantizer("Q", "activation", Float8CurrentScalingQuantizer("E4M3"), None)
        operand = q.layer_operand(x)
        assert isinstance(operand, DebugQuantizedTensor)
        assert operand.get_tensor(False) is x  # fprop reads the high-precision tensor
        assert _same_float8(operand.get_tensor(True), alone)  # wgrad its quantization


def test_logged_linear_gives_torchs_numbers_and_the_tensors_statistics(tmp_path):
    """LogTensorStats on every tensor of a Linear in high precision over two steps: outputs and gradients equal
    F.linear's exactly; every statistic is the hand-computed one of the tensor it names."""
    layer = Linear(8, 6, name="lin")
    sink = RecordingSink()
    config = section(
        {"LogTensorStats": {"enabled": True, "stats": ["min", "max", "l1_norm"], "tensors": TENSORS, "freq": 1}}
    )
    expected = {}
    with debug_session(config, tmp_path, sink):
        for it in range(2):
            x = _randn(5, 8, seed=10 + it).requires_grad_()
            dy = _randn(5, 6, seed=20 + it)
            y = layer(x)
            y.backward(dy)
            w = layer.weight.detach()
            assert torch.equal(y, F.linear(x.detach(), w, layer.bias.detach()))
            assert torch.equal(x.grad, dy @ w)
            wgrad = dy.t() @ x.detach()
            assert torch.equal(layer.weight.grad, wgrad)
            for name, t in (
                ("activation", x),
                ("weight", w),
                ("gradient", dy),
                ("output", y),
                ("wgrad", wgrad),
                ("dgrad", dy @ w),
            ):
                for stat, value in _hand_stats(t).items():
                    expected[(f"lin_{name}_{stat}", it)] = value
            layer.weight.grad = layer.bias.grad = None
            debug_api.step()
    got = sink.values()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=0.0), key
