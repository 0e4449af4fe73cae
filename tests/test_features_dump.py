"""DumpTensors: file layout, contents, flags, schedule and the different-operands error."""

import os

import pytest
import torch

from tedebug import debug_api
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer
from tedebug.quantization.hybrid import HybridQuantizedTensor, HybridQuantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer
from tedebug.quantization.tensor import QuantizedTensor

from test_features_helpers import debug_session, section


def dump_config(**params):
    return section({"DumpTensors": {"enabled": True, "tensors": ["activation", "weight"], **params}})


def test_dump_layout_and_contents(tmp_path):
    x = torch.randn(16, 32)
    quantizer = Float8CurrentScalingQuantizer("E4M3")
    q = quantizer.quantize(x)
    with debug_session(dump_config(high_precision_tensor=True, quantized_tensor=True), tmp_path) as te:
        assert te.inspect_tensor_enabled("test_layer", tensor_name="activation", iteration=0) == (True, 1)
        te.inspect_tensor("test_layer", tensor=x, tensor_name="activation", iteration=0, tp_group=None,
                          rowwise_quantized_tensor=q, columnwise_quantized_tensor=q, quantizer=quantizer)
    root = tmp_path / "tensor_dumps"
    assert sorted(os.listdir(root)) == ["rank_0"]
    assert sorted(os.listdir(root / "rank_0")) == ["iter_000000"]
    assert sorted(os.listdir(root / "rank_0" / "iter_000000")) == ["test_layer_activation.pt"]
    data = torch.load(root / "rank_0" / "iter_000000" / "test_layer_activation.pt", weights_only=False)
    assert set(data) == {"high_precision", "quantized"}
    assert torch.equal(data["high_precision"], x)
    assert isinstance(data["quantized"], QuantizedTensor)
    assert torch.equal(data["quantized"].rowwise_data, q.rowwise_data)
    assert torch.equal(data["quantized"].dequantize(), q.dequantize())
    x.add_(1.0)  # the dump was a clone
    assert not torch.equal(data["high_precision"], x)


def test_dump_flags_names_and_overwrite(tmp_path):
    x = torch.randn(32, 32)
    hybrid = HybridQuantizer(MXFP8Quantizer("E4M3"), Float8CurrentScalingQuantizer("E5M2"))
    hq = hybrid.quantize(x)
    with debug_session(dump_config(quantized_tensor=True, start_step=2, freq=2), tmp_path) as te:
        assert te.inspect_tensor_enabled("m.dec/0", tensor_name="weight", iteration=3) == (False, 4)
        for _ in range(2):
            te.inspect_tensor("m.dec/0 x", tensor=x, tensor_name="weight", iteration=12, tp_group=None,
                              rowwise_quantized_tensor=hq, columnwise_quantized_tensor=hq, quantizer=hybrid)
        te.inspect_tensor("hp", tensor=x, tensor_name="weight", iteration=12, tp_group=None,
                          rowwise_quantized_tensor=x, columnwise_quantized_tensor=x, quantizer=None)
        log = open(tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read()
    folder = tmp_path / "tensor_dumps" / "rank_0" / "iter_000012"
    assert sorted(os.listdir(folder)) == ["hp_weight.pt", "m_dec_0_x_weight.pt"]
    data = torch.load(folder / "m_dec_0_x_weight.pt", weights_only=False)
    assert set(data) == {"quantized"}
    dumped = data["quantized"]
    assert isinstance(dumped, HybridQuantizedTensor)
    assert torch.equal(dumped.columnwise_sub_storage.dequantize(usage="columnwise"),
                       hq.columnwise_sub_storage.dequantize(usage="columnwise"))
    assert dumped.rowwise_sub_storage.rowwise_data.data_ptr() != hq.rowwise_sub_storage.rowwise_data.data_ptr()
    assert torch.equal(torch.load(folder / "hp_weight.pt")["quantized"], x)  # high-precision operand
    assert log.count("overwriting existing dump") == 1


def test_dump_nothing_without_flags_and_error_for_different_operands(tmp_path):
    x = torch.randn(32, 32)
    q1 = MXFP8Quantizer("E4M3").quantize(x)
    with debug_session(dump_config(), tmp_path) as te:
        te.inspect_tensor("L", tensor=x, tensor_name="activation", iteration=0, tp_group=None,
                          rowwise_quantized_tensor=q1, columnwise_quantized_tensor=q1)
        assert not (tmp_path / "tensor_dumps").exists()
        with pytest.raises(ValueError, match="different objects"):
            te.inspect_tensor("L", tensor=x, tensor_name="activation", iteration=0, tp_group=None,
                              rowwise_quantized_tensor=x, columnwise_quantized_tensor=q1)
        log = open(tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read()
    assert "neither high_precision_tensor nor quantized_tensor is set" in log
    assert debug_api.DEBUG_MANAGER is None
