"""The per-call path of a tedebug linear layer (`tedebug.nn.base`): what is decided once per recipe stays decided,
and the lean call keeps every behaviour of the generic one - saved-tensor hooks see the quantized operands,
functorch transforms get torch's own answer, torch.autocast's dtype is honoured, N-D inputs equal their 2-D view."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import tedebug
from tedebug import recipe as R
from tedebug.nn import LayerNormLinear, LayerNormMLP, Linear
from tedebug.nn import base as nn_base
from tedebug.nn.base import GemmState


def _layer(seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(32, 16)


def _step(layer: Linear, x: torch.Tensor, recipe=None):
    """Forward (inside `tedebug.autocast` when a recipe is given) and backward; (y, dx, dW, db)."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def test_saved_tensor_hooks_see_the_quantized_operands():
    """The FP8 codes and scales kept for the backward go through `save_for_backward`, so saved-tensor hooks
    (activation offloading, non-reentrant checkpointing) see them; the results equal a run without hooks."""
    layer = _layer()
    x = torch.randn(2, 4, 32)
    expected = _step(layer, x, R.Float8CurrentScaling())
    packed = []

    def pack(t):
        packed.append((t.dtype, tuple(t.shape)))
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _step(layer, x, R.Float8CurrentScaling())
    codes = sorted(shape for dtype, shape in packed if dtype == torch.uint8)
    # input [8, 32] rowwise and its [32, 8] transpose, weight [16, 32] rowwise and its [32, 16] transpose
    assert codes == [(8, 32), (16, 32), (32, 8), (32, 16)]
    assert sum(1 for dtype, shape in packed if dtype == torch.float32 and shape == ()) == 2  # two scale_inv
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_functorch_transform_gets_torchs_own_error():
    """Under a functorch transform the layer's autograd function takes torch's public `apply`, which rejects a
    function without ``setup_context`` with its own message (the fast path never runs inside a transform)."""
    layer = _layer()
    with tedebug.autocast(recipe=R.Float8CurrentScaling()):
        with pytest.raises(RuntimeError, match="setup_context"):
            torch.func.vmap(layer)(torch.randn(3, 2, 32))


def test_nd_input_equals_its_2d_view():
    """A [2, 4, 32] input gives the rows of the [8, 32] input, bit for bit, with gradients of its own shape."""
    layer = _layer(1)
    x = torch.randn(2, 4, 32)
    recipe = R.Float8CurrentScaling()
    y3, dx3, dw3, db3 = _step(layer, x, recipe)
    y2, dx2, dw2, db2 = _step(layer, x.reshape(8, 32), recipe)
    assert y3.shape == (2, 4, 16) and dx3.shape == (2, 4, 32)
    assert torch.equal(y3.reshape(8, 16), y2)
    assert torch.equal(dx3.reshape(8, 32), dx2)
    assert torch.equal(dw3, dw2) and torch.equal(db3, db2)


@pytest.mark.parametrize("tedebug_autocast", [False, True])
def test_torch_autocast_dtype_is_honoured(tedebug_autocast):
    """Inside torch.autocast (bf16 on CPU) a layer in high precision computes like torch.nn.Linear does there:
    the same bf16 output and the same gradients (also inside a disabled `tedebug.autocast` block)."""
    torch.manual_seed(2)
    plain = torch.nn.Linear(32, 16)
    layer = Linear(32, 16)
    layer.weight, layer.bias = plain.weight, plain.bias
    x = torch.randn(8, 32)
    results = []
    for module in (plain, layer):
        xi = x.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        block = tedebug.autocast(enabled=False) if tedebug_autocast else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), block:
            y = module(xi)
        y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, plain.weight.grad.clone(), plain.bias.grad.clone()))
    (y_plain, *g_plain), (y_layer, *g_layer) = results
    assert y_plain.dtype == y_layer.dtype == torch.bfloat16
    assert torch.equal(y_plain, y_layer)
    for a, b in zip(g_plain, g_layer):
        assert torch.equal(a, b)


def test_quantizers_are_decided_once_per_recipe():
    """`GemmState.plan` hands one shared answer per recipe (an equal recipe keeps it, another one rebuilds)."""
    state = GemmState()
    current = R.Float8CurrentScaling()
    first = state.plan(current)
    assert state.plan(current) is first
    assert state.plan(R.Float8CurrentScaling()) is first  # equal recipe: same quantizers
    assert first[0] is first[1] and first[0]["input"] is not None
    assert state.plan(None)[0]["input"] is None
    other = state.plan(R.MXFP8BlockScaling())
    assert other is not first and other[0]["input"] is not first[0]["input"]


