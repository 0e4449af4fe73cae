"""Built-in features: registration, parameter validation at config load, the shared helpers of the features
(FP8 statistic names, schedule options, reduction arguments, name sanitising)."""

import pytest

from tedebug import debug_api
from tedebug.config.errors import ConfigError
from tedebug.features.base import reduction_args, schedule_options
from tedebug.features.dump_tensors import sanitize_name
from tedebug.features.fp8_stat_names import parse_fp8_stat
from tedebug.registry import build_registry

from support.features import debug_session, section

BUILTIN = {
    "LogTensorStats",
    "LogFp8TensorStats",
    "LogNvfp4TensorStats",
    "DisableQuantizationGEMM",
    "DisableQuantizationLayer",
    "DisableFP8GEMM",
    "DisableFP8Layer",
    "PerTensorScaling",
    "FakeQuant",
    "DumpTensors",
}


def test_every_builtin_feature_is_registered_in_transformer_engine():
    registry = build_registry()
    assert set(registry.features["transformer_engine"]) == BUILTIN
    hooks = {name: registry.get("transformer_engine", name).hooks for name in BUILTIN}
    assert hooks["FakeQuant"] == ("fp8_gemm_enabled", "modify_tensor", "modify_tensor_enabled")
    assert hooks["PerTensorScaling"] == ("modify_tensor", "modify_tensor_enabled")
    assert hooks["DisableFP8GEMM"] == hooks["DisableQuantizationGEMM"] == ("fp8_gemm_enabled",)
    for name in ("LogTensorStats", "LogFp8TensorStats", "LogNvfp4TensorStats", "DumpTensors"):
        assert hooks[name] == ("inspect_tensor", "inspect_tensor_enabled")


def _load_error(features, tmp_path):
    with pytest.raises(ConfigError) as info:
        debug_api.initialize(section(features), log_dir=str(tmp_path))
    assert debug_api.DEBUG_MANAGER is None  # a failed load leaves nothing initialised
    return str(info.value)


