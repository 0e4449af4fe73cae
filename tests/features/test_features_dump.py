"""DumpTensors: file layout, contents, flags, schedule and the different-operands error."""

import hashlib
import os

import pytest
import torch

from tedebug import debug_api
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer
from tedebug.quantization.hybrid import HybridQuantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer

from support.features import debug_session, section


def dump_config(**params):
    return section({"DumpTensors": {"enabled": True, "tensors": ["activation", "weight"], **params}})


def test_dump_layout_and_contents(tmp_path):
    x = torch.randn(16, 32)
    quantizer = Float8CurrentScalingQuantizer("E4M3")
    q = quantizer.quantize(x)
    with debug_session(dump_config(high_precision_tensor=True, quantized_tensor=True), tmp_path) as te:
        assert te.inspect_tensor_enabled("test_layer", tensor_name="activation", iteration=0) == (True, 1)
        te.inspect_tensor(
            "test_layer",
            tensor=x,
            tensor_name="activation",
            iteration=0,
            tp_group=None,
            rowwise_quantized_tensor=q,
            columnwise_quantized_tensor=q,
            quantizer=quantizer,
        )
    root = tmp_path / "tensor_dumps"
    assert sorted(os.listdir(root)) == ["rank_0"]
    assert sorted(os.listdir(root / "rank_0")) == ["iter_000000"]
    assert sorted(os.listdir(root / "rank_0" / "iter_000000")) == ["test_layer_activation.pt"]
    data = torch.load(root / "rank_0" / "iter_000000" / "test_layer_activation.pt", weights_only=True)
    assert set(data) == {"high_precision", "quantized"}
    assert torch.equal(data["high_precision"], x)
    dumped = data["quantized"]
    assert set(dumped) == {
        "format",
        "shape",
        "dtype",
        "fp8_format",
        "rowwise_data",
        "columnwise_data",
        "scale_inv",
        "dequantized",
    }
    assert (dumped["format"], dumped["shape"], dumped["dtype"], dumped["fp8_format"]) == (
        "Float8Tensor",
        [16, 32],
        "float32",
        "E4M3",
    )
    assert torch.equal(dumped["rowwise_data"], q.rowwise_data) and torch.equal(dumped["scale_inv"], q.scale_inv)
    assert torch.equal(dumped["dequantized"], q.dequantize())
    x.add_(1.0)  # the dump was a clone
    assert not torch.equal(data["high_precision"], x)


def test_dump_flags_names_and_overwrite(tmp_path):
    x = torch.randn(32, 32)
    hybrid = HybridQuantizer(MXFP8Quantizer("E4M3"), Float8CurrentScalingQuantizer("E5M2"))
    hq = hybrid.quantize(x)
    with debug_session(dump_config(quantized_tensor=True, start_step=2, freq=2), tmp_path) as te:
        assert te.inspect_tensor_enabled("m.dec/0", tensor_name="weight", iteration=3) == (False, 4)
        for _ in range(2):
            te.inspect_tensor(
                "m.dec/0 x",
                tensor=x,
                tensor_name="weight",
                iteration=12,
                tp_group=None,
                rowwise_quantized_tensor=hq,
                columnwise_quantized_tensor=hq,
                quantizer=hybrid,
            )
        te.inspect_tensor(
            "hp",
            tensor=x,
            tensor_name="weight",
            iteration=12,
            tp_group=None,
            rowwise_quantized_tensor=x,
            columnwise_quantized_tensor=x,
            quantizer=None,
        )
        log = open(tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read()
    folder = tmp_path / "tensor_dumps" / "rank_0" / "iter_000012"
    assert sorted(os.listdir(folder)) == ["hp_weight.pt", "m_dec_0_x_weight.pt"]
    data = torch.load(folder / "m_dec_0_x_weight.pt", weights_only=True)
    assert set(data) == {"quantized"}
    dumped = data["quantized"]
    assert dumped["format"] == type(hq).__name__ == "HybridQuantizedTensor"
    assert dumped["columnwise_sub_storage"]["format"] == "Float8Tensor"
    assert torch.equal(dumped["columnwise_sub_storage"]["columnwise_data"], hq.columnwise_sub_storage.columnwise_data)
    assert torch.equal(dumped["rowwise_sub_storage"]["rowwise_data"], hq.rowwise_sub_storage.rowwise_data)
    assert dumped["rowwise_sub_storage"]["rowwise_data"].data_ptr() != hq.rowwise_sub_storage.rowwise_data.data_ptr()
    assert torch.equal(dumped["dequantized"], hq.dequantize())
    assert torch.equal(torch.load(folder / "hp_weight.pt", weights_only=True)["quantized"], x)  # high precision
    assert log.count("overwriting existing dump") == 1


def test_dump_nothing_without_flags_and_error_for_different_operands(tmp_path):
    x = torch.randn(32, 32)
    q1 = MXFP8Quantizer("E4M3").quantize(x)
    with debug_session(dump_config(), tmp_path) as te:
        te.inspect_tensor(
            "L",
            tensor=x,
            tensor_name="activation",
            iteration=0,
            tp_group=None,
            rowwise_quantized_tensor=q1,
            columnwise_quantized_tensor=q1,
        )
        assert not (tmp_path / "tensor_dumps").exists()
        with pytest.raises(ValueError, match="different objects"):
            te.inspect_tensor(
                "L",
                tensor=x,
                tensor_name="activation",
                iteration=0,
                tp_group=None,
                rowwise_quantized_tensor=x,
                columnwise_quantized_tensor=q1,
            )
        log = open(tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read()
    assert "neither high_precision_tensor nor quantized_tensor is set" in log
    assert debug_api.DEBUG_MANAGER is None


def test_hostile_layer_names_get_safe_distinct_bounded_file_names(tmp_path):
    x = torch.randn(4, 4)
    names = ["a\x00b", "a\x00c", "line\nbreak", "L" * 300, "L" * 300 + "x", "model.layers.0.fc1"]
    with debug_session(dump_config(high_precision_tensor=True), tmp_path) as te:
        for i, name in enumerate(names):
            te.inspect_tensor(name, tensor=x + i, tensor_name="activation", iteration=3, tp_group=None)
    folder = tmp_path / "tensor_dumps" / "rank_0" / "iter_000003"

    def expected(name):  # independent oracle: cut to 107 bytes + "-" + 12 hex digits of SHA-256, or TE's names
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        safe = "".join("_" if ord(c) < 32 or c in '/\\:*?"<>| .' else c for c in name)
        return (
            f"{safe[:107]}-{digest}_activation.pt"
            if safe != name.translate({46: 95, 32: 95}) or len(safe) > 120
            else f"{safe}_activation.pt"
        )

    assert sorted(os.listdir(folder)) == sorted(expected(n) for n in names)
    assert "model_layers_0_fc1_activation.pt" in os.listdir(folder)  # ordinary names: TransformerEngine's form
    for i, name in enumerate(names):
        path = folder / expected(name)
        assert len(path.name.encode()) <= 255
        assert torch.equal(torch.load(path, weights_only=True)["high_precision"], x + i)
