"""A feature block without the GEMM / tensor selection its hooks parse is a config error at load time (it used to
pass validation and fail at the first forward with a message naming no file, section or feature)."""

import pytest

from tedebug import debug_api
from tedebug.config import ConfigError


def _config(feature, block):
    return {
        "sec": {
            "enabled": True,
            "layers": {"layer_types": ["fc1"]},
            "transformer_engine": {feature: dict({"enabled": True}, **block)},
        }
    }


@pytest.mark.parametrize(
    "feature, block, message",
    [
        ("LogTensorStats", {"stats": ["max"]}, "provide 'tensors: [...]' or 'tensors_struct: [...]'"),
        ("LogFp8TensorStats", {"stats": ["underflows%"]}, "provide 'tensors: [...]'"),
        ("DumpTensors", {"high_precision_tensor": True}, "provide 'tensors: [...]'"),
        ("DisableQuantizationGEMM", {}, "provide 'gemms: [...]' or 'gemms_struct: [...]'"),
        ("FakeQuant", {"tensors": ["activation"], "quant_format": "FP8E4M3"}, "provide 'gemms: [...]'"),
        ("FakeQuant", {"gemms": ["fprop"], "quant_format": "FP8E4M3"}, "provide 'tensors: [...]'"),
        (
            "PerTensorScaling",
            {"gemms_struct": [{"gemm": "fprop"}]},
            "gemms_struct entry of gemm 'fprop' lists no tensors",
        ),
    ],
)
def test_missing_selection_is_a_load_error(feature, block, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        debug_api.initialize(_config(feature, block), log_dir=str(tmp_path))
    text = str(err.value)
    assert message in text and f"sec' -> transformer_engine -> {feature}" in text
    assert debug_api.DEBUG_MANAGER is None  # nothing half-initialised


@pytest.mark.parametrize(
    "feature, block",
    [
        ("LogTensorStats", {"stats": ["max"], "tensors_struct": [{"tensor": "activation"}]}),
        ("DisableQuantizationGEMM", {"gemms": ["wgrad"]}),
        ("DisableQuantizationLayer", {}),
        ("PerTensorScaling", {"gemms_struct": [{"gemm": "fprop", "tensors": ["activation"]}]}),
    ],
)
def test_complete_selections_load(feature, block, tmp_path):
    debug_api.initialize(_config(feature, block), log_dir=str(tmp_path))
    debug_api.end_debug()
