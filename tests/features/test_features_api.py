"""Hook answers of the built-in features, called directly like TransformerEngine's test_api_features.py (no model),
plus the statistics-collection ports (values read back from a recording sink)."""

import math
import os
import warnings

import pytest
import torch

from tedebug import debug_api
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

from support.features import RecordingSink, debug_session, section

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def test_no_config_gives_the_defaults(tmp_path):
    with debug_session("", tmp_path) as te:
        for gemm in ("fprop", "dgrad", "wgrad"):
            assert te.fp8_gemm_enabled("decoder.1.attn.qkv", gemm=gemm, iteration=0)[0] is True
            assert (
                te.modify_tensor_enabled("decoder.1.attn.qkv", gemm=gemm, tensor_name="activation", iteration=0)[0]
                is False
            )
        assert te.inspect_tensor_enabled("decoder.1.attn.qkv", tensor_name="activation", iteration=0)[0] is False


@pytest.mark.parametrize("feature", ["DisableQuantizationGEMM", "DisableFP8GEMM"])
def test_disable_quantization_gemm(feature, tmp_path):
    config = section({feature: {"enabled": True, "gemms": ["dgrad", "wgrad"]}}, layer_types=["qkv"])
    with warnings.catch_warnings(record=True) as caught, debug_session(config, tmp_path) as te:
        warnings.simplefilter("always")
        for _ in range(2):  # the second round is answered from the routing cache
            assert te.fp8_gemm_enabled("decoder.1.attn.qkv", gemm="fprop", iteration=7) == (True, None)
            assert te.fp8_gemm_enabled("decoder.1.attn.qkv", gemm="dgrad", iteration=7) == (False, 8)
            assert te.fp8_gemm_enabled("decoder.1.attn.qkv", gemm="wgrad", iteration=7) == (False, 8)
            assert te.fp8_gemm_enabled("decoder.1.fc1", gemm="wgrad", iteration=7) == (True, None)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == (1 if feature == "DisableFP8GEMM" else 0)
    if deprecations:
        assert "DisableQuantizationGEMM" in str(deprecations[0].message)


