"""When tedebug may compute a CPU result with numpy: a CPU tensor, outside torch.compile's tracing.

Some CPU paths take numpy where it gives the torch path's bits with fewer calls (FP8 current scaling and FP8
decoding, the statistics of small tensors, the Philox bytes of NVFP4 stochastic rounding).  torch.compile's tracer
(Dynamo) cannot follow numpy calls on a tensor's buffer (``Tensor.numpy()``), so while it traces, the torch path
runs instead: the same values, traced like any torch code.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

import torch


def _never() -> bool:  # pragma: no cover - a torch without a tracer
    return False


def _tracer_query() -> Callable[[], bool]:
    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if found is None:  # (torch before torch.compiler.is_compiling)
        found = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return found if found is not None else _never


_is_compiling: Callable[[], bool] = _tracer_query()


#: whether torch.compile is tracing the code that calls it (True inside the traced region): torch's own function
#: itself, so that a hot path pays one call (its callers test it last, after their cheap checks)
compiling = _is_compiling


def numpy_on(device: torch.device) -> bool:
    """Whether a tensor on `device` may take a numpy host path here: a CPU device, not while torch.compile traces."""
    return device.type == "cpu" and not _is_compiling()


class PerThreadTable:
    """Entries (scratch arrays and the tensors wrapping them, keyed by shape) that a CPU host path makes once and
    reuses, kept per thread so that two threads never share one: a thread's table starts over when it holds
    `capacity` entries, which bounds what a run over ever new shapes keeps, and an entry of more than `max_numel`
    elements is not kept (a large tensor's work costs far more than making its scratch again)."""

    __slots__ = ("_local", "capacity", "max_numel")

    def __init__(self, capacity: int, max_numel: Optional[int] = None) -> None:
        self._local = threading.local()
        self.capacity = capacity
        self.max_numel = max_numel

    def get(self, key: Hashable) -> Any:
        """This thread's entry for `key`, or None."""
        table = getattr(self._local, "table", None)
        return None if table is None else table.get(key)

    def keep(self, key: Hashable, entry: Any, numel: int = 0) -> Any:
        """Keep `entry` (of `numel` elements) for `key` in this thread's table, unless it is larger than `max_numel`;
        return it."""
        if self.max_numel is not None and numel > self.max_numel:
            return entry
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = {}
        elif len(table) >= self.capacity:
            table.clear()
        table[key] = entry
        return entry
