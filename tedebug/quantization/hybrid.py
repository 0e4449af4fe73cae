"""Hybrid quantization: a different format per direction (`HybridQuantizer` -> `HybridQuantizedTensor`).

A `HybridQuantizer` composes two distinct sub-quantizers: the rowwise one produces the rowwise operand, the columnwise
one the columnwise operand (e.g. FP8 rowwise + MXFP8 columnwise, MXFP8 + NVFP4, or high precision via
`IdentityQuantizer`).  Going beyond a reviewed implementation of this design, it

- runs a child only when the hybrid's own usage flag for that direction is on;
- pins each child to its single direction only while it runs and restores the child's flags in ``finally``, also when
  the child raises (the same for `make_empty`);
- shows ``None`` in `repr` for an absent direction;
- lets `split_quantize` take lists mixing hybrid, non-hybrid and ``None`` quantizers.

``columnwise_source="rowwise_dequantized"`` quantizes the columnwise operand from the dequantized rowwise result
(double quantization).  The rowwise result is then needed even when rowwise usage is off: it is computed internally
and dropped afterwards (so a delayed-scaling rowwise child still records that amax).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .tensor import QuantizedTensor, Quantizer, USAGES

COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")


@contextlib.contextmanager
def _pinned(quantizer: Quantizer, usage: str) -> Iterator[Quantizer]:
    """Run `quantizer` with only `usage` enabled; its previous flags come back even on an exception."""
    saved = (quantizer.rowwise_usage, quantizer.columnwise_usage)
    try:
        quantizer.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
        yield quantizer
    finally:
        quantizer.set_usage(rowwise=saved[0], columnwise=saved[1])


def _check_usage(usage: str) -> str:
    if usage not in USAGES:
        raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
    return usage


class HybridQuantizedTensor(QuantizedTensor):
    """Two quantized tensors of possibly different formats: `rowwise_sub_storage` and `columnwise_sub_storage`.

    Each sub-storage holds only its own direction.  Either may be None (that direction was not produced or was
    dropped); a missing one can never be recreated from the other (they are different formats).
    """

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device,
        quantizer: Optional[Quantizer],
        *,
        rowwise_sub_storage: Optional[QuantizedTensor],
        columnwise_sub_storage: Optional[QuantizedTensor],
    ) -> None:
        super().__init__(shape, dtype, device, quantizer)
        self.rowwise_sub_storage = rowwise_sub_storage
        self.columnwise_sub_storage = columnwise_sub_storage

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_sub_storage is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_sub_storage is not None

    def sub_storage(self, usage: str) -> QuantizedTensor:
        """The sub-storage holding `usage` (RuntimeError when it is absent)."""
        sub = getattr(self, f"{_check_usage(usage)}_sub_storage")
        if sub is None:
            raise RuntimeError(f"HybridQuantizedTensor: the {usage} representation is not available")
        return sub

    # ---------------------------------------------------------------- values
    def dequantize(self, *, dtype: Optional[torch.dtype] = None, usage: Optional[str] = None) -> torch.Tensor:
        """Dequantize the sub-storage of `usage` (default: rowwise when present, else columnwise)."""
        if usage is None:
            usage = "rowwise" if self.has_rowwise else "columnwise"
        return self.sub_storage(usage).dequantize(dtype=dtype or self._dtype, usage=usage)

    def _dequantize(self, usage: str) -> torch.Tensor:
        return self.sub_storage(usage).dequantize(dtype=torch.float32, usage=usage)

    # ---------------------------------------------------------------- usage
    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop sub-storages (False); True only checks that the sub-storage is there (RuntimeError if not)."""
        for usage, wanted in (("rowwise", rowwise_usage), ("columnwise", columnwise_usage)):
            if wanted and getattr(self, f"{usage}_sub_storage") is None:
                self._create(usage)
        keep_row = self.has_rowwise and rowwise_usage is not False
        keep_col = self.has_columnwise and columnwise_usage is not False
        if not (keep_row or keep_col):
            raise ValueError(
                f"HybridQuantizedTensor.update_usage(rowwise_usage={rowwise_usage}, "
                f"columnwise_usage={columnwise_usage}) would leave no representation"
            )
        super().update_usage(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage)

    def _create(self, usage: str) -> None:
        raise RuntimeError(
            f"HybridQuantizedTensor: the {usage} sub-storage is missing and cannot be derived from the other "
            f"direction (different formats); quantize again with {usage} usage enabled"
        )

    def _drop(self, usage: str) -> None:
        setattr(self, f"{usage}_sub_storage", None)

    # ---------------------------------------------------------------- autograd saving
    def _tensor_fields(self) -> Tuple[str, ...]:
        return ()  # the tensors live in the sub-storages

    def _present_subs(self) -> List[QuantizedTensor]:
        return [s for s in (self.rowwise_sub_storage, self.columnwise_sub_storage) if s is not None]

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "HybridQuantizedTensor"]:
        tensors: List[Optional[torch.Tensor]] = []
        for sub in self._present_subs():
            tensors.extend(sub.prepare_for_saving()[0])
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        rest = list(tensors)
        for sub in self._present_subs():
            rest = sub.restore_from_saved(rest)
        return rest

    def _copy_from(self, other: QuantizedTensor) -> None:
        if not isinstance(other, HybridQuantizedTensor):
            raise TypeError(f"HybridQuantizedTensor can only be refreshed from another one, got {type(other).__name__}")
        if other.shape != self._shape:
            raise ValueError(
                f"HybridQuantizedTensor: cannot refresh a tensor of shape {tuple(self._shape)} "
                f"from one of shape {tuple(other.shape)}"
            )
        for usage in USAGES:
            mine = getattr(self, f"{usage}_sub_storage")
            theirs = getattr(other, f"{usage}_sub_storage")
            if mine is not None and theirs is not None and type(mine) is type(theirs):
                mine._copy_from(theirs)
            else:
                setattr(self, f"{usage}_sub_storage", theirs)

    # ---------------------------------------------------------------- statistics helpers
    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        return self.sub_storage(usage).nonzero_code_count(usage)

    def scale_inv_values(self, usage: str) -> torch.Tensor:
        return self.sub_storage(usage).scale_inv_values(usage)

    def code_domain(self, x: torch.Tensor, usage: str) -> torch.Tensor:
        return self.sub_storage(usage).code_domain(x, usage)

    def __repr__(self) -> str:
        def name(sub: Optional[QuantizedTensor]) -> str:
            return "None" if sub is None else type(sub).__name__

        return (
            f"HybridQuantizedTensor(shape={tuple(self._shape)}, dtype={self._dtype}, device={self._device}, "
            f"rowwise={name(self.rowwise_sub_storage)}, columnwise={name(self.columnwise_sub_storage)})"
        )