@pytest.mark.parametrize("feature", ["DisableQuantizationLayer", "DisableFP8Layer"])
def test_disable_quantization_layer(feature, tmp_path):
    config = section({feature: {"enabled": True}}, layer_types=["qkv"])
    with warnings.catch_warnings(record=True) as caught, debug_session(config, tmp_path) as te:
        warnings.simplefilter("always")
        for gemm in ("fprop", "dgrad", "wgrad"):
            assert te.fp8_gemm_enabled("decoder.1.fc1", gemm=gemm, iteration=3) == (True, None)
            assert te.fp8_gemm_enabled("decoder.1.attn.qkv", gemm=gemm, iteration=3) == (False, 4)
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == (
        1 if feature == "DisableFP8Layer" else 0
    )
    main_log = open(os.path.join(tmp_path, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log")).read()
    assert main_log.count("LAYER=decoder.1.attn.qkv: Quantization Disabled") == 1


PER_TENSOR_SCALING = section(
    {
        "PerTensorScaling": {
            "enabled": True,
            "gemms_struct": [
                {"gemm": "fprop", "tensors_struct": [{"tensor": "activation"}, {"tensor": "weight"}]},
                {"gemm": "dgrad", "tensors": ["gradient"]},
            ],
        }
    },
    layer_types=["qkv"],
)


def test_per_tensor_scaling_routing_and_result(tmp_path):
    with debug_session(PER_TENSOR_SCALING, tmp_path) as te:
        layer = "decoder.1.attn.qkv"
        for gemm, tensor in (("fprop", "activation"), ("fprop", "weight"), ("dgrad", "gradient")):
            assert te.modify_tensor_enabled(layer, gemm=gemm, tensor_name=tensor, iteration=5) == (True, 6)
        for gemm, tensor in (("dgrad", "weight"), ("wgrad", "gradient"), ("wgrad", "activation")):
            assert te.modify_tensor_enabled(layer, gemm=gemm, tensor_name=tensor, iteration=5) == (False, None)
        assert te.modify_tensor_enabled("decoder.1.fc4", gemm="fprop", tensor_name="activation", iteration=5) == (
            False,
            None,
        )
        x = torch.randn(32, 64) * 3
        for fmt, tensor in (("E4M3", "activation"), ("E5M2", "gradient")):
            gemm = "fprop" if tensor == "activation" else "dgrad"
            default = Float8Quantizer.from_recipe_defaults(fmt)
            result = te.modify_tensor(
                layer, gemm=gemm, tensor_name=tensor, tensor=x, default_quantizer=default, iteration=5
            )
            assert isinstance(result, Float8Tensor) and result.fp8_format == fmt
            expected = Float8CurrentScalingQuantizer(fmt).quantize(x)
            assert torch.equal(result.rowwise_data, expected.rowwise_data)
            assert torch.equal(result.columnwise_data, expected.columnwise_data)
            assert result.scale_inv.item() == torch.tensor(1.0) / (torch.tensor(FP8_MAX[fmt]) / x.abs().max())
            assert default.amax_history.abs().sum().item() == 0  # the layer quantizer is not used


FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}


def test_per_tensor_scaling_out_and_errors(tmp_path):
    from tedebug.quantization.mxfp8 import MXFP8Quantizer

    with debug_session(PER_TENSOR_SCALING, tmp_path) as te:
        layer = "decoder.1.attn.qkv"
        x = torch.randn(16, 32)
        default = Float8CurrentScalingQuantizer("E4M3", force_pow_2_scales=True)
        out = default.quantize(torch.zeros(16, 32))
        kwargs = dict(gemm="fprop", tensor_name="weight", tensor=x, iteration=0)
        assert te.modify_tensor(layer, default_quantizer=default, out=out, **kwargs) is None
        expected = Float8CurrentScalingQuantizer("E4M3").quantize(x)  # no power-of-two rounding
        assert torch.equal(out.rowwise_data, expected.rowwise_data)
        assert out.scale_inv.item() == expected.scale_inv.item()
        with pytest.raises(ValueError, match="recipe 'mxfp8'"):
            te.modify_tensor(layer, default_quantizer=MXFP8Quantizer(), **kwargs)
        with pytest.raises(ValueError, match="no quantizer"):
            te.modify_tensor(layer, default_quantizer=None, **kwargs)
        bf16 = te.modify_tensor(layer, default_quantizer=default, dtype=torch.bfloat16, **kwargs)
        assert bf16.dtype == torch.bfloat16
        assert torch.equal(bf16.rowwise_data, Float8CurrentScalingQuantizer("E4M3").quantize(x.bfloat16()).rowwise_data)


def test_fake_quant_routing(tmp_path):
    config = section(
        {
            "FakeQuant": {
                "enabled": True,
                "gemms_struct": [
                    {"gemm": "fprop", "tensors_struct": [{"tensor": "activation", "quant_format": "FP8E4M3"}]},
                    {"gemm": "dgrad", "tensors_struct": [{"tensor": "gradient", "quant_format": "FP8E5M2"}]},
                ],
            }
        },
        layer_types=["fc1"],
    )
    with debug_session(config, tmp_path) as te:
        layer = "decoder.1.mlp.fc1"
        assert te.modify_tensor_enabled(layer, gemm="fprop", tensor_name="activation", iteration=0) == (True, 1)
        assert te.modify_tensor_enabled(layer, gemm="dgrad", tensor_name="gradient", iteration=0) == (True, 1)
        assert te.modify_tensor_enabled(layer, gemm="dgrad", tensor_name="activation", iteration=0) == (False, None)
        x = torch.randn(8, 16)
        y = te.modify_tensor(
            layer, gemm="fprop", tensor_name="activation", tensor=x, default_quantizer=None, iteration=0
        )
        scale = torch.tensor(448.0) / x.abs().max()
        expected = (x * scale).to(torch.float8_e4m3fn).float() * (torch.tensor(1.0) / scale)
        assert torch.equal(y, expected)
        for _ in range(2):
            assert te.fp8_gemm_enabled(layer, gemm="wgrad", iteration=0)[0] is True
            assert te.fp8_gemm_enabled(layer, gemm="fprop", iteration=0) == (False, 1)


# ------------------------------------------------------------------------------------------------ statistics ports
def _collection_session(tmp_path, sink):
    debug_api.initialize(
        os.path.join(CONFIGS, "stats_collection_test_config.yaml"), statistics_logger=sink, log_dir=str(tmp_path)
    )
    debug_api.initialize_training_step(200)
    return debug_api.transformer_engine


def test_statistics_collection(tmp_path):
    sink = RecordingSink()
    te = _collection_session(tmp_path, sink)
    try:
        torch.manual_seed(0)
        x = torch.randn(64, 128) * 5
        x[0, :7] = 0.0
        x[1, :5] = 1e-9  # underflows in E5M2 with the delayed scale 1
        assert te.inspect_tensor_enabled("decoder.1.mlp.fc1", tensor_name="activation", iteration=200) == (True, 202)
        te.inspect_tensor("decoder.1.mlp.fc1", tensor=x, tensor_name="activation", iteration=200, tp_group=None)
        assert te.inspect_tensor_enabled("decoder.1.mlp.fc1", tensor_name="activation", iteration=201)[0] is False
        assert te.inspect_tensor_enabled("decoder.2.mlp.fc1", tensor_name="activation", iteration=200)[0] is False
        assert te.inspect_tensor_enabled("decoder.1.mlp.fc1", tensor_name="gradient", iteration=200) == (True, 205)
        quantizer = Float8Quantizer.from_recipe_defaults("E5M2")
        q = quantizer.quantize(x)
        te.inspect_tensor(
            "decoder.1.mlp.fc1",
            tensor=x,
            tensor_name="gradient",
            iteration=200,
            tp_group=None,
            rowwise_quantized_tensor=q,
            columnwise_quantized_tensor=q,
            quantizer=quantizer,
        )
        te.inspect_tensor("decoder.6.mlp.fc1", tensor=x, tensor_name="activation", iteration=200, tp_group=None)
        te.inspect_tensor("decoder.7.mlp.fc1", tensor=x, tensor_name="weight", iteration=200, tp_group=None)
        debug_api.step()
        values = sink.values()
        assert values[("decoder.1.mlp.fc1_activation_cur_amax", 200)] == x.abs().max().item()
        nz = x.abs()[x != 0]
        assert values[("decoder.1.mlp.fc1_activation_dynamic_range", 200)] == pytest.approx(
            math.log2(nz.max().item()) - math.log2(nz.min().item()), abs=1e-12
        )
        deq = q.dequantize()
        underflows = ((deq == 0).sum() - (x == 0).sum()).item() * 100 / x.numel()
        assert underflows > 0
        assert values[("decoder.1.mlp.fc1_gradient_underflows%", 200)] == pytest.approx(underflows, abs=1e-12)
        assert values[("decoder.6.mlp.fc1_activation_mean", 200)] == pytest.approx(x.double().mean().item(), abs=1e-12)
        assert values[("decoder.7.mlp.fc1_weight_max", 200)] == x.max().item()
        assert len(values) == 2 + 1 + 5 + 5
        sink.rows.clear()
        debug_api.step()
        assert sink.rows == []  # nothing fed: nothing emitted
    finally:
        debug_api.end_debug()


def test_statistics_multi_run_equals_concatenation(tmp_path):
    torch.manual_seed(1)
    a, b = torch.randn(32, 64) * 2, torch.randn(48, 64) * 0.01
    results = []
    for feeds in ([a, b], [torch.cat([a, b])]):
        sink = RecordingSink()
        features = {
            "LogTensorStats": {
                "enabled": True,
                "tensors": ["activation"],
                "stats": ["cur_amax", "dynamic_range", "mean", "std", "l1_norm", "l2_norm", "min"],
            },
            "LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%", "mse"]},
        }
        with debug_session(section(features), tmp_path, sink) as te:
            quantizer = Float8CurrentScalingQuantizer("E4M3")
            q_full = quantizer.quantize(torch.cat([a, b]))
            for x in feeds:
                # the same scale for both parts, so that partial underflows add up to the concatenation's
                q = Float8Quantizer(torch.tensor(1.0) / q_full.scale_inv, torch.zeros(1), "E4M3").quantize(x)
                te.inspect_tensor(
                    "layer",
                    tensor=x,
                    tensor_name="activation",
                    iteration=0,
                    tp_group=None,
                    rowwise_quantized_tensor=q,
                    columnwise_quantized_tensor=q,
                    quantizer=quantizer,
                )
            debug_api.step()
        results.append(sink.values())
    split, whole = results
    assert split.keys() == whole.keys() and len(split) == 9
    for key in whole:
        assert split[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-15), key
    full = torch.cat([a, b]).double()
    assert whole[("layer_activation_std", 0)] == pytest.approx(full.std().item(), rel=1e-12)


