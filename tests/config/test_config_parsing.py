"""Feature-config parsing (gemms / gemms_struct / tensors / tensors_struct into the config of one hook call): the exact
dicts of nvdlfw's test_config_parsing and TE's test_transformer_engine_config_parsing, plus precedence, copies and
the error texts."""

import copy
import pathlib

import pytest

from tedebug.config import load_config, parse_feature_config

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
FEATURE_NAMES = {
    "transformer_engine": {
        "LogTensorStats",
        "LogFp8TensorStats",
        "FakeQuant",
        "PerTensorScaling",
        "DisableFP8GEMM",
        "DisableQuantizationGEMM",
        "DisableFP8Layer",
        "DisableQuantizationLayer",
        "DumpTensors",
        "LogNvfp4TensorStats",
    },
    "base": {"LogTensorStats"},
}


def gemm_and_tensor(cfg, gemm, tensor):
    return parse_feature_config(cfg, gemm=gemm, tensor_name=tensor, gemm_parsing=True, tensor_parsing=True)


def tensor_only(cfg, tensor):
    return parse_feature_config(cfg, tensor_name=tensor, gemm_parsing=False, tensor_parsing=True)


# ---- nvdlfw test_config_parsing (from YAML and from the same dict) -----------------------------------------


def _check_nvdlfw_parsing(config):
    base = config.layer_config("decoder.1.mlp.fc1")["base"]["LogTensorStats"]
    assert tensor_only(base, "activation") == {
        "tensor": "activation",
        "stats": ["mean", "std"],
        "freq": 2,
        "start_step": 5,
        "end_step": 100,
    }
    assert tensor_only(base, "gradient") == {"tensor": "gradient", "stats": ["l1_norm"]}
    assert tensor_only(base, "weight") is None
    te = config.layer_config("decoder.3.mlp.fc1")["transformer_engine"]
    assert tensor_only(te["LogTensorStats"], "activation") == {
        "tensor": "activation",
        "stats": ["cur_amax", "dynamic_range"],
        "freq": 2,
        "start_step": 100,
        "end_step": 500,
    }
    assert tensor_only(te["LogTensorStats"], "gradient") is None
    assert tensor_only(te["LogFp8TensorStats"], "gradient") == {
        "tensor": "gradient",
        "stats": ["underflows%"],
        "freq": 5,
        "start_step": 100,
        "end_step": 500,
    }
    layer6 = config.layer_config("decoder.6.mlp.fc1")["transformer_engine"]["LogTensorStats"]
    assert tensor_only(layer6, "weight") == {
        "tensor": "weight",
        "stats": ["mean", "std", "l1_norm", "min", "max"],
        "freq": 5,
        "start_step": 100,
        "end_step": 500,
    }
    layer5 = config.layer_config("decoder.5.mlp.fc1")["transformer_engine"]["LogTensorStats"]
    assert tensor_only(layer5, "activation")["stats"][-1] == {
        "max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}
    }


def test_nvdlfw_config_parsing_yaml():
    _check_nvdlfw_parsing(load_config(CONFIGS / "stats_collection_test_config.yaml", feature_names=FEATURE_NAMES))


def test_nvdlfw_config_parsing_dict():
    import yaml

    raw = yaml.safe_load((CONFIGS / "stats_collection_test_config.yaml").read_text())
    _check_nvdlfw_parsing(load_config(raw, feature_names=FEATURE_NAMES))


# ---- TE test_transformer_engine_config_parsing -------------------------------------------------------------


def test_transformer_engine_config_parsing():
    config = load_config(CONFIGS / "tensor_manipulation_transformer_engine.yaml", feature_names=FEATURE_NAMES)
    fc1 = config.layer_config("decoder.1.mlp.fc1")["transformer_engine"]
    fc2 = config.layer_config("decoder.1.mlp.fc2")["transformer_engine"]

    pts = fc1["PerTensorScaling"]
    assert gemm_and_tensor(pts, "wgrad", "activation") is None
    assert gemm_and_tensor(pts, "dgrad", "activation") is None
    assert gemm_and_tensor(pts, "dgrad", "gradient") == {"gemm": "dgrad", "tensor": "gradient"}

    for tensor in ("activation", "weight"):
        assert gemm_and_tensor(fc1["FakeQuant"], "fprop", tensor) == {
            "gemm": "fprop",
            "tensor": tensor,
            "quant_format": "FP8E4M3",
        }
    assert gemm_and_tensor(fc1["FakeQuant"], "fprop", "gradient") is None
    assert gemm_and_tensor(fc1["FakeQuant"], "dgrad", "activation") is None

    for tensor in ("gradient", "weight"):
        assert gemm_and_tensor(fc2["FakeQuant"], "dgrad", tensor) == {
            "gemm": "dgrad",
            "tensor": tensor,
            "quant_format": "FP8E5M2",
        }
    assert gemm_and_tensor(fc2["FakeQuant"], "dgrad", "activation") is None

    for gemm, tensor in [("fprop", "activation"), ("fprop", "weight"), ("wgrad", "activation"), ("wgrad", "gradient")]:
        assert gemm_and_tensor(fc2["PerTensorScaling"], gemm, tensor) == {"gemm": gemm, "tensor": tensor}
    assert gemm_and_tensor(fc2["PerTensorScaling"], "fprop", "gradient") is None
    assert gemm_and_tensor(fc2["PerTensorScaling"], "dgrad", "gradient") is None

    gemm_only = parse_feature_config(fc1["DisableFP8GEMM"], gemm="fprop", gemm_parsing=True, tensor_parsing=False)
    assert gemm_only == {"gemm": "fprop"}
    assert parse_feature_config(fc1["DisableFP8GEMM"], gemm="wgrad", gemm_parsing=True, tensor_parsing=False) is None