class HybridQuantizer(Quantizer):
    """Quantize the rowwise operand with one quantizer and the columnwise operand with another.

    `set_usage` changes only the hybrid's flags; a child runs only for an enabled direction, pinned to that
    direction, and gets its own flags back afterwards.  With ``columnwise_source="rowwise_dequantized"`` the
    columnwise child quantizes ``rowwise.dequantize()`` (in the input's dtype); the rowwise child then also runs
    when rowwise usage is off, and its result is dropped.
    """

    recipe_name = ""

    def __init__(
        self,
        rowwise_quantizer: Quantizer,
        columnwise_quantizer: Quantizer,
        *,
        columnwise_source: str = "original",
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        for role, q in (("rowwise_quantizer", rowwise_quantizer), ("columnwise_quantizer", columnwise_quantizer)):
            if not isinstance(q, Quantizer):
                raise TypeError(f"HybridQuantizer: {role} must be a Quantizer, got {type(q).__name__}")
        if rowwise_quantizer is columnwise_quantizer:
            raise ValueError(
                "HybridQuantizer: rowwise_quantizer and columnwise_quantizer must be distinct objects "
                f"(got the same {type(rowwise_quantizer).__name__} twice); pass q.copy() or a new quantizer"
            )
        if columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(
                f"HybridQuantizer: columnwise_source must be one of {COLUMNWISE_SOURCES}, got {columnwise_source!r}"
            )
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.rowwise_quantizer = rowwise_quantizer
        self.columnwise_quantizer = columnwise_quantizer
        self.columnwise_source = columnwise_source

    @property  # the hybrid's flag is its children's
    def error_stats(self) -> bool:
        """Whether the children compute their quantization-error statistics (`Quantizer.error_stats`)."""
        return self.rowwise_quantizer.error_stats or self.columnwise_quantizer.error_stats

    @error_stats.setter
    def error_stats(self, on: bool) -> None:
        self.rowwise_quantizer.error_stats = self.columnwise_quantizer.error_stats = bool(on)

    # ---------------------------------------------------------------- quantize
    def _rowwise(self, tensor: torch.Tensor) -> QuantizedTensor:
        with _pinned(self.rowwise_quantizer, "rowwise") as q:
            return q.quantize(tensor)

    def _columnwise_input(self, tensor: torch.Tensor, rowwise: Optional[QuantizedTensor]) -> torch.Tensor:
        if self.columnwise_source == "original":
            return tensor
        if rowwise is None:
            rowwise = self._rowwise(tensor)
        return rowwise.dequantize(dtype=tensor.dtype, usage="rowwise")

    def _quantize(self, tensor: torch.Tensor) -> HybridQuantizedTensor:
        needs_rowwise = self.rowwise_usage or (
            self.columnwise_usage and self.columnwise_source == "rowwise_dequantized"
        )
        rowwise = self._rowwise(tensor) if needs_rowwise else None
        columnwise = None
        if self.columnwise_usage:
            source = self._columnwise_input(tensor, rowwise)
            with _pinned(self.columnwise_quantizer, "columnwise") as q:
                columnwise = q.quantize(source)
        return HybridQuantizedTensor(
            tensor.shape,
            tensor.dtype,
            tensor.device,
            self,
            rowwise_sub_storage=rowwise if self.rowwise_usage else None,
            columnwise_sub_storage=columnwise,
        )

    def update_quantized(self, src: torch.Tensor, dst: QuantizedTensor) -> HybridQuantizedTensor:
        """Refresh each sub-storage of `dst` in place with its own sub-quantizer."""
        if not isinstance(dst, HybridQuantizedTensor):
            raise TypeError(
                f"HybridQuantizer.update_quantized: dst must be a HybridQuantizedTensor, got {type(dst).__name__}"
            )
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"HybridQuantizer.update_quantized: src shape {tuple(src.shape)} does not match "
                f"dst shape {tuple(dst.shape)}"
            )
        rowwise = dst.rowwise_sub_storage
        if rowwise is not None:
            with _pinned(self.rowwise_quantizer, "rowwise") as q:
                q.quantize(src, out=rowwise)
        if dst.columnwise_sub_storage is not None:
            source = self._columnwise_input(src, rowwise)
            with _pinned(self.columnwise_quantizer, "columnwise") as q:
                q.quantize(source, out=dst.columnwise_sub_storage)
        return dst

    def make_empty(
        self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None
    ) -> HybridQuantizedTensor:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError("HybridQuantizer.make_empty: both rowwise and columnwise usage are off")
        shape = torch.Size(shape)
        subs: dict[str, Optional[QuantizedTensor]] = {}
        for usage, child in (("rowwise", self.rowwise_quantizer), ("columnwise", self.columnwise_quantizer)):
            subs[usage] = None
            if getattr(self, f"{usage}_usage"):
                with _pinned(child, usage) as q:
                    subs[usage] = q.make_empty(shape, dtype=dtype, device=device)
        return HybridQuantizedTensor(
            shape,
            dtype,
            device,
            self,
            rowwise_sub_storage=subs["rowwise"],
            columnwise_sub_storage=subs["columnwise"],
        )

    def copy(self) -> "HybridQuantizer":
        """A copy with its own flags and its own copies of the children (state tensors shared, as `Quantizer.copy`)."""
        twin = super().copy()
        twin.rowwise_quantizer = self.rowwise_quantizer.copy()
        twin.columnwise_quantizer = self.columnwise_quantizer.copy()
        return twin

    def __repr__(self) -> str:
        return (
            f"HybridQuantizer(rowwise_quantizer={self.rowwise_quantizer!r}, "
            f"columnwise_quantizer={self.columnwise_quantizer!r}, columnwise_source={self.columnwise_source!r}, "
            f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage})"
        )


