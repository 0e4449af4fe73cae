"""Error statistics a quantize kernel computed while writing the codes, carried by the quantized tensor.

A kernel that quantizes a tensor already sees every value and its code, so it also counts underflows and sums the
squared error (and, for per-tensor FP8, overflows) into a small float64 vector on the device.  The quantized tensor
carries that vector (`attach_fused`) and the statistics family functions of the kernel backend use it
(`fused_statistic`) instead of reading the tensor again, but only for the very tensor it was computed from: the same
tensor object at the same version (an in-place change after quantization makes the statistics stale).

The record lives in the quantized tensor's ``_fused_error_stats`` attribute: ``{"source": weakref to x, "version":
x._version, "rowwise": {statistic: 0-d tensor}, "columnwise": {...}}`` with only the directions that were produced.

High-precision statistics: a quantizer whose amax pass was the statistics pass (per-tensor FP8 current scaling
with ``Quantizer.high_precision_stats``) also wrote the input's basic statistics row.  Its reader is the statistics
feed of that input, which comes right after the quantization and sees only the input, so the row is kept in a
per-thread slot keyed by the input itself (`attach_high_precision` / `high_precision_row`: the same tensor object at
the same version, else nothing; the next quantization that writes one replaces it).

A tensor made under ``torch.inference_mode`` has no version counter (reading ``_version`` raises), so nothing could
tell a later in-place change: no record is kept for it, and its statistics come from the statistics pass, which gives
the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
import threading
from typing import Dict, Optional
import weakref

import torch

#: statistic name -> index in the float64 vector of the per-tensor FP8 cast (ted_fp8_cast_transpose*): its first
#: three entries (all that the vector of an empty input holds)
FP8_STATS = {"underflows_num": 0, "sq_err": 1, "overflows_num": 2}
#: the whole vector of the per-tensor FP8 casts (both kernels, and the host cast), which also holds the scale_inv
#: partials of the one decode scale (`torch_ref.scale_inv_partials`' names) and the number of elements
FP8_STATS_WITH_SCALE = {
    **FP8_STATS,
    "scale_count": 3,
    "scale_sum": 4,
    "scale_m2": 5,
    "scale_nz_min": 6,
    "scale_max": 7,
    "numel": 8,
}
#: statistic name -> index in the float64[4] vector of the block-scaled kernels (MXFP8, FP8 block, NVFP4)
ROWWISE_STATS = {"underflows_num": 0, "sq_err": 1}
COLUMNWISE_STATS = {"underflows_num": 2, "sq_err": 3}


#: id(index table) -> (the table, its names in vector order)
_ORDERS: Dict[int, tuple] = {}


class FusedStats(Mapping):
    """Statistic name -> 0-d view of a kernel's float64 statistics vector, made only when a statistic is read (most
    quantizations are never measured, and a view costs a tensor op)."""

    __slots__ = ("_vector", "_index")

    def __init__(self, vector: torch.Tensor, index: Dict[str, int]) -> None:
        self._vector = vector
        self._index = index

    @property
    def keys_in_order(self) -> tuple:
        """The statistic names in vector order (index i holds ``keys_in_order[i]``), for a one-gather row: one tuple
        per index table (the tables are this module's constants), so that its readers' caches hit."""
        index = self._index
        known = _ORDERS.get(id(index))
        if known is not None and known[0] is index:
            return known[1]
        order = tuple(sorted(index, key=index.__getitem__))
        if len(_ORDERS) < 64:  # the entry holds the table: its id stays its own
            _ORDERS[id(index)] = (index, order)
        return order

    @property
    def vector(self) -> torch.Tensor:
        """The kernel's float64 statistics vector itself (index by `keys_in_order`)."""
        return self._vector

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._vector[self._index[key]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def attach_fused(q, x: torch.Tensor, per_usage: Mapping[str, Mapping]) -> None:
    """Attach the statistics `per_usage` ({"rowwise" / "columnwise": {statistic: 0-d tensor}}) of quantizing `x`
    to the quantized tensor `q` (nothing for an inference tensor: module docstring)."""
    try:
        version = x._version
    except RuntimeError:  # an inference tensor
        return
    q._fused_error_stats = {"source": weakref.ref(x), "version": version, **per_usage}


def fused_statistic(q, x: torch.Tensor, usage: str, key: str) -> Optional[torch.Tensor]:
    """Statistic `key` of direction `usage` that the quantize kernel computed for exactly this `x` (same tensor,
    same version), else None."""
    fused = getattr(q, "_fused_error_stats", None)
    if not fused or fused["source"]() is not x or fused["version"] != x._version:
        return None
    return fused.get(usage, {}).get(key)


def fused_vector(q, x: torch.Tensor, usage: str) -> Optional[FusedStats]:
    """The whole statistics vector (a `FusedStats`) of direction `usage` that the quantize kernel computed for
    exactly this `x` (same tensor, same version), else None: a statistics row whose every partial is in it is one
    gather of this vector (`tedebug.stats.engine`)."""
    fused = getattr(q, "_fused_error_stats", None)
    if not fused or fused["source"]() is not x or fused["version"] != x._version:
        return None
    per = fused.get(usage)
    return per if isinstance(per, FusedStats) else None


class _HighPrecisionSlot(threading.local):
    """This thread's ``slot``: (weakref to the input, its version, float64 row) of the last attach, or None.  The
    class attribute answers a thread that never attached (every feed asks: no AttributeError raised and caught).
    A feed may read ``high_precision_slot.slot is None`` first: then `high_precision_row` answers None for any
    tensor (a run without a quantizer that attaches never calls it)."""

    slot: Optional[tuple] = None


high_precision_slot = _HighPrecisionSlot()


def attach_high_precision(x: torch.Tensor, row: torch.Tensor) -> None:
    """Keep `row`, the basic statistics row (`torch_ref.BASIC_ROW_KEYS` order, on x's device) that a quantize pass
    computed for `x`, for the statistics feed of `x` (this thread's one slot; emptied for an inference tensor:
    module docstring)."""
    try:
        version = x._version
    except RuntimeError:  # an inference tensor
        high_precision_slot.slot = None
        return
    high_precision_slot.slot = (weakref.ref(x), version, row)


def high_precision_row(x: torch.Tensor) -> Optional[torch.Tensor]:
    """The row `attach_high_precision` kept for exactly this `x` (same object, same version), else None."""
    slot = high_precision_slot.slot
    if slot is None or slot[0]() is not x or slot[1] != x._version:
        return None
    return slot[2]