def test_zero_numel_tensors_log_nothing_and_do_not_crash(tmp_path):
    sink = RecordingSink()
    stats = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
    tensors = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
    with debug_session(
        section({"LogTensorStats": {"enabled": True, "stats": stats, "tensors": tensors}}), tmp_path, sink
    ) as te:
        for name in tensors:
            te.inspect_tensor("layer", tensor=torch.empty(0, 16), tensor_name=name, iteration=0, tp_group=None)
        te.inspect_tensor("layer", tensor=torch.ones(2, 16), tensor_name="activation", iteration=0, tp_group=None)
        debug_api.step()
    assert sorted(n for n, _, _ in sink.rows) == sorted(f"layer_activation_{s}" for s in stats)


def test_log_tensor_stats_blockwise_orientation_and_quantized_rules(tmp_path):
    sink = RecordingSink()
    block = {"max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}}
    config = section(
        {
            "LogTensorStats": {
                "enabled": True,
                "stats": ["dynamic_range", block],
                "tensors": ["activation", "gradient", "weight"],
            }
        }
    )
    x = torch.full((8, 8), 1e-10)
    x[0] = 1000.0
    x[1:4] = 50.0
    with debug_session(config, tmp_path, sink) as te:
        for name in ("activation", "gradient"):
            te.inspect_tensor("l", tensor=x, tensor_name=name, iteration=0, tp_group=None)
        # weight without a high-precision copy: the rowwise quantized tensor is dequantized
        wq = Float8CurrentScalingQuantizer("E4M3").quantize(x)
        te.inspect_tensor(
            "l",
            tensor=None,
            tensor_name="weight",
            iteration=0,
            tp_group=None,
            rowwise_quantized_tensor=wq,
            columnwise_quantized_tensor=wq,
        )
        with pytest.raises(ValueError, match="must be in high precision.*LogFp8TensorStats"):
            te.inspect_tensor("l", tensor=wq, tensor_name="activation", iteration=0, tp_group=None)
        with pytest.raises(ValueError, match="must be in high precision"):
            te.inspect_tensor(
                "l", tensor=torch.zeros(4, 4, dtype=torch.uint8), tensor_name="activation", iteration=0, tp_group=None
            )
        debug_api.step()
    values = sink.values()
    assert values[("l_activation_dynamic_range", 0)] == pytest.approx(
        math.log2(1000.0) - math.log2(torch.tensor(1e-10).item()), abs=1e-9
    )
    # rows: blocks of 4 along a row are uniform -> 0; columns (orientation) see 1000 vs 50 -> log2(20)
    assert values[
        ("l_activation_max_blockwise_dynamic_range_block_size_4_dims_1_max_over_orientations", 0)
    ] == pytest.approx(math.log2(1000.0 / 50.0), abs=1e-12)
    assert values[("l_gradient_max_blockwise_dynamic_range_block_size_4_dims_1", 0)] == 0.0
    wdeq = wq.dequantize().abs()
    wnz = wdeq[wdeq != 0]
    assert values[("l_weight_dynamic_range", 0)] == pytest.approx(
        math.log2(wnz.max().item()) - math.log2(wnz.min().item()), abs=1e-12
    )


def test_nan_and_inf_counts_and_the_first_non_finite_report(tmp_path):
    sink = RecordingSink()
    config = section(
        {"LogTensorStats": {"enabled": True, "stats": ["nan_count", "inf_count", "max"], "tensors": ["gradient"]}}
    )
    x = torch.ones(4, 8)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), float("-inf")
    with debug_session(config, tmp_path, sink) as te:
        debug_api.initialize_training_step(9)
        te.inspect_tensor("L", tensor=torch.ones(4, 8), tensor_name="gradient", iteration=9, tp_group=None)
        debug_api.step()
        te.inspect_tensor("L", tensor=x, tensor_name="gradient", iteration=10, tp_group=None)
        te.inspect_tensor("L", tensor=x, tensor_name="gradient", iteration=10, tp_group=None)
        debug_api.step()
        log = open(os.path.join(tmp_path, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log")).read()
    values = sink.values()
    assert values[("L_gradient_nan_count", 9)] == 0 and values[("L_gradient_inf_count", 9)] == 0
    assert values[("L_gradient_nan_count", 10)] == 2 and values[("L_gradient_inf_count", 10)] == 4
    assert log.count("First non-finite values") == 1
    assert "layer=L tensor=gradient gemm=dgrad/wgrad iteration=10" in log