@pytest.mark.parametrize(("recipe", "per_step"), [(R.Float8CurrentScaling, 0), (R.DelayedScaling, 3)])
def test_delayed_scaling_bookkeeping_only_where_there_is_state(monkeypatch, recipe, per_step):
    """`before_use` (delayed scaling: roll the history, refresh the scale) runs once per quantized operand and
    step under delayed scaling, and not at all under current scaling, which has no state to advance."""
    calls = []
    real = GemmState.before_use

    def counting(self, role, quantizers):
        calls.append(role)
        return real(self, role, quantizers)

    monkeypatch.setattr(GemmState, "before_use", counting)
    layer = _layer(3)
    rec = recipe()
    x = torch.randn(8, 32)
    for _ in range(2):
        _step(layer, x, rec)
    assert len(calls) == 2 * per_step
    if per_step:
        assert sorted(calls[:3]) == ["grad_output", "input", "weight"]
        # the second step refreshed the scales from the first step's amaxes: the input scale is no longer 1
        assert layer.gemm_state.quantizers["input"].scale.item() != 1.0


def test_layernorm_mlp_gemm_names_follow_a_renamed_layer(monkeypatch):
    """The debug names of a LayerNormMLP's GEMMs (``<name>.fc1`` / ``<name>.fc2``) are built once per name and
    follow a `name` reassigned between forwards (as `infer_and_assign_layer_names` does)."""
    asked = []

    class _Gate:
        def debug_quantizers(self, layer_name, quantizers, tp_group=None, tp_size=1):
            asked.append(layer_name)
            return None  # the layer's own quantizers

    monkeypatch.setattr(GemmState, "_debug", lambda self: _Gate())
    monkeypatch.setattr(tedebug.active, "DEBUG_MANAGER", object())  # the gate is asked only while a session exists
    torch.manual_seed(4)
    mlp = LayerNormMLP(32, 64, name="first")
    x = torch.randn(8, 32)
    mlp(x)
    mlp(x)
    mlp.name = "blocks.0.mlp"
    mlp(x)
    assert asked == ["first.fc1", "first.fc2"] * 2 + ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_normalization_runs_in_the_input_dtype(normalization):
    """fp32 parameters, bf16 input: the normalization runs in bf16 with its weights cast to bf16, the GEMM in the
    parameters' fp32 (high precision, no autocast), as the torch expressions below compute it."""
    torch.manual_seed(5)
    layer = LayerNormLinear(32, 16, normalization=normalization)
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.uniform_(-0.5, 0.5)
    x = torch.randn(8, 32).to(torch.bfloat16)
    w = layer.layer_norm_weight.detach().to(torch.bfloat16)
    if normalization == "LayerNorm":
        normed = F.layer_norm(x, (32,), w, layer.layer_norm_bias.detach().to(torch.bfloat16), layer.eps)
    else:
        normed = F.rms_norm(x, (32,), w, layer.eps)
    expected = F.linear(normed.float(), layer.weight.detach(), layer.bias.detach())
    got = layer(x)
    assert got.dtype == torch.float32
    assert torch.equal(got.detach(), expected)


def test_torchs_python_apply_wrapper_is_not_on_the_call_path(monkeypatch):
    """A layer call enters the C++ apply directly: torch's Python `Function.apply` wrapper (signature binding,
    functorch checks) runs zero times per forward, and the outputs equal those of a call through it."""
    layer = _layer(6)
    x = torch.randn(8, 32)
    recipe = R.Float8CurrentScaling()
    direct = _step(layer, x, recipe)
    wrapped = []
    real = torch.autograd.Function.apply.__func__

    def counting(cls, *args, **kwargs):
        wrapped.append(cls.__name__)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counting))
    again = _step(layer, x, recipe)
    assert wrapped == []
    monkeypatch.setattr(
        nn_base, "_C_APPLY", lambda *args: torch.autograd.Function.apply.__func__(nn_base._LinearFunction, *args)
    )
    through_wrapper = _step(layer, x, recipe)
    assert wrapped == ["_LinearFunction"]
    for a, b, c in zip(direct, again, through_wrapper):
        assert torch.equal(a, b) and torch.equal(a, c)
