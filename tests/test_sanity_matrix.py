"""Sanity matrix (port of TE's test_sanity_debug): every layer type x every recipe x {no config, a logging config, a
fake-quant config} runs forward + backward for three iterations, and the configured statistics reach the stats log."""

import re

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug import recipe as R
from tedebug.nn import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear
from tedebug.quantization import Float8CurrentScalingQuantizer, HybridQuantizer, MXFP8Quantizer

HIDDEN = 64
TOKENS = 64

RECIPES = {
    "delayed": R.DelayedScaling,
    "current": R.Float8CurrentScaling,
    "mxfp8": R.MXFP8BlockScaling,
    "nvfp4": lambda: R.NVFP4BlockScaling(seed=7),
    "block": R.Float8BlockScaling,
    "hybrid": lambda: R.CustomRecipe(
        lambda role: (
            HybridQuantizer(MXFP8Quantizer("E4M3"), Float8CurrentScalingQuantizer("E5M2"))
            if role in ("input", "weight", "grad_output")
            else None
        )
    ),
}

LAYERS = {
    "linear": lambda: Linear(HIDDEN, HIDDEN, name="layer"),
    "layernorm_linear": lambda: LayerNormLinear(HIDDEN, HIDDEN, name="layer"),
    "layernorm_mlp": lambda: LayerNormMLP(HIDDEN, 2 * HIDDEN, name="layer"),
    "grouped_linear": lambda: GroupedLinear(2, HIDDEN, HIDDEN, name="layer"),
}

ALL_TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def _logging_config(recipe_name):
    quantized = {
        "enabled": True,
        "stats": ["underflows%", "mse"],
        "tensors": ["activation", "weight", "gradient"],
        "start_step": 0,
        "end_step": 1,
    }
    block = {
        "LogTensorStats": {
            "enabled": True,
            "tensors": ALL_TENSORS,
            "start_step": 0,
            "end_step": 1,
            "stats": ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count"],
        }
    }
    if recipe_name == "nvfp4":
        block["LogNvfp4TensorStats"] = quantized
    else:
        block["LogFp8TensorStats"] = dict(quantized, stats=["underflows%", "mse", "mxfp8_mse"])
    return {"logging": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": block}}


FAKE_QUANT = {
    "fake": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "transformer_engine": {
            "FakeQuant": {
                "enabled": True,
                "gemms": ["fprop", "dgrad", "wgrad"],
                "tensors": ALL_TENSORS,
                "quant_format": "FP8E5M2",
            }
        },
    }
}


def _step(layer, recipe):
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    kwargs = {"m_splits": [TOKENS // 2, TOKENS // 2]} if isinstance(layer, GroupedLinear) else {}
    with tedebug.autocast(recipe=recipe):
        y = layer(x, **kwargs)
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for p in layer.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()


@pytest.mark.parametrize("config", ["none", "logging", "fake_quant"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_layer_recipe_config_runs(layer_name, recipe_name, config, tmp_path):
    torch.manual_seed(0)
    layer = LAYERS[layer_name]()
    recipe = RECIPES[recipe_name]()
    cfg = {"none": "", "logging": _logging_config(recipe_name), "fake_quant": FAKE_QUANT}[config]
    debug_api.initialize(cfg, log_dir=str(tmp_path), default_logging_enabled=True)
    try:
        for _ in range(3):
            _step(layer, recipe)
            debug_api.step()
    finally:
        debug_api.end_debug()
    stats_file = tmp_path / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log"
    text = stats_file.read_text() if stats_file.exists() else ""
    if config != "logging":
        assert "iteration=" not in text
        return
    # Both loggers are scheduled for iterations 0 and 1 only, on every GEMM of the layer.
    iterations = {int(i) for i in re.findall(r"iteration=(\d{6})", text)}
    assert iterations == {0, 1}
    gemm_names = {"layernorm_mlp": ["layer.fc1", "layer.fc2"], "grouped_linear": ["layer.gemm_0", "layer.gemm_1"]}
    for name in gemm_names.get(layer_name, ["layer"]):
        for tensor in ALL_TENSORS:
            assert f"{name}_{tensor}_std " in text or f"{name}_{tensor}_std\t" in text, (name, tensor)
        prefix = "nvfp4_" if recipe_name == "nvfp4" else ""
        assert f"{name}_activation_{prefix}underflows%" in text
