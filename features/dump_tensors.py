"""`DumpTensors`: save tensors to disk with `torch.save` (te_debug_reference C.8).

Params: ``high_precision_tensor`` (bool, default False), ``quantized_tensor`` (bool, default False), the tensor
selection and the schedule keys.  One file per (iteration, layer, tensor):
``<log_dir>/tensor_dumps/rank_<R>/iter_<iteration:06d>/<layer>_<tensor>.pt`` (layer and tensor names with
``/ \\ : * ? " < > |``, space and ``.`` replaced by ``_``) holding a dict with the keys ``high_precision`` (a
detached clone of the high-precision tensor) and/or ``quantized`` (a detached clone of the quantized GEMM operand:
the rowwise one, else the columnwise one; a plain tensor when that operand runs in high precision).  An existing
file is overwritten (with a log line).  Rowwise and columnwise operands that are different objects are an error:
one file cannot hold both without ambiguity.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

import torch

from tedebug.feature_support import (
    FeatureConfigError,
    ScheduledInspectFeature,
    log_once,
    sanitize_name,
    scheduled_now,
    session,
)
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.registry import api_method, register_feature

FLAGS = ("high_precision_tensor", "quantized_tensor")
DUMP_DIR = "tensor_dumps"


def dump_path(log_dir: str, rank: int, iteration: int, layer_name: str, tensor_name: str) -> str:
    """Where the dump of one (iteration, layer, tensor) goes."""
    return os.path.join(log_dir, DUMP_DIR, f"rank_{rank}", f"iter_{iteration:06d}",
                        f"{sanitize_name(layer_name)}_{sanitize_name(tensor_name)}.pt")


def detached_clone(obj: Any) -> Any:
    """A detached copy of a tensor or quantized tensor that shares no storage with `obj` (quantizer dropped)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if not isinstance(obj, QuantizedTensor):
        raise TypeError(f"DumpTensors: cannot dump an object of type {type(obj).__name__}")
    clone = copy.copy(obj)
    clone.quantizer = None
    for field in obj._tensor_fields():
        value = getattr(obj, field)
        setattr(clone, field, None if value is None else value.detach().clone())
    for field in ("rowwise_sub_storage", "columnwise_sub_storage"):  # hybrid: its sub-storages hold the data
        if getattr(obj, field, None) is not None:
            setattr(clone, field, detached_clone(getattr(obj, field)))
    return clone


@register_feature(namespace="transformer_engine")
class DumpTensors(ScheduledInspectFeature):
    """Dump the selected tensors to ``<log_dir>/tensor_dumps`` (see the module docstring)."""

    PARAMS = FLAGS
    NOTE_STATS = False  # dumps do not take part in the statistics reduction schedule

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        for flag in FLAGS:
            if flag in params and not isinstance(params[flag], bool):
                raise FeatureConfigError(f"{cls.__name__}: {flag} must be true or false, got {params[flag]!r}",
                                         path + (flag,))

    @api_method
    def inspect_tensor(self, config: dict, layer_name: str, tensor_name: str, iteration: int,
                       tensor: Optional[torch.Tensor] = None, tp_group: Any = None, tp_size: int = 1,
                       rowwise_quantized_tensor: Any = None, columnwise_quantized_tensor: Any = None,
                       quantizer: Any = None) -> None:
        if not scheduled_now(config, iteration):
            return
        name = type(self).__name__
        row, col = rowwise_quantized_tensor, columnwise_quantized_tensor
        if row is not None and col is not None and row is not col:
            raise ValueError(f"{name}: layer {layer_name!r}, tensor {tensor_name}: the rowwise and columnwise GEMM "
                             f"operands are different objects (a mixed plan: one GEMM quantized differently or not "
                             f"at all); dump quantized_tensor only where both GEMMs use the same quantization")
        want_hp, want_q = config.get("high_precision_tensor", False), config.get("quantized_tensor", False)
        if not (want_hp or want_q):
            log_once(f"Feature={name}: neither high_precision_tensor nor quantized_tensor is set for tensor "
                     f"{tensor_name}; nothing is dumped", layer_name)
            return
        payload = {}
        if want_hp and tensor is not None:
            payload["high_precision"] = detached_clone(tensor)
        quantized = row if row is not None else col
        if want_q and quantized is not None:
            payload["quantized"] = detached_clone(quantized)
        if not payload:
            log_once(f"Feature={name}: tensor {tensor_name} has none of the requested representations; nothing is "
                     f"dumped", layer_name, logging.WARNING)
            return
        current = session()
        path = dump_path(current.log_dir, current.rank, iteration, layer_name, tensor_name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            current.log_message(f"Feature={name}: overwriting existing dump {path}", layer_name, logging.INFO,
                                extra_cachable_args=(path, iteration))
        torch.save(payload, path)
        log_once(f"Feature={name}, API=inspect_tensor: {tensor_name}", layer_name)
