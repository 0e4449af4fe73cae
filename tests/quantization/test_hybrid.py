"""HybridQuantizer / HybridQuantizedTensor / split_quantize (CPU).

Covers each fault found when hybrid quantization was reviewed, as a regression test (usage flags respected, child
flags restored after an exception, `None` in repr, mixed lists in split_quantize), bit-exact equality of each
sub-storage with the standalone quantization, and the `rowwise_dequantized` double quantization.
"""

import pytest
import torch

from tedebug.quantization import (
    Float8CurrentScalingQuantizer,
    HybridQuantizedTensor,
    HybridQuantizer,
    IdentityQuantizer,
    IdentityTensor,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
    split_quantize,
)


# ------------------------------------------------------------------------------------------------ helpers
class SpyQuantizer(IdentityQuantizer):
    """Identity quantizer that records the usage flags it saw at every call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _quantize(self, tensor):
        self.calls.append((self.rowwise_usage, self.columnwise_usage))
        return super()._quantize(tensor)


class BoomQuantizer(IdentityQuantizer):
    """A child that fails inside quantize and make_empty."""

    def _quantize(self, tensor):
        raise RuntimeError("boom in _quantize")

    def make_empty(self, shape, *, dtype=torch.float32, device=None):
        raise RuntimeError("boom in make_empty")


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def fields_equal(a, b):
    """Every raw tensor field of two quantized tensors of the same type is bit-identical."""
    assert type(a) is type(b)
    assert a.has_rowwise == b.has_rowwise and a.has_columnwise == b.has_columnwise
    for name in a._tensor_fields():
        ta, tb = getattr(a, name), getattr(b, name)
        assert (ta is None) == (tb is None), name
        if ta is not None:
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, name
            assert torch.equal(_bytes(ta), _bytes(tb)), name
    return True


def standalone(quantizer, usage, tensor):
    q = quantizer.copy()
    q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    return q.quantize(tensor)


def data(seed=0, shape=(64, 64), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


# ------------------------------------------------------------------------------------------------ construction
def test_children_must_be_distinct_objects():
    q = IdentityQuantizer()
    with pytest.raises(ValueError, match="distinct"):
        HybridQuantizer(q, q)


def test_children_must_be_quantizers():
    with pytest.raises(TypeError, match="columnwise_quantizer must be a Quantizer"):
        HybridQuantizer(IdentityQuantizer(), "mxfp8")


def test_columnwise_source_is_validated():
    with pytest.raises(ValueError, match="columnwise_source"):
        HybridQuantizer(IdentityQuantizer(), IdentityQuantizer(), columnwise_source="transpose")


def test_recipe_name_is_empty():
    assert HybridQuantizer(IdentityQuantizer(), IdentityQuantizer()).recipe_name == ""


# ----------------------------------------------------------------------------------------------------- usage flags
@pytest.mark.parametrize(
    "rowwise,columnwise,row_calls,col_calls",
    [(True, True, 1, 1), (True, False, 1, 0), (False, True, 0, 1)],
)
def test_children_run_only_for_enabled_directions(rowwise, columnwise, row_calls, col_calls):
    row, col = SpyQuantizer(), SpyQuantizer()
    h = HybridQuantizer(row, col)
    h.set_usage(rowwise=rowwise, columnwise=columnwise)
    out = h.quantize(data())
    assert len(row.calls) == row_calls and len(col.calls) == col_calls
    # each child ran pinned to its single direction
    assert row.calls == [(True, False)] * row_calls
    assert col.calls == [(False, True)] * col_calls
    assert out.has_rowwise == rowwise and out.has_columnwise == columnwise
    assert (out.rowwise_sub_storage is None) == (not rowwise)
    assert (out.columnwise_sub_storage is None) == (not columnwise)


def test_child_flags_restored_after_quantize():
    row, col = SpyQuantizer(), SpyQuantizer()
    row.set_usage(rowwise=False, columnwise=True)  # deliberately odd flags
    col.set_usage(rowwise=True, columnwise=False)
    HybridQuantizer(row, col).quantize(data())
    assert (row.rowwise_usage, row.columnwise_usage) == (False, True)
    assert (col.rowwise_usage, col.columnwise_usage) == (True, False)


@pytest.mark.parametrize("failing", ["rowwise", "columnwise"])
def test_child_flags_restored_when_child_raises(failing):
    row = BoomQuantizer() if failing == "rowwise" else SpyQuantizer()
    col = BoomQuantizer() if failing == "columnwise" else SpyQuantizer()
    h = HybridQuantizer(row, col)
    with pytest.raises(RuntimeError, match="boom in _quantize"):
        h.quantize(data())
    for child in (row, col):
        assert (child.rowwise_usage, child.columnwise_usage) == (True, True)
    assert (h.rowwise_usage, h.columnwise_usage) == (True, True)


@pytest.mark.parametrize("failing", ["rowwise", "columnwise"])
def test_child_flags_restored_when_make_empty_raises(failing):
    row = BoomQuantizer() if failing == "rowwise" else SpyQuantizer()
    col = BoomQuantizer() if failing == "columnwise" else SpyQuantizer()
    with pytest.raises(RuntimeError, match="boom in make_empty"):
        HybridQuantizer(row, col).make_empty((32, 32))
    for child in (row, col):
        assert (child.rowwise_usage, child.columnwise_usage) == (True, True)


def test_make_empty_builds_enabled_sub_storages_only():
    row, col = IdentityQuantizer(), MXFP8Quantizer()
    h = HybridQuantizer(row, col, rowwise=False)
    e = h.make_empty((64, 32), dtype=torch.bfloat16)
    assert e.rowwise_sub_storage is None
    assert isinstance(e.columnwise_sub_storage, type(col.quantize(data(shape=(64, 32)))))
    assert e.columnwise_sub_storage.has_columnwise and not e.columnwise_sub_storage.has_rowwise
    assert e.shape == torch.Size((64, 32)) and e.dtype == torch.bfloat16
    assert (col.rowwise_usage, col.columnwise_usage) == (True, True)


# ------------------------------------------------------------------------------------------------------------ repr
def test_repr_shows_none_for_absent_direction():
    h = HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer())
    h.set_usage(rowwise=False)
    text = repr(h.quantize(data()))
    assert "rowwise=None" in text and "columnwise=MXFP8Tensor" in text
    assert "NoneType" not in text
    both = repr(HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer()).quantize(data()))
    assert "rowwise=IdentityTensor" in both and "columnwise=MXFP8Tensor" in both


# ------------------------------------------------------------------------------------------------ bit-exact combos
def _combos():
    return {
        "fp8cs_row+mxfp8_col": lambda: (Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer("E4M3")),
        "mxfp8_row+nvfp4_col": lambda: (MXFP8Quantizer("E4M3"), NVFP4Quantizer()),
        "mxfp8_row+nvfp4_rht_col": lambda: (MXFP8Quantizer("E4M3"), NVFP4Quantizer(with_rht=True)),
        "nvfp4_row+mxfp8e5m2_col": lambda: (NVFP4Quantizer(), MXFP8Quantizer("E5M2")),
    }


@pytest.mark.parametrize("name", list(_combos()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sub_storages_equal_standalone_quantization(name, dtype):
    row, col = _combos()[name]()
    x = data(seed=1, shape=(64, 96), dtype=dtype)
    out = HybridQuantizer(row, col).quantize(x)
    assert isinstance(out, HybridQuantizedTensor)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert fields_equal(out.rowwise_sub_storage, standalone(row, "rowwise", x))
    assert fields_equal(out.columnwise_sub_storage, standalone(col, "columnwise", x))
    assert torch.equal(out.dequantize(), standalone(row, "rowwise", x).dequantize())
    assert torch.equal(
        out.dequantize(usage="columnwise"), standalone(col, "columnwise", x).dequantize(usage="columnwise")
    )


def test_statistics_helpers_delegate_to_the_sub_storage_of_that_usage():
    row, col = MXFP8Quantizer("E4M3"), NVFP4Quantizer()
    x = data(seed=2)
    x[:32, :16] = 0.0
    out = HybridQuantizer(row, col).quantize(x)
    ref_row, ref_col = standalone(row, "rowwise", x), standalone(col, "columnwise", x)
    assert torch.equal(out.nonzero_code_count("rowwise"), ref_row.nonzero_code_count("rowwise"))
    assert torch.equal(out.nonzero_code_count("columnwise"), ref_col.nonzero_code_count("columnwise"))
    assert torch.equal(out.scale_inv_values("rowwise"), ref_row.scale_inv_values("rowwise"))
    assert torch.equal(out.scale_inv_values("columnwise"), ref_col.scale_inv_values("columnwise"))
    out.update_usage(rowwise_usage=False)
    with pytest.raises(RuntimeError, match="rowwise representation is not available"):
        out.nonzero_code_count("rowwise")


# ------------------------------------------------------------------------------------------------ rowwise_dequantized
def test_rowwise_dequantized_hand_vector():
    # by hand: current scaling E4M3 with amax 3.5 -> scale 128; 1.0 -> 1.0, 3.5 -> 3.5,
    # -0.01 -> -0.009765625 (code 0xBA), 1e-4 -> 0.013671875 / 128 (largest subnormal 0x07).
    x = torch.tensor([[1.0, 3.5, -0.01, 1e-4]])
    h = HybridQuantizer(
        Float8CurrentScalingQuantizer("E4M3"), IdentityQuantizer(), columnwise_source="rowwise_dequantized"
    )
    out = h.quantize(x)
    expected = torch.tensor([[1.0, 3.5, -0.009765625, 0.013671875 / 128]], dtype=torch.float64)
    assert torch.equal(out.dequantize(usage="columnwise").double(), expected)
    assert isinstance(out.columnwise_sub_storage, IdentityTensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_dequantized_equals_quantize_of_dequantized_rowwise(dtype):
    row, col = MXFP8Quantizer("E4M3"), NVFP4Quantizer()
    x = data(seed=3, dtype=dtype)
    out = HybridQuantizer(row, col, columnwise_source="rowwise_dequantized").quantize(x)
    rowwise = standalone(row, "rowwise", x)
    assert fields_equal(out.rowwise_sub_storage, rowwise)
    assert fields_equal(out.columnwise_sub_storage, standalone(col, "columnwise", rowwise.dequantize()))
    # and it really differs from quantizing the original (double quantization is not a no-op here)
    assert not torch.equal(
        out.dequantize(usage="columnwise"), standalone(col, "columnwise", x).dequantize(usage="columnwise")
    )


def test_rowwise_dequantized_computes_rowwise_internally_when_rowwise_usage_is_off():
    row, col = SpyQuantizer(), MXFP8Quantizer()
    h = HybridQuantizer(row, col, columnwise_source="rowwise_dequantized", rowwise=False)
    x = data(seed=4)
    out = h.quantize(x)
    assert row.calls == [(True, False)]
    assert out.rowwise_sub_storage is None and out.has_columnwise
    assert fields_equal(out.columnwise_sub_storage, standalone(col, "columnwise", x))


# ------------------------------------------------------------------------------------------------ tensor operations
def test_update_usage_only_drops():
    out = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()).quantize(data())
    out.update_usage(rowwise_usage=True, columnwise_usage=True)  # both present: nothing to do
    out.update_usage(columnwise_usage=False)
    assert out.has_rowwise and not out.has_columnwise and out.columnwise_sub_storage is None
    with pytest.raises(RuntimeError, match="columnwise sub-storage is missing"):
        out.update_usage(columnwise_usage=True)
    with pytest.raises(ValueError, match="no representation"):
        out.update_usage(rowwise_usage=False)
    assert out.has_rowwise


def test_dequantize_picks_rowwise_first_then_columnwise():
    row, col = Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer()
    x = data(seed=5)
    out = HybridQuantizer(row, col).quantize(x)
    row_values = standalone(row, "rowwise", x).dequantize()
    col_values = standalone(col, "columnwise", x).dequantize(usage="columnwise")
    assert not torch.equal(row_values, col_values)
    assert torch.equal(out.dequantize(), row_values)
    assert torch.equal(out.dequantize(usage="columnwise"), col_values)
    assert out.dequantize(dtype=torch.bfloat16).dtype == torch.bfloat16
    out.update_usage(rowwise_usage=False)
    assert torch.equal(out.dequantize(), col_values)
    with pytest.raises(RuntimeError, match="rowwise representation is not available"):
        out.dequantize(usage="rowwise")


@pytest.mark.parametrize("source", ["original", "rowwise_dequantized"])
def test_out_refreshes_sub_storages_in_place(source):
    row, col = MXFP8Quantizer(), NVFP4Quantizer()
    h = HybridQuantizer(row, col, columnwise_source=source)
    out = h.quantize(data(seed=6))
    subs = (out.rowwise_sub_storage, out.columnwise_sub_storage)
    y = data(seed=7)
    assert h.quantize(y, out=out) is out
    assert (out.rowwise_sub_storage, out.columnwise_sub_storage) == subs
    assert fields_equal(out.rowwise_sub_storage, h.quantize(y).rowwise_sub_storage)
    assert fields_equal(out.columnwise_sub_storage, h.quantize(y).columnwise_sub_storage)
    assert torch.equal(out.dequantize(usage="columnwise"), h.quantize(y).dequantize(usage="columnwise"))


def test_out_refresh_of_columnwise_only_with_rowwise_dequantized_source():
    row, col = MXFP8Quantizer(), NVFP4Quantizer()
    h = HybridQuantizer(row, col, columnwise_source="rowwise_dequantized", rowwise=False)
    out = h.quantize(data(seed=8))
    y = data(seed=9)
    h.quantize(y, out=out)
    expected = standalone(col, "columnwise", standalone(row, "rowwise", y).dequantize())
    assert out.rowwise_sub_storage is None
    assert fields_equal(out.columnwise_sub_storage, expected)


def test_save_and_restore_round_trip():
    out = HybridQuantizer(Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer()).quantize(data(seed=10))
    before = (out.dequantize(), out.dequantize(usage="columnwise"))
    tensors, obj = out.prepare_for_saving()
    assert obj is out
    n_row = len(out.rowwise_sub_storage._tensor_fields())
    n_col = len(out.columnwise_sub_storage._tensor_fields())
    assert len(tensors) == n_row + n_col
    assert all(getattr(out.rowwise_sub_storage, f) is None for f in out.rowwise_sub_storage._tensor_fields())
    sentinel = torch.zeros(1)
    rest = out.restore_from_saved(tensors + [sentinel])
    assert len(rest) == 1 and rest[0] is sentinel
    assert torch.equal(out.dequantize(), before[0])
    assert torch.equal(out.dequantize(usage="columnwise"), before[1])


def test_copy_gives_own_children():
    h = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise_source="rowwise_dequantized")
    twin = h.copy()
    assert twin.rowwise_quantizer is not h.rowwise_quantizer
    assert twin.columnwise_quantizer is not h.columnwise_quantizer
    assert twin.columnwise_source == "rowwise_dequantized"
    twin.set_usage(rowwise=False)
    assert h.rowwise_usage


def test_nested_hybrid_as_child():
    inner = HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer())
    outer = HybridQuantizer(MXFP8Quantizer("E5M2"), inner)
    x = data(seed=11)
    out = outer.quantize(x)
    inner_col = out.columnwise_sub_storage
    assert isinstance(inner_col, HybridQuantizedTensor)
    assert inner_col.rowwise_sub_storage is None  # the inner hybrid ran pinned to columnwise only
    assert fields_equal(inner_col.columnwise_sub_storage, standalone(MXFP8Quantizer(), "columnwise", x))
    assert (inner.rowwise_usage, inner.columnwise_usage) == (True, True)


# ------------------------------------------------------------------------------------------------ split_quantize
def test_split_quantize_mixed_list():
    x = data(seed=12, shape=(160, 64))
    hybrid = HybridQuantizer(Float8CurrentScalingQuantizer("E4M3"), MXFP8Quantizer())
    plain = MXFP8Quantizer()
    ident = IdentityQuantizer()
    m_splits = [32, 64, 32, 32, 0]
    quantizers = [hybrid, plain, None, ident, None]
    outs = split_quantize(x, m_splits, quantizers)
    assert len(outs) == 5
    chunks = [x[0:32], x[32:96], x[96:128], x[128:160], x[160:160]]
    assert isinstance(outs[0], HybridQuantizedTensor)
    assert fields_equal(outs[0].rowwise_sub_storage, standalone(hybrid.rowwise_quantizer, "rowwise", chunks[0]))
    assert fields_equal(
        outs[0].columnwise_sub_storage, standalone(hybrid.columnwise_quantizer, "columnwise", chunks[0])
    )
    assert fields_equal(outs[1], plain.quantize(chunks[1]))
    assert isinstance(outs[2], torch.Tensor) and torch.equal(outs[2], chunks[2])
    assert isinstance(outs[3], IdentityTensor) and torch.equal(outs[3].dequantize(), chunks[3])
    assert isinstance(outs[4], torch.Tensor) and outs[4].shape == (0, 64)


def test_split_quantize_all_hybrid_and_all_none():
    x = data(seed=13, shape=(64, 64))
    hs = [HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()) for _ in range(2)]
    outs = split_quantize(x, [32, 32], hs)
    for out, chunk in zip(outs, (x[:32], x[32:])):
        assert fields_equal(out.columnwise_sub_storage, standalone(NVFP4Quantizer(), "columnwise", chunk))
    plain = split_quantize(x, [16, 48], [None, None])
    assert torch.equal(torch.cat(plain), x)


def test_split_quantize_errors():
    x = data(shape=(64, 64))
    with pytest.raises(ValueError, match="2 splits but 1 quantizers"):
        split_quantize(x, [32, 32], [None])
    with pytest.raises(ValueError, match="sum to 48"):
        split_quantize(x, [32, 16], [None, None])
    with pytest.raises(ValueError, match="non-negative"):
        split_quantize(x, [96, -32], [None, None])
    with pytest.raises(TypeError, match=r"quantizers\[1\] must be a Quantizer or None"):
        split_quantize(x, [32, 32], [None, "fp8"])


def test_quantizer_base_class_is_respected():
    assert isinstance(HybridQuantizer(IdentityQuantizer(), IdentityQuantizer()), Quantizer)