def split_quantize(
    tensor: torch.Tensor, m_splits: Sequence[int], quantizers: Sequence[Optional[Quantizer]]
) -> List[Union[QuantizedTensor, torch.Tensor]]:
    """Split `tensor` along dim 0 into `m_splits` rows and quantize chunk i with `quantizers[i]`.

    Grouped (MoE) layers use this.  The list may mix hybrid, non-hybrid and None quantizers; None leaves that chunk
    in high precision (the chunk itself, a view of `tensor`, is returned).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"split_quantize expects a torch.Tensor, got {type(tensor).__name__}")
    m_splits = [int(m) for m in m_splits]
    if len(m_splits) != len(quantizers):
        raise ValueError(
            f"split_quantize: {len(m_splits)} splits but {len(quantizers)} quantizers (need one per split)"
        )
    if any(m < 0 for m in m_splits):
        raise ValueError(f"split_quantize: m_splits must be non-negative, got {m_splits}")
    rows = tensor.shape[0] if tensor.dim() > 0 else None
    if rows is None or sum(m_splits) != rows:
        raise ValueError(
            f"split_quantize: m_splits {m_splits} sum to {sum(m_splits)}, but the tensor has "
            f"{rows if rows is not None else 'no'} rows (shape {tuple(tensor.shape)})"
        )
    chunks = torch.split(tensor, m_splits, dim=0)
    out: List[Union[QuantizedTensor, torch.Tensor]] = []
    for i, (chunk, q) in enumerate(zip(chunks, quantizers)):
        if q is None:
            out.append(chunk)
        elif isinstance(q, Quantizer):
            out.append(q.quantize(chunk))
        else:
            raise TypeError(f"split_quantize: quantizers[{i}] must be a Quantizer or None, got {type(q).__name__}")
    return out
