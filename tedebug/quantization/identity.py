"""High-precision passthrough: `IdentityQuantizer` -> `IdentityTensor`.

The identity "format" keeps the tensor in its own dtype for every enabled direction.  It is the high-precision leg of
a hybrid quantizer (e.g. high-precision forward, MXFP8 backward) and behaves like every other quantizer so that
callers never need a special case.  The stored data is a private copy of the input (never an alias), so refreshing
it in place with ``quantize(t, out=...)`` can never write into a caller's tensor; both directions share that copy.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from .tensor import QuantizedTensor, Quantizer


class IdentityTensor(QuantizedTensor):
    """A tensor kept in high precision; `rowwise_data` / `columnwise_data` hold the values (or None)."""

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device,
        quantizer: Optional[Quantizer],
        *,
        rowwise_data: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
    ) -> None:
        super().__init__(shape, dtype, device, quantizer)
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data

    def _data(self, usage: str) -> torch.Tensor:
        return getattr(self, f"{self._require(usage)}_data")

    def _dequantize(self, usage: str) -> torch.Tensor:
        return self._data(usage)

    def dequantize(self, *, dtype: Optional[torch.dtype] = None, usage: Optional[str] = None) -> torch.Tensor:
        """The stored values (a new tensor: callers may modify it without touching this object)."""
        values = super().dequantize(dtype=dtype, usage=usage)
        aliased = values is self.rowwise_data or values is self.columnwise_data
        return values.clone() if aliased else values

    def _create(self, usage: str) -> None:
        # Both directions hold the same values, so the missing one is the present one.
        other = self.columnwise_data if usage == "rowwise" else self.rowwise_data
        if other is None:
            raise RuntimeError(f"IdentityTensor: cannot create the {usage} representation: no data is present")
        setattr(self, f"{usage}_data", other)

    def _drop(self, usage: str) -> None:
        setattr(self, f"{usage}_data", None)

    def _tensor_fields(self) -> Tuple[str, ...]:
        return ("rowwise_data", "columnwise_data")

    # ---------------------------------------------------------------- statistics helpers
    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        """Number of elements that are not ±0 (0-d int64)."""
        return torch.count_nonzero(self._data(usage)).to(torch.int64)

    def scale_inv_values(self, usage: str) -> torch.Tensor:
        """High precision stores no scales: an empty 1-D fp32 tensor."""
        return torch.empty(0, dtype=torch.float32, device=self._data(usage).device)


class IdentityQuantizer(Quantizer):
    """Keeps tensors in high precision (their own dtype) for the enabled directions."""

    recipe_name = ""

    def _quantize(self, tensor: torch.Tensor) -> IdentityTensor:
        data = tensor.detach().clone()
        return IdentityTensor(
            tensor.shape,
            tensor.dtype,
            tensor.device,
            self,
            rowwise_data=data if self.rowwise_usage else None,
            columnwise_data=data if self.columnwise_usage else None,
        )

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None) -> IdentityTensor:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError("IdentityQuantizer.make_empty: both rowwise and columnwise usage are off")
        shape = torch.Size(shape)
        device = torch.device(device) if device is not None else torch.device("cpu")
        data = torch.empty(shape, dtype=dtype, device=device)
        return IdentityTensor(
            shape,
            dtype,
            device,
            self,
            rowwise_data=data if self.rowwise_usage else None,
            columnwise_data=data if self.columnwise_usage else None,
        )
