"""tedebug.nn layers and tedebug.autocast: high-precision exactness, every layer x every recipe against a plain-torch
emulation (same quantizers, fp32 matmuls of the dequantized operands), delayed scaling, naming, debug hook-up."""

import pytest
import torch
import torch.nn.functional as F

import tedebug
from tedebug import recipe as R
from tedebug.autocast import autocast_state, default_recipe
from tedebug.nn import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear
from tedebug.nn.base import GemmState
from tedebug.quantization import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)


def _hybrid_factory(role):
    if role == "input":
        return HybridQuantizer(MXFP8Quantizer("E4M3"), NVFP4Quantizer())
    if role == "weight":
        return HybridQuantizer(Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer("E4M3"))
    if role == "grad_output":
        return HybridQuantizer(IdentityQuantizer(), Float8BlockQuantizer("E5M2", block_scaling_dim=1))
    return None


RECIPES = {
    "delayed": lambda: R.DelayedScaling(),
    "current": lambda: R.Float8CurrentScaling(),
    "mxfp8": lambda: R.MXFP8BlockScaling(),
    "nvfp4": lambda: R.NVFP4BlockScaling(seed=1234),
    "block": lambda: R.Float8BlockScaling(),
    "custom_hybrid": lambda: R.CustomRecipe(_hybrid_factory),
}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ oracle
def _deq(t, usage):
    return t if isinstance(t, torch.Tensor) else t.dequantize(dtype=torch.float32, usage=usage)


class _RefGemm:
    """Plain-torch emulation of one linear GEMM: quantize-dequantize with fresh recipe quantizers, fp32 matmuls."""

    def __init__(self, recipe):
        self.q = {
            role: (recipe.make_quantizer(role) if recipe is not None else None)
            for role in ("input", "weight", "grad_output")
        }

    def _quant(self, role, t):
        q = self.q[role]
        return t if q is None else q.quantize(t)

    def forward(self, x2, w, b):
        self.xq, self.wq = self._quant("input", x2), self._quant("weight", w)
        y = _deq(self.xq, "rowwise") @ _deq(self.wq, "rowwise").t()
        return y if b is None else y + b

    def backward(self, dy2):
        gq = self._quant("grad_output", dy2)
        dx = _deq(gq, "rowwise") @ _deq(self.wq, "columnwise")
        dw = _deq(gq, "columnwise").t() @ _deq(self.xq, "columnwise")
        return dx, dw, dy2.sum(0)


def _close(actual, expected):
    # The quantization error of every recipe here is > 1e-3 relative, so this tolerance (fp32 summation order
    # only) separates "same quantized operands" from "different ones".
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _run_layer(layer, x, dy, recipe, **kw):
    x = x.clone().requires_grad_(True)
    if recipe is None:
        y = layer(x, **kw)
    else:
        with tedebug.autocast(recipe=recipe):
            y = layer(x, **kw)
    y.backward(dy)
    return y.detach(), x.grad


# ------------------------------------------------------------------------------------------------ HP path
def test_linear_high_precision_equals_torch_exactly():
    layer = Linear(64, 48)
    x, dy = _randn(2, 8, 64, seed=0), _randn(2, 8, 48, seed=1)
    y, dx = _run_layer(layer, x, dy, None)
    dw, db = layer.weight.grad.clone(), layer.bias.grad.clone()
    xr = x.clone().requires_grad_(True)
    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)
    yr = F.linear(xr, w, b)
    yr.backward(dy)
    assert torch.equal(y, yr.detach())
    assert torch.equal(dx, xr.grad) and torch.equal(dw, w.grad) and torch.equal(db, b.grad)


def test_high_precision_composite_layers_equal_torch():
    x = _randn(16, 32, seed=2)
    ln = LayerNormLinear(32, 24, normalization="RMSNorm")
    assert ln.layer_norm_bias is None
    assert torch.equal(ln(x), F.linear(F.rms_norm(x, (32,), ln.layer_norm_weight, 1e-5), ln.weight, ln.bias))
    mlp = LayerNormMLP(32, 64, activation="swiglu")
    h = F.linear(F.layer_norm(x, (32,), mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5), mlp.fc1_weight, mlp.fc1_bias)
    a, g = h.chunk(2, dim=-1)
    assert torch.equal(mlp(x), F.linear(F.silu(a) * g, mlp.fc2_weight, mlp.fc2_bias))
    grouped = GroupedLinear(3, 32, 8)
    out = grouped(x, [5, 0, 11])
    ref = torch.cat([F.linear(x[:5], grouped.weight0, grouped.bias0), F.linear(x[5:], grouped.weight2, grouped.bias2)])
    assert out.shape == (16, 8) and torch.equal(out, ref)