# ---- precedence and details --------------------------------------------------------------------------------


def test_struct_beats_list_and_first_entry_wins():
    cfg = {
        "enabled": True,
        "stats": ["max"],
        "freq": 1,
        "tensors": ["weight"],
        "tensors_struct": [{"tensor": "activation", "freq": 3}, {"tensor": "activation", "freq": 7}],
    }
    assert tensor_only(cfg, "activation") == {
        "tensor": "activation",
        "stats": ["max"],
        "freq": 3,
        "tensors": ["weight"],
    }
    assert tensor_only(cfg, "weight") is None  # tensors_struct has priority over tensors


def test_first_matching_gemm_entry_decides_even_if_tensor_is_missing():
    cfg = {
        "enabled": True,
        "gemms_struct": [
            {"gemm": "fprop", "tensors": ["weight"]},
            {"gemm": "fprop", "tensors": ["activation"], "x": 1},
        ],
    }
    assert gemm_and_tensor(cfg, "fprop", "activation") is None
    assert gemm_and_tensor(cfg, "fprop", "weight") == {"gemm": "fprop", "tensor": "weight"}


def test_gemm_entry_keys_override_outer_keys_and_gemms_struct_beats_gemms():
    cfg = {
        "enabled": True,
        "quant_format": "FP8E4M3",
        "gemms": ["wgrad"],
        "gemms_struct": [
            {
                "gemm": "dgrad",
                "quant_format": "FP8E5M2",
                "tensors_struct": [{"tensor": "gradient", "quant_format": "MXFP8E4M3"}],
            }
        ],
    }
    assert gemm_and_tensor(cfg, "dgrad", "gradient") == {
        "gemm": "dgrad",
        "tensor": "gradient",
        "quant_format": "MXFP8E4M3",
        "gemms": ["wgrad"],
    }
    assert gemm_and_tensor(cfg, "wgrad", "gradient") is None


def test_scalar_tensors_matches_the_name_exactly():
    cfg = {"enabled": True, "tensors": "activation", "stats": ["underflows%"]}
    assert tensor_only(cfg, "activation") == {"tensor": "activation", "stats": ["underflows%"]}
    for other in ("weight", "gradient", "output", "wgrad", "dgrad"):
        assert tensor_only(cfg, other) is None
    assert tensor_only({"enabled": True, "tensors": "activation"}, "act") is None  # not substring containment


def test_no_parsing_requested_means_not_applicable():
    cfg = {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}
    assert (
        parse_feature_config(cfg, gemm="fprop", tensor_name="activation", gemm_parsing=False, tensor_parsing=False)
        is None
    )


def test_result_never_aliases_the_config():
    cfg = {
        "enabled": True,
        "stats": [{"max_blockwise_dynamic_range": {"block_size": 4}}],
        "gemms_struct": [{"gemm": "fprop", "tensors_struct": [{"tensor": "weight", "extra": [1, 2]}]}],
    }
    before = copy.deepcopy(cfg)
    result = gemm_and_tensor(cfg, "fprop", "weight")
    assert result == {
        "gemm": "fprop",
        "tensor": "weight",
        "extra": [1, 2],
        "stats": [{"max_blockwise_dynamic_range": {"block_size": 4}}],
    }
    result["extra"].append(3)
    result["stats"][0]["max_blockwise_dynamic_range"]["block_size"] = 99
    assert cfg == before
    assert "enabled" in cfg  # only the result loses 'enabled'


def test_missing_specs_raise_the_reference_texts():
    with pytest.raises(ValueError, match=r"Provide 'gemms_struct: List\[Dict\]' or 'gemms: List\[str\]'"):
        gemm_and_tensor({"enabled": True, "tensors": ["weight"]}, "fprop", "weight")
    with pytest.raises(ValueError, match=r"Provide 'tensors_struct: List\[Dict\]' or 'tensors: List\[str\]'"):
        tensor_only({"enabled": True, "stats": ["max"]}, "weight")
    with pytest.raises(ValueError, match=r"Provide 'tensors_struct"):  # tensors must be inside the gemm entry
        gemm_and_tensor(
            {"enabled": True, "tensors": ["weight"], "gemms_struct": [{"gemm": "fprop"}]}, "fprop", "weight"
        )


def test_runtime_checks_for_unvalidated_configs():
    with pytest.raises(ValueError, match="Invalid gemm: 'fprp'"):
        gemm_and_tensor({"enabled": True, "gemms": ["fprp"], "tensors": ["weight"]}, "fprop", "weight")
    with pytest.raises(ValueError, match="Invalid gemm: 'bad'"):
        gemm_and_tensor(
            {"enabled": True, "gemms_struct": [{"gemm": "fprop", "tensors": ["weight"]}, {"gemm": "bad"}]},
            "fprop",
            "weight",
        )
    with pytest.raises(ValueError, match="'enabled' is not allowed inside a gemms_struct entry"):
        gemm_and_tensor(
            {"enabled": True, "gemms_struct": [{"gemm": "fprop", "enabled": True, "tensors": ["weight"]}]},
            "fprop",
            "weight",
        )
    with pytest.raises(TypeError, match="feature config must be a dict"):
        tensor_only(["tensors"], "weight")
