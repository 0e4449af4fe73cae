"""`Float8Tensor.fp32_matrix` of a tensor the CPU host cast made reads the cast's own numpy views of its buffers;
whatever happens to the tensor afterwards (an in-place refresh, a replaced buffer, a save and restore through
autograd with other tensors, a dropped and re-created direction), it decodes what the tensor holds now: the values
and strides of ``dequantize`` flattened to 2-D, bit for bit."""

from __future__ import annotations

import torch

from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer


def _flat_dequantized(q, usage):
    values = q.dequantize(usage=usage, dtype=torch.float32)
    return values.reshape(-1, values.shape[-1])


def _assert_decodes_what_it_holds(q):
    for usage in ("rowwise", "columnwise"):
        fast, ref = q.fp32_matrix(usage), _flat_dequantized(q, usage)
        assert fast.stride() == ref.stride(), usage
        assert torch.equal(fast.view(torch.int32), ref.view(torch.int32)), usage


def _pair():
    g = torch.Generator().manual_seed(1418)
    return torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g) * 50.0


def test_in_place_refresh_is_seen():
    x, y = _pair()
    quantizer = Float8CurrentScalingQuantizer()
    q = quantizer.quantize(x)
    before = q.fp32_matrix("rowwise").clone()
    quantizer.quantize(y, out=q)  # copies the new codes and scale_inv into q's own tensors
    after = q.fp32_matrix("rowwise")
    assert torch.equal(after, quantizer.quantize(y).fp32_matrix("rowwise")) and not torch.equal(after, before)
    _assert_decodes_what_it_holds(q)


def test_replaced_buffers_are_seen():
    x, y = _pair()
    quantizer = Float8Quantizer(torch.tensor(2.0), torch.zeros(3), "E4M3")
    q, other = quantizer.quantize(x), quantizer.quantize(y)
    q.rowwise_data, q.columnwise_data = other.rowwise_data.clone(), other.columnwise_data.clone()
    q.scale_inv = torch.tensor(0.25)
    assert torch.equal(q.fp32_matrix("rowwise"), other.fp32_matrix("rowwise") * 0.5)
    _assert_decodes_what_it_holds(q)


def test_save_and_restore_with_other_tensors():
    """A saved-tensor hook may hand back other tensors (offloaded copies): they are what is decoded."""
    x, y = _pair()
    quantizer = Float8CurrentScalingQuantizer()
    q, other = quantizer.quantize(x), quantizer.quantize(y)
    saved, holder = q.prepare_for_saving()
    replacement, _ = other.prepare_for_saving()
    assert len(saved) == len(replacement)
    holder.restore_from_saved([t.clone() for t in replacement])
    other.restore_from_saved(replacement)
    assert torch.equal(holder.fp32_matrix("columnwise"), other.fp32_matrix("columnwise"))
    _assert_decodes_what_it_holds(holder)


def test_dropped_and_recreated_direction():
    x, _ = _pair()
    q = Float8CurrentScalingQuantizer().quantize(x)
    q.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert q.columnwise_data is None
    q.update_usage(columnwise_usage=True)
    _assert_decodes_what_it_holds(q)