def test_bf16_params_high_precision_and_quantized():
    layer = Linear(128, 128, params_dtype=torch.bfloat16)
    x = _randn(128, 128, seed=3).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with tedebug.autocast(recipe=R.MXFP8BlockScaling()):
        y = layer(x)
    ref = _RefGemm(R.MXFP8BlockScaling()).forward(x, layer.weight.detach(), layer.bias.detach().float())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ref.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_linear_matches_emulation(recipe_name):
    recipe = RECIPES[recipe_name]()
    layer = Linear(128, 256)
    x, dy = _randn(2, 64, 128, seed=4), _randn(2, 64, 256, seed=5)
    y, dx = _run_layer(layer, x, dy, recipe)
    ref = _RefGemm(RECIPES[recipe_name]())
    y_ref = ref.forward(x.reshape(128, 128), layer.weight.detach(), layer.bias.detach())
    dx_ref, dw_ref, db_ref = ref.backward(dy.reshape(128, 256))
    _close(y, y_ref.reshape(2, 64, 256))
    _close(dx, dx_ref.reshape(2, 64, 128))
    _close(layer.weight.grad, dw_ref)
    _close(layer.bias.grad, db_ref)
    # the layer really quantized: far from the high-precision result
    assert (y - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_matches_emulation(recipe_name, normalization):
    layer = LayerNormLinear(128, 128, normalization=normalization)
    with torch.no_grad():
        layer.layer_norm_weight.add_(_randn(128, seed=6) * 0.1)
    x, dy = _randn(128, 128, seed=7), _randn(128, 128, seed=8)
    y, dx = _run_layer(layer, x, dy, RECIPES[recipe_name]())
    xr = x.clone().requires_grad_(True)
    bias = None if layer.layer_norm_bias is None else layer.layer_norm_bias.detach()
    ln = (
        F.layer_norm(xr, (128,), layer.layer_norm_weight.detach(), bias, 1e-5)
        if normalization == "LayerNorm"
        else F.rms_norm(xr, (128,), layer.layer_norm_weight.detach(), 1e-5)
    )
    ref = _RefGemm(RECIPES[recipe_name]())
    y_ref = ref.forward(ln.detach(), layer.weight.detach(), layer.bias.detach())
    dln, dw_ref, db_ref = ref.backward(dy)
    (dx_ref,) = torch.autograd.grad(ln, xr, dln)
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(layer.weight.grad, dw_ref)
    _close(layer.bias.grad, db_ref)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_layernorm_mlp_matches_emulation(recipe_name):
    layer = LayerNormMLP(128, 256)
    x, dy = _randn(128, 128, seed=9), _randn(128, 128, seed=10)
    y, dx = _run_layer(layer, x, dy, RECIPES[recipe_name]())
    xr = x.clone().requires_grad_(True)
    ln = F.layer_norm(xr, (128,), layer.layer_norm_weight.detach(), layer.layer_norm_bias.detach(), 1e-5)
    fc1, fc2 = _RefGemm(RECIPES[recipe_name]()), _RefGemm(RECIPES[recipe_name]())
    h = fc1.forward(ln.detach(), layer.fc1_weight.detach(), layer.fc1_bias.detach()).requires_grad_(True)
    act = F.gelu(h, approximate="tanh")
    y_ref = fc2.forward(act.detach(), layer.fc2_weight.detach(), layer.fc2_bias.detach())
    dact, dw2, db2 = fc2.backward(dy)
    (dh,) = torch.autograd.grad(act, h, dact)
    dln, dw1, db1 = fc1.backward(dh)
    (dx_ref,) = torch.autograd.grad(ln, xr, dln)
    _close(y, y_ref)
    _close(layer.fc2_weight.grad, dw2)
    _close(layer.fc2_bias.grad, db2)
    _close(layer.fc1_weight.grad, dw1)
    _close(layer.fc1_bias.grad, db1)
    _close(dx, dx_ref)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_grouped_linear_matches_emulation(recipe_name):
    layer = GroupedLinear(2, 128, 128)
    x, dy = _randn(256, 128, seed=11), _randn(256, 128, seed=12)
    y, dx = _run_layer(layer, x, dy, RECIPES[recipe_name](), m_splits=[128, 128])
    for i, rows in enumerate((slice(0, 128), slice(128, 256))):
        ref = _RefGemm(RECIPES[recipe_name]())
        w, b = getattr(layer, f"weight{i}"), getattr(layer, f"bias{i}")
        _close(y[rows], ref.forward(x[rows], w.detach(), b.detach()))
        dx_ref, dw_ref, db_ref = ref.backward(dy[rows])
        _close(dx[rows], dx_ref)
        _close(w.grad, dw_ref)
        _close(b.grad, db_ref)


# ------------------------------------------------------------------------------------------------ delayed scaling
def test_delayed_scaling_updates_before_each_use_but_the_first():
    layer = Linear(64, 32, bias=False)
    x1, x2 = _randn(32, 64, seed=13) * 3, _randn(32, 64, seed=14)
    rec = R.DelayedScaling(amax_history_len=4)
    with tedebug.autocast(recipe=rec):
        layer(x1)
    q_in = layer.gemm_state.quantizers["input"]
    assert float(q_in.scale.reshape(())) == 1.0  # first use: no update
    assert float(q_in.amax_history.reshape(-1)[0]) == float(x1.abs().max())
    with tedebug.autocast(recipe=rec):
        layer(x2)
    assert layer.gemm_state.quantizers["input"] is q_in  # same recipe (equal dataclass): state kept
    expected = torch.tensor(448.0) / x1.abs().max()
    assert float(q_in.scale.reshape(())) == float(expected)
    with tedebug.autocast(recipe=R.DelayedScaling(amax_history_len=8)):
        layer(x2)
    assert layer.gemm_state.quantizers["input"] is not q_in  # another recipe: fresh quantizers


# ------------------------------------------------------------------------------------------------ autocast
def test_autocast_state_nesting_and_reentry():
    assert autocast_state() == (False, None)
    mx, cur = R.MXFP8BlockScaling(), R.Float8CurrentScaling()
    outer = tedebug.autocast(recipe=mx)
    with outer:
        assert autocast_state() == (True, mx)
        with tedebug.autocast(enabled=False):
            assert autocast_state() == (False, None)
            with tedebug.autocast():
                assert autocast_state() == (True, default_recipe())
                assert isinstance(default_recipe(), R.DelayedScaling)
        with outer:  # re-entering the same object
            with tedebug.autocast(recipe=cur):
                assert autocast_state() == (True, cur)
            assert autocast_state() == (True, mx)
        assert autocast_state() == (True, mx)
    assert autocast_state() == (False, None)

    @tedebug.autocast(recipe=cur)
    def inside():
        return autocast_state()

    assert inside() == (True, cur) and autocast_state() == (False, None)
    with pytest.raises(TypeError, match="make_quantizer"):
        tedebug.autocast(recipe="mxfp8")


def test_autocast_state_restored_after_exception():
    with pytest.raises(ValueError):
        with tedebug.autocast(recipe=R.MXFP8BlockScaling()):
            raise ValueError("boom")
    assert autocast_state() == (False, None)


def test_recipe_precedence():
    layer = Linear(32, 32)
    assert layer.active_recipe() is None
    with tedebug.autocast():
        assert layer.active_recipe() is default_recipe()
    layer.default_recipe = R.MXFP8BlockScaling()
    with tedebug.autocast():
        assert layer.active_recipe() is layer.default_recipe
    cur = R.Float8CurrentScaling()
    with tedebug.autocast(recipe=cur):
        assert layer.active_recipe() is cur
    with tedebug.autocast(enabled=False):
        assert layer.active_recipe() is None


# ------------------------------------------------------------------------------------------------ naming
def test_layer_names_count_unnamed_layers():
    first = Linear(4, 4)
    n = int(first.name.split("_")[1])
    named = Linear(4, 4, name="proj")
    second = LayerNormMLP(4, 8)
    assert named.name == "proj"
    assert second.name == f"Layer_{n + 1}"


class _FakeDebugQuantizer:
    """Stands in for a DebugQuantizer: records calls, passes tensors through, doubles GEMM outputs."""

    is_debug = True

    def __init__(self, log, role):
        self.log, self.role = log, role

    def set_usage(self, rowwise=None, columnwise=None):
        pass

    def quantize(self, t):
        self.log.append(("quantize", self.role))
        return t

    def process_gemm_output(self, t):
        self.log.append(("output", self.role))
        return t * 2


class _FakeGate:
    def __init__(self, log):
        self.log = log

    def debug_quantizers(self, layer_name, quantizers, tp_group=None, tp_size=1):
        self.log.append(("gate", layer_name, tuple(sorted(quantizers))))
        return {role: _FakeDebugQuantizer(self.log, role) for role in quantizers}


def test_debug_quantizers_replace_normal_ones_and_process_outputs(monkeypatch):
    log = []
    monkeypatch.setattr(GemmState, "_debug", lambda self: _FakeGate(log))
    monkeypatch.setattr(tedebug.active, "DEBUG_MANAGER", object())  # the gate is asked only while a session exists
    layer = Linear(32, 16, name="first")
    layer.name = "renamed"  # infer_and_assign_layer_names may do this after construction
    x, dy = _randn(8, 32, seed=15), _randn(8, 16, seed=16)
    y, dx = _run_layer(layer, x, dy, None)
    assert log[0] == ("gate", "renamed", ("grad_input", "grad_output", "grad_weight", "input", "output", "weight"))
    assert log[1:] == [
        ("quantize", "input"),
        ("quantize", "weight"),
        ("output", "output"),
        ("quantize", "grad_output"),
        ("output", "grad_input"),
        ("output", "grad_weight"),
    ]
    assert torch.equal(y, 2 * F.linear(x, layer.weight, layer.bias))
    assert torch.equal(dx, 2 * (dy @ layer.weight.detach()))
    assert torch.equal(layer.weight.grad, 2 * (dy.t() @ x))


def test_gemm_debug_names_of_composite_layers(monkeypatch):
    log = []

    class _Idle:
        def debug_quantizers(self, layer_name, quantizers, tp_group=None, tp_size=1):
            log.append(layer_name)
            return None

    monkeypatch.setattr(GemmState, "_debug", lambda self: _Idle())
    monkeypatch.setattr(tedebug.active, "DEBUG_MANAGER", object())  # the gate is asked only while a session exists
    LayerNormMLP(16, 32, name="mlp")(_randn(4, 16, seed=17))
    GroupedLinear(3, 16, 8, name="moe")(_randn(6, 16, seed=18), [2, 4, 0])
    LayerNormLinear(16, 8, name="qkv")(_randn(4, 16, seed=19))
    assert log == ["mlp.fc1", "mlp.fc2", "moe.gemm_0", "moe.gemm_1", "qkv"]


def test_input_shape_errors():
    with pytest.raises(ValueError, match="'lin': input last dim 8 != in_features 4"):
        Linear(4, 4, name="lin")(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="m_splits"):
        GroupedLinear(2, 4, 4, name="g")(torch.zeros(5, 4), [2, 2])


def test_real_debug_session_disables_fprop_quantization_for_selected_layer(tmp_path):
    from tedebug import debug_api

    cfg = {
        "sec": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "^lin$"},
            "transformer_engine": {"DisableQuantizationGEMM": {"enabled": True, "gemms": ["fprop"]}},
        }
    }
    debug_api.initialize(cfg, log_dir=str(tmp_path))
    try:
        selected, other = Linear(128, 128, name="lin"), Linear(128, 128, name="other")
        x, dy = _randn(128, 128, seed=20), _randn(128, 128, seed=21)
        y, dx = _run_layer(selected, x, dy, R.MXFP8BlockScaling())
        y_other, _ = _run_layer(other, x, dy, R.MXFP8BlockScaling())
        debug_api.step()
    finally:
        debug_api.end_debug()
    assert torch.equal(y, F.linear(x, selected.weight, selected.bias))  # fprop in high precision
    ref = _RefGemm(R.MXFP8BlockScaling())
    ref.forward(x, selected.weight.detach(), selected.bias.detach())
    dx_ref, dw_ref, _ = ref.backward(dy)
    _close(dx, dx_ref)  # dgrad and wgrad still quantized
    _close(selected.weight.grad, dw_ref)
    assert not torch.equal(y_other, F.linear(x, other.weight, other.bias))


