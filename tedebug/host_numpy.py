"""When tedebug may compute a CPU result with numpy: a CPU tensor, outside torch.compile's tracing.

Some CPU paths take numpy where it gives the torch path's bits with fewer calls (FP8 current scaling and FP8
decoding, the statistics of small tensors, the Philox bytes of NVFP4 stochastic rounding).  torch.compile's tracer
(Dynamo) cannot follow numpy calls on a tensor's buffer (``Tensor.numpy()``), so while it traces, the torch path
runs instead: the same values, traced like any torch code.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

import numpy as np
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


class _Memory:
    """What numpy reads a parameter's memory through (`host_view`): its array interface only.  It keeps no
    reference to the tensor (a kept view must not keep a model's parameters alive), so a view is read only while
    the tensor asked for is alive: every caller copies or reduces it at once."""

    __slots__ = ("__array_interface__",)


#: torch dtype -> numpy's type string, for `host_view` (the dtypes numpy has)
_TYPESTR = {
    torch.float64: np.dtype(np.float64).str,
    torch.float32: np.dtype(np.float32).str,
    torch.float16: np.dtype(np.float16).str,
    torch.int64: np.dtype(np.int64).str,
    torch.int32: np.dtype(np.int32).str,
    torch.uint8: np.dtype(np.uint8).str,
}


def host_view(tensor: torch.Tensor) -> np.ndarray:
    """The values of a CPU tensor as a read-only numpy array over its memory, as ``tensor.numpy(force=True)``, but
    leaving the storage resizable when the tensor is a parameter (or another tensor subclass): ``Tensor.numpy()``
    marks a storage not resizable for good, and FSDP frees a gathered parameter by resizing its storage to 0
    ("Trying to resize storage that is not resizable").  A parameter is read through its array interface instead
    (1.2 µs on the CPU VM, where ``numpy()`` takes 0.7 and DLPack 3.9), made once per address, dtype, shape and
    strides and kept (`_VIEWS`): a parameter's memory stays where it is from step to step.  A kept array reads
    whatever tensor is at its address now, which is the very tensor asked for (the address is part of the key)."""
    if type(tensor) is torch.Tensor:
        return tensor.numpy(force=True)
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())
    view = _VIEWS.get(key)
    if view is not None:
        return view
    typestr = _TYPESTR.get(tensor.dtype)
    if typestr is None or tensor.is_conj() or tensor.is_neg():  # (not kept: such an array holds the tensor)
        return np.from_dlpack(tensor.detach())
    return _VIEWS.keep(key, _interface_view(tensor, typestr))


def _interface_view(tensor: torch.Tensor, typestr: str) -> np.ndarray:
    memory = _Memory()
    itemsize = tensor.element_size()
    memory.__array_interface__ = {
        "data": (tensor.data_ptr(), True),
        "shape": tuple(tensor.shape),
        "strides": tuple(stride * itemsize for stride in tensor.stride()),
        "typestr": typestr,
        "version": 3,
    }
    return np.asarray(memory)


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


#: (address, dtype, shape, strides) -> a parameter's array view (`host_view`), per thread
_VIEWS = PerThreadTable(256)