@pytest.mark.parametrize(
    "features, expected",
    [
        (
            {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freqq": 2}},
            ["LogTensorStats -> freqq", "unknown key 'freqq'", "did you mean 'freq'"],
        ),
        ({"LogTensorStats": {"enabled": True, "tensors": ["activation"]}}, ["missing required parameter 'stats'"]),
        (
            {"LogTensorStats": {"enabled": True, "stats": ["max", "maxx"], "tensors": ["activation"]}},
            ["stats[1]", "Statistic maxx is not supported", "cur_amax"],
        ),
        (
            {
                "LogTensorStats": {
                    "enabled": True,
                    "tensors": ["activation"],
                    "stats": [{"max_blockwise_dynamic_range": {"block_size": 4, "dim": 1}}],
                }
            },
            ["unknown key(s) ['dim']"],
        ),
        (
            {"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "weight", "stat": ["max"]}]}},
            ["tensors_struct[0] -> stat", "did you mean 'stats'"],
        ),
        (
            {"LogFp8TensorStats": {"enabled": True, "stats": ["underflow%"], "tensors": ["activation"]}},
            ["stats[0]", "'underflow%' is not supported", "mxfp8_underflows%_columnwise"],
        ),
        (
            {"LogFp8TensorStats": {"enabled": True, "stats": ["nvfp4_mse"], "tensors": ["activation"]}},
            ["LogNvfp4TensorStats"],
        ),
        (
            {"LogFp8TensorStats": {"enabled": True, "stats": ["mxfp8_overflows%"], "tensors": ["activation"]}},
            ["overflows% exists only for the fp8_delayed_scaling recipe"],
        ),
        (
            {
                "LogFp8TensorStats": {
                    "enabled": True,
                    "stats": ["fp8_current_scaling_mse_columnwise"],
                    "tensors": ["activation"],
                }
            },
            ["'_columnwise' is not supported for the fp8_current_scaling recipe"],
        ),
        (
            {"LogNvfp4TensorStats": {"enabled": True, "stats": ["scale_inv_min"], "tensors": ["activation"]}},
            ["supported stats: ['underflows%', 'mse']"],
        ),
        (
            {"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}},
            ["missing required parameter 'quant_format'"],
        ),
        (
            {"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "quant_format": "FP8E4M4"}},
            ["unsupported quant_format 'FP8E4M4'", "MXFP8E5M2", "NVFP4"],
        ),
        (
            {
                "FakeQuant": {
                    "enabled": True,
                    "gemms_struct": [{"gemm": "fprop", "tensors": ["weight"], "quant_fromat": "FP8E4M3"}],
                }
            },
            ["gemms_struct[0] -> quant_fromat", "did you mean 'quant_format'"],
        ),
        (
            {"PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "margin": 1}},
            ["unknown key 'margin'"],
        ),
        (
            {"PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["output"]}},
            ["tensor 'output' cannot be scaled"],
        ),
        (
            {"DisableQuantizationGEMM": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}},
            ["unknown key 'tensors'"],
        ),
        (
            {"DisableQuantizationLayer": {"enabled": True, "gemms": ["fprop"]}},
            ["unknown key 'gemms'", "valid keys here: enabled, gemm"],
        ),
        (
            {"DumpTensors": {"enabled": True, "tensors": ["weight"], "high_precision_tensors": True}},
            ["did you mean 'high_precision_tensor'"],
        ),
        (
            {"DumpTensors": {"enabled": True, "tensors": ["weight"], "quantized_tensor": "yes"}},
            ["quantized_tensor must be true or false"],
        ),
        (
            {
                "LogTensorStats": {
                    "enabled": True,
                    "stats": ["max"],
                    "tensors": ["activation"],
                    "start_step": 5,
                    "end_step": 3,
                }
            },
            ["start_step 5 is after end_step 3"],
        ),
    ],
)
def test_bad_feature_parameters_fail_at_config_load(features, expected, tmp_path):
    message = _load_error(features, tmp_path)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_valid_configs_load_including_disabled_features_with_unknown_keys(tmp_path):
    features = {
        "LogTensorStats": {
            "enabled": True,
            "tensors_struct": [
                {
                    "tensor": "activation",
                    "stats": ["cur_amax", {"max_blockwise_dynamic_range": {"block_size": 4}}],
                    "freq": 3,
                    "start_step": 1,
                },
                {"tensor": "weight", "stats": ["nan_count", "inf_count"], "start_end_list": [[0, 3], [7, 9]]},
            ],
        },
        "LogFp8TensorStats": {
            "enabled": True,
            "tensors": "activation",
            "stats": [
                "underflows%",
                "mxfp8_scale_inv_std_columnwise",
                "fp8_block_scaling_mse",
                "fp8_delayed_scaling_overflows%",
                "scale_inv_std",
            ],
        },
        "FakeQuant": {
            "enabled": True,
            "gemms_struct": [{"gemm": "dgrad", "tensors": ["weight", "gradient"], "quant_format": "MXFP8E5M2"}],
        },
        "DumpTensors": {"enabled": False},
    }
    with debug_session(section(features), tmp_path) as te:
        # LogTensorStats (freq 3) is active; the next iteration is the minimum over both loggers
        assert te.inspect_tensor_enabled("a", tensor_name="activation", iteration=3) == (True, 4)


# ------------------------------------------------------------------------------------------------ grammar
@pytest.mark.parametrize(
    "name, recipe, stat, columnwise",
    [
        ("underflows%", None, "underflows%", False),
        ("mse_columnwise", None, "mse", True),
        ("mxfp8_scale_inv_min_columnwise", "mxfp8", "scale_inv_min", True),
        ("fp8_block_scaling_scale_inv_std", "fp8_block_scaling", "scale_inv_std", False),
        ("fp8_current_scaling_underflows%", "fp8_current_scaling", "underflows%", False),
        ("fp8_delayed_scaling_overflows%", "fp8_delayed_scaling", "overflows%", False),
        ("overflows%", None, "overflows%", False),
    ],
)
def test_fp8_stat_grammar(name, recipe, stat, columnwise):
    parsed = parse_fp8_stat(name)
    assert (parsed.name, parsed.recipe, parsed.stat, parsed.columnwise) == (name, recipe, stat, columnwise)
    assert parsed.usage == ("columnwise" if columnwise else "rowwise")


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("mxfp8_", "is not supported"),
        ("underflows%_mxfp8", "is not supported"),
        ("MSE", "is not supported"),
        ("nvfp4_underflows%", "LogNvfp4TensorStats"),
        ("fp8_delayed_scaling_mse_columnwise", "'_columnwise' is not supported"),
        ("fp8_block_scaling_overflows%", "overflows% exists only"),
        ("overflows%_columnwise", "is not supported"),
        (3, "must be a string"),
    ],
)
def test_fp8_stat_grammar_rejects(name, fragment):
    with pytest.raises(ValueError, match=None) as info:
        parse_fp8_stat(name)
    assert fragment in str(info.value)


# ------------------------------------------------------------------------------------------------ small helpers
def test_sanitize_name_replaces_every_unsafe_character():
    assert sanitize_name('a/b\\c:d*e?f"g<h>i|j k.l') == "a_b_c_d_e_f_g_h_i_j_k_l"
    assert sanitize_name("model.decoder.1.fc1") == "model_decoder_1_fc1"


def test_schedule_options_are_the_buffer_key_part():
    assert schedule_options({}) == (None, None, ())
    assert schedule_options({"start_step": 2, "end_step": 9, "freq": 3}) == (2, 9, ())
    assert schedule_options({"start_end_list": [[1, 2], [5, 8]]}) == (None, None, ((1, 2), (5, 8)))


def test_reduction_args_follow_the_weight_rule(tmp_path):
    """(reduction_group, skip_reduction, is_weight): activations and gradients over the session's group; a weight
    over its TP group only when the layer is split, has a group and weight reduction is on."""
    group = object()
    with debug_session(section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": "weight"}}), tmp_path):
        session = debug_api.session()
        session.reduction_group = "debug-group"
        assert reduction_args(session, "activation", group, 4) == ("debug-group", False, False)
        assert reduction_args(session, "gradient", None, 1) == ("debug-group", False, False)
        assert reduction_args(session, "weight", group, 4) == (group, False, True)
        assert reduction_args(session, "weight", None, 4) == (None, True, True)  # TP>1 without a group
        assert reduction_args(session, "weight", group, 1) == (None, True, True)
        assert reduction_args(session, "weight", group, None) == (None, True, True)
        session.weight_tensor_tp_group_reduce = False
        assert reduction_args(session, "weight", group, 4) == (None, True, True)