def _layer_kinds():
    from tedebug.nn import Conv1DLinear

    return {
        "Linear": lambda **kw: Linear(16, 8, **kw),
        "LayerNormLinear": lambda **kw: LayerNormLinear(16, 8, **kw),
        "RMSNorm LayerNormMLP": lambda **kw: LayerNormMLP(16, 32, normalization="RMSNorm", activation="swiglu", **kw),
        "GroupedLinear": lambda **kw: GroupedLinear(3, 16, 8, **kw),
        "Conv1DLinear": lambda **kw: Conv1DLinear(8, 16, **kw),
    }


@pytest.mark.parametrize("kind", list(_layer_kinds()))
def test_a_layer_built_on_meta_gets_its_values_from_reset_parameters(kind):
    """The meta-device initialisation (FSDP's convention: build on "meta", ``to_empty``, ``reset_parameters``)
    gives the values the constructor gives from the same random state; before, the layers had no
    reset_parameters and kept ``to_empty``'s uninitialised memory."""
    make = _layer_kinds()[kind]
    torch.manual_seed(0)
    expected = make().state_dict()
    layer = make(device="meta").to_empty(device="cpu")
    torch.manual_seed(0)
    layer.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    state = layer.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_a_model_converted_on_meta_gets_torch_s_values():
    """convert_model on a model built on "meta", then ``to_empty`` and ``reset_parameters``: torch.nn.Linear's
    values from the same random state."""
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).state_dict()
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    tedebug.convert_model(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert isinstance(model[0], Linear)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
