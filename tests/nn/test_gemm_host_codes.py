"""The CPU GEMM of two per-tensor FP8 operands computed straight from their stored codes (`tedebug.nn.gemm._host_fp8`,
`Float8Tensor.host_decoded`): one table look-up per operand (the 256 code values times scale_inv, made once per
tensor and scale), no transposing torch call, no second validation of the operands.

The oracle is the definition of the emulated GEMM, written out with torch alone: dequantize each operand in fp32,
flatten it to 2-D, transpose it as the layout says, multiply with ``@``, add the bias, cast.  The fast path must give
the same bits and hand ``mm`` operands with the same strides (the product's bits can depend on them), on inputs
chosen to make the order and the layout of the additions matter (values spread over the whole FP8 range, sums that
cancel), with NaN codes and an infinite decode scale; and a call counter pins that the layers take it."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tedebug
from tedebug import recipe as R
from tedebug.nn import Linear
from tedebug.nn.gemm import gemm
from tedebug.quantization import float8 as float8_module
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

from support.concurrency import run_in_two_threads

LAYOUTS = ("TN", "NN", "NT", "TT")
#: the module (the package's attribute `gemm` may be the function of that name)
gemm_module = importlib.import_module("tedebug.nn.gemm")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32) if t.dtype != torch.float32 else t.view(torch.int32)


def _flat(q, usage):
    values = q.dequantize(usage=usage, dtype=torch.float32)
    return values.reshape(-1, values.shape[-1])


def _reference_operands(aq, bq, layout):
    a = _flat(aq, "rowwise" if layout[0] == "T" else "columnwise")
    b = _flat(bq, "columnwise" if layout[1] == "T" else "rowwise")
    return (b if layout[1] == "N" else b.t()), (a.t() if layout[0] == "T" else a)


def _reference(aq, bq, layout, out_dtype, bias):
    op_b, op_a = _reference_operands(aq, bq, layout)
    out = op_b @ op_a
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


def _adversarial(shape, g: torch.Generator) -> torch.Tensor:
    """Values over ~40 binades with random signs, some exact negatives of others (sums that cancel) and zeros: the
    fp32 sums then depend on the order and grouping of the additions."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    half = torch.randperm(n, generator=g)[: n // 4]
    flat[half] = -flat[torch.roll(half, 1)]
    flat[torch.randperm(n, generator=g)[: n // 16]] = 0.0
    return x


class _MmOperands(TorchDispatchMode):
    """Records (shape, stride) of both operands of every aten ``mm``, and the names of all operators run."""

    def __init__(self) -> None:
        super().__init__()
        self.mm = []
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.ops.append(name)
        if name == "mm":
            self.mm.append(tuple((tuple(t.shape), t.stride()) for t in args[:2]))
        return func(*args, **(kwargs or {}))


_SHAPES = [(8, 32, 32), (8, 96, 32), (8, 32, 128), (24, 40, 16), (3, 5, 7), (2, 2, 2), (64, 48, 80)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("formats", [("E4M3", "E4M3"), ("E4M3", "E5M2"), ("E5M2", "E5M2")])
def test_same_bits_and_operand_strides_as_the_definition(layout, formats):
    g = torch.Generator().manual_seed(1414)
    for m, n, k in _SHAPES:
        for trial in range(3):
            a = _adversarial((n, k) if layout[0] == "T" else (k, n), g)
            b = _adversarial((m, k) if layout[1] == "N" else (k, m), g)
            aq = Float8CurrentScalingQuantizer(formats[0]).quantize(a)
            bq = Float8CurrentScalingQuantizer(formats[1]).quantize(b)
            for out_dtype, bias in (
                (torch.float32, None),
                (torch.float32, _adversarial((n,), g)),
                (torch.bfloat16, _adversarial((n,), g).bfloat16()),
            ):
                with _MmOperands() as seen:
                    out = gemm(aq, bq, layout=layout, out_dtype=out_dtype, bias=bias)
                ref = _reference(aq, bq, layout, out_dtype, bias)
                assert out.dtype == out_dtype and out.shape == (m, n)
                assert torch.equal(_bits(out), _bits(ref)), (m, n, k, trial)
                op_b, op_a = _reference_operands(aq, bq, layout)
                assert seen.mm == [((tuple(op_b.shape), op_b.stride()), (tuple(op_a.shape), op_a.stride()))]
                assert "t" not in seen.ops  # no transposing torch call: the fast path ran


def test_threads_and_large_operands_get_arrays_of_their_own():
    """The decoded operands go to arrays kept per thread and shape (`_operand_arrays`): two threads multiplying
    operands of one shape at once each get their own product's bits, and an operand above the kept size gets a new
    array with the same result."""
    g = torch.Generator().manual_seed(1415)
    pairs = [
        (
            Float8CurrentScalingQuantizer().quantize(_adversarial((24, 40), g)),
            Float8CurrentScalingQuantizer().quantize(_adversarial((16, 40), g)),
        )
        for _ in range(2)
    ]
    expected = [_bits(_reference(a, b, "TN", torch.float32, None)) for a, b in pairs]
    results = run_in_two_threads(lambda i: _bits(gemm(*pairs[i], layout="TN", out_dtype=torch.float32)), 300)
    for i in range(2):
        assert all(torch.equal(r, expected[i]) for r in results[i])
    limit = gemm_module._OPERANDS.max_numel
    gemm_module._OPERANDS.max_numel = 24 * 40 - 1  # A too large to keep, B kept
    try:
        for layout in LAYOUTS:
            a = Float8CurrentScalingQuantizer().quantize(_adversarial((24, 40) if layout[0] == "T" else (40, 24), g))
            b = Float8CurrentScalingQuantizer().quantize(_adversarial((16, 40) if layout[1] == "N" else (40, 16), g))
            out = gemm(a, b, layout=layout, out_dtype=torch.float32)
            assert torch.equal(_bits(out), _bits(_reference(a, b, layout, torch.float32, None)))
    finally:
        gemm_module._OPERANDS.max_numel = limit


def test_nan_codes_and_an_infinite_decode_scale():
    """A NaN element (stored as the NaN code) and a delayed-scaling state with scale 0 (scale_inv = +Inf, so the
    zero codes decode to NaN as ``0 * Inf``) give the definition's bits, NaN payloads included."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(16, 24, generator=g)
    a[3, 5] = float("nan")
    aq = Float8CurrentScalingQuantizer().quantize(a)
    zero_scale = Float8Quantizer(torch.tensor(0.0), torch.zeros(2), "E5M2")
    bq = zero_scale.quantize(torch.randn(8, 24, generator=g))
    assert math.isinf(bq.scale_inv.item())
    out = gemm(aq, bq, layout="TN", out_dtype=torch.float32)
    assert torch.isnan(out).any()
    assert torch.equal(_bits(out), _bits(_reference(aq, bq, "TN", torch.float32, None)))
    values = aq.host_decoded("rowwise")
    assert values is not None and np.isnan(values[3, 5])


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_host_decoded_is_the_dequantized_storage(fmt):
    """Rowwise: the dequantized [M, K] values; columnwise: their contiguous [K, M] transpose; bit for bit."""
    q = Float8CurrentScalingQuantizer(fmt).quantize(_adversarial((12, 20), torch.Generator().manual_seed(3)))
    row = torch.from_numpy(q.host_decoded("rowwise"))
    col = torch.from_numpy(q.host_decoded("columnwise"))
    assert torch.equal(_bits(row), _bits(q.dequantize(usage="rowwise", dtype=torch.float32)))
    assert col.is_contiguous() and col.shape == (20, 12)
    assert torch.equal(_bits(col), _bits(q.dequantize(usage="columnwise", dtype=torch.float32).t()))


def test_shapes_left_to_the_general_path():
    """M or K of 1 (whose strides `dequantize`'s reshapes choose), a 3-D tensor, and an absent direction have no
    host array: `gemm` then takes the general path, which still gives the definition's bits."""
    q = Float8CurrentScalingQuantizer()
    for shape in ((1, 16), (16, 1), (2, 3, 8)):
        t = q.quantize(torch.randn(shape))
        assert t.host_decoded("rowwise") is None and t.host_decoded("columnwise") is None, shape
    q.set_usage(rowwise=True, columnwise=False)
    t = q.quantize(torch.randn(4, 8))
    assert t.host_decoded("columnwise") is None and t.host_decoded("rowwise") is not None
    # codes assigned as a non-contiguous view (dequantize keeps their strides): the general path, same bits
    q.set_usage(rowwise=True, columnwise=True)
    g = torch.Generator().manual_seed(2)
    a, b = q.quantize(_adversarial((16, 24), g)), q.quantize(_adversarial((8, 24), g))
    b.rowwise_data = b.columnwise_data.t()
    assert b.host_decoded("rowwise") is None
    out = gemm(a, b, layout="TN", out_dtype=torch.float32)
    assert torch.equal(_bits(out), _bits(_reference(a, b, "TN", torch.float32, None)))


def test_a_pair_the_fast_path_declines_is_asked_once(monkeypatch):
    """Two plain CPU Float8Tensors that `_host_fp8` declines (M of 1) go to the general path after one question:
    the check for operands unwrapped from debug tensors does not ask again for the same pair."""
    q = Float8CurrentScalingQuantizer()
    g = torch.Generator().manual_seed(4)
    a, b = q.quantize(_adversarial((16, 8), g)), q.quantize(_adversarial((1, 8), g))
    answers = []
    original = gemm_module._host_fp8
    monkeypatch.setattr(gemm_module, "_host_fp8", lambda *args: answers.append(original(*args)) or answers[-1])
    out = gemm(a, b, layout="TN", out_dtype=torch.float32)
    assert answers == [None]
    assert torch.equal(_bits(out), _bits(_reference(a, b, "TN", torch.float32, None)))


def test_the_decode_table_follows_scale_inv(monkeypatch):
    """The table (code values times scale_inv) is made once for both directions of a tensor, and again when
    scale_inv changes: in place (a refresh through ``quantize(out=)``) or replaced.  A cast that computes the
    quantization-error statistics makes the table for them, and the GEMM's look-ups use that one."""
    made = []
    original = float8_module._table_times

    def counting(fmt, factor):
        made.append(float(factor))
        return original(fmt, factor)

    g = torch.Generator().manual_seed(11)
    quantizer = Float8CurrentScalingQuantizer()
    quantizer.error_stats = False  # a layer's quantizer outside the debug path
    x, y = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g) * 50.0
    q = quantizer.quantize(x)
    monkeypatch.setattr(float8_module, "_table_times", counting)
    q.host_decoded("rowwise")
    q.host_decoded("columnwise")
    assert made == [q.scale_inv.item()]
    quantizer.quantize(y, out=q)  # new codes and scale_inv written into q's own tensors
    assert torch.equal(torch.from_numpy(q.host_decoded("rowwise")), _flat(q, "rowwise"))
    assert made == [made[0], q.scale_inv.item()]
    q.scale_inv = torch.tensor(0.25)
    assert torch.equal(torch.from_numpy(q.host_decoded("columnwise")).t(), _flat(q, "columnwise"))
    assert made[2:] == [0.25]
    quantizer.error_stats = True
    del made[:]
    q = quantizer.quantize(x)
    assert made == [q.scale_inv.item()]  # made by the cast, for the statistics
    assert torch.equal(torch.from_numpy(q.host_decoded("rowwise")), _flat(q, "rowwise"))
    assert torch.equal(torch.from_numpy(q.host_decoded("columnwise")).t(), _flat(q, "columnwise"))
    assert made == [q.scale_inv.item()]


@pytest.mark.parametrize("inspected", [False, True], ids=["plain", "LogFp8TensorStats"])
def test_layers_take_the_fast_path(monkeypatch, tmp_path, no_debug_session, inspected):
    """A Linear training step under FP8 current scaling on the CPU runs its three GEMMs (fprop, dgrad, wgrad) on the
    fast path, each with two table look-ups, and its results equal the general path's (`_host_fp8` switched off).
    With LogFp8TensorStats inspecting the three operands, the debug quantizers only inspect their parents'
    quantizations and hand the GEMMs those very Float8Tensors, no debug tensor around them: the same fast path."""
    if inspected:
        stats = {"stats": ["underflows%", "mse"], "tensors": ["activation", "weight", "gradient"], "freq": 1}
        config = {
            "s": {
                "enabled": True,
                "layers": {"layer_name_regex_pattern": ".*"},
                "transformer_engine": {"LogFp8TensorStats": {"enabled": True, **stats}},
            }
        }
        tedebug.debug_api.initialize(config, log_dir=str(tmp_path))
    calls = []
    original = gemm_module._host_fp8

    def counting(*args):
        out = original(*args)
        calls.append(out is not None)
        return out

    torch.manual_seed(5)
    layer = Linear(32, 24)
    x = torch.randn(2, 8, 32)

    def step():
        xi = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        with tedebug.autocast(recipe=R.Float8CurrentScaling()):
            y = layer(xi)
        (y * torch.linspace(-1, 1, 24)).sum().backward()
        return y.detach(), xi.grad, layer.weight.grad, layer.bias.grad

    decoded = []
    host_decoded = Float8Tensor.host_decoded
    monkeypatch.setattr(gemm_module, "_host_fp8", counting)
    monkeypatch.setattr(
        Float8Tensor, "host_decoded", lambda self, usage, *out: decoded.append(usage) or host_decoded(self, usage, *out)
    )
    wrapped = []
    unwrap = gemm_module.gemm_operand
    monkeypatch.setattr(
        gemm_module,
        "gemm_operand",
        lambda obj, *a: wrapped.append(gemm_module._is_debug_tensor(obj)) or unwrap(obj, *a),
    )
    fast = step()
    assert calls == [True, True, True] and len(decoded) == 6
    assert wrapped == []  # (plain Float8Tensor pairs never reach the unwrapping)
    monkeypatch.setattr(gemm_module, "_host_fp8", lambda *args: None)
    general = step()
    for a, b in zip(fast, general):
        assert torch.equal(_bits(a), _bits(b))
