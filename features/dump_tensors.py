"""`DumpTensors`: save tensors to disk with `torch.save`, on the feature's schedule.

Params: ``high_precision_tensor`` (bool, default False), ``quantized_tensor`` (bool, default False), the tensor
selection and the schedule keys.  One file per (iteration, layer, tensor):
``<log_dir>/tensor_dumps/rank_<R>/iter_<iteration:06d>/<layer>_<tensor>.pt`` (layer and tensor names with
``/ \\ : * ? " < > |``, space and ``.`` replaced by ``_``, as TransformerEngine names them; see `dump_stem` for
names that would not make a safe or unique file name) holding a dict with the keys ``high_precision`` (a detached
clone of the high-precision tensor) and/or ``quantized`` (the quantized GEMM operand: the rowwise one, else the
columnwise one; a plain tensor when that operand runs in high precision).  An existing file is overwritten (with a
log line).  Rowwise and columnwise operands that are different objects are an error: one file cannot hold both
without ambiguity.

Safe artefacts: a file holds only tensors and plain containers, so it loads with
``torch.load(path, weights_only=True)`` (no code runs at load).  A quantized operand is stored as a dict
(`plain_quantized`): ``format`` (its class name), ``shape`` (list), ``dtype`` (e.g. ``"float32"``), the plain
attributes of the tensor (``fp8_format``, ...), every data / scale tensor under its attribute name (None when that
direction is absent), ``dequantized`` (its high-precision value) and, for a hybrid tensor, ``rowwise_sub_storage``
/ ``columnwise_sub_storage`` in the same form.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any, Optional

import torch

from tedebug import active
from tedebug.features.base import ScheduledInspectFeature, log_once, scheduled_now
from tedebug.features.config_checks import FeatureConfigError
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.registry import api_method, register_feature

FLAGS = ("high_precision_tensor", "quantized_tensor")
DUMP_DIR = "tensor_dumps"


_UNSAFE_CHARS = '/\\:*?"<>| .'
_SANITIZE_TABLE = {ord(c): "_" for c in _UNSAFE_CHARS}


def sanitize_name(name: str) -> str:
    """Replace ``/ \\ : * ? " < > |``, space and ``.`` by ``_`` (file-name-safe layer / tensor names)."""
    return str(name).translate(_SANITIZE_TABLE)


#: the longest file-name stem of a layer name (bytes of UTF-8; file systems allow 255 for the whole name)
MAX_STEM_BYTES = 120
_HASH_CHARS = 12
#: characters that never go into a file name: control characters and the Unicode line separators
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]


def dump_stem(name: str) -> str:
    """The file-name part of a layer or tensor name: TransformerEngine's `sanitize_name` for ordinary names; a name
    with a control character (a NUL would cut the file name short) or longer than `MAX_STEM_BYTES` bytes has its
    control characters replaced by ``_``, is cut to fit, and ends in ``-<12 hex digits of its SHA-256>``, so
    different names never share a file and every file name stays within the file system's limit."""
    name = str(name)
    stem = sanitize_name(name)
    if not _UNSAFE.search(stem) and len(stem.encode("utf-8", "surrogatepass")) <= MAX_STEM_BYTES:
        return stem
    stem = _UNSAFE.sub("_", stem)
    budget = MAX_STEM_BYTES - _HASH_CHARS - 1
    stem = stem.encode("utf-8", "surrogatepass")[:budget].decode("utf-8", "ignore")
    return f"{stem}-{_digest(name)}"


def dump_path(log_dir: str, rank: int, iteration: int, layer_name: str, tensor_name: str) -> str:
    """Where the dump of one (iteration, layer, tensor) goes."""
    return os.path.join(
        log_dir,
        DUMP_DIR,
        f"rank_{rank}",
        f"iter_{iteration:06d}",
        f"{dump_stem(layer_name)}_{dump_stem(tensor_name)}.pt",
    )


_PLAIN_ATTRIBUTE_TYPES = (str, int, float, bool)


def plain_quantized(obj: QuantizedTensor) -> dict:
    """A quantized tensor as a dict of tensors and plain values (see the module docstring); nothing is shared with
    `obj`."""
    entry: dict = {
        "format": type(obj).__name__,
        "shape": list(obj.shape),
        "dtype": str(obj.dtype).replace("torch.", ""),
    }
    for key, value in vars(obj).items():
        if not key.startswith("_") and type(value) in _PLAIN_ATTRIBUTE_TYPES:
            entry[key] = value
        elif not key.startswith("_") and isinstance(value, str):  # str subclasses (enums): their value
            entry[key] = str(value.value if hasattr(value, "value") else value)
    for field in obj._tensor_fields():
        value = getattr(obj, field)
        entry[field] = None if value is None else value.detach().clone()
    for field in ("rowwise_sub_storage", "columnwise_sub_storage"):  # hybrid: its sub-storages hold the data
        sub = getattr(obj, field, None)
        if isinstance(sub, QuantizedTensor):
            entry[field] = plain_quantized(sub)
    entry["dequantized"] = obj.dequantize().detach().clone()
    return entry


def detached_clone(obj: Any) -> Any:
    """What is dumped for `obj`: a detached copy of a tensor, or `plain_quantized` of a quantized tensor."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if not isinstance(obj, QuantizedTensor):
        raise TypeError(f"DumpTensors: cannot dump an object of type {type(obj).__name__}")
    return plain_quantized(obj)


@register_feature(namespace="transformer_engine")
class DumpTensors(ScheduledInspectFeature):
    """Dump the selected tensors to ``<log_dir>/tensor_dumps`` (see the module docstring)."""

    PARAMS = FLAGS
    NOTE_STATS = False  # dumps do not take part in the statistics reduction schedule

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        for flag in FLAGS:
            if flag in params and not isinstance(params[flag], bool):
                raise FeatureConfigError(
                    f"{cls.__name__}: {flag} must be true or false, got {params[flag]!r}", path + (flag,)
                )

    @api_method
    def inspect_tensor(
        self,
        config: dict,
        layer_name: str,
        tensor_name: str,
        iteration: int,
        tensor: Optional[torch.Tensor] = None,
        tp_group: Any = None,
        tp_size: int = 1,
        rowwise_quantized_tensor: Any = None,
        columnwise_quantized_tensor: Any = None,
        quantizer: Any = None,
    ) -> None:
        if not scheduled_now(config, iteration):
            return
        name = type(self).__name__
        row, col = rowwise_quantized_tensor, columnwise_quantized_tensor
        if row is not None and col is not None and row is not col:
            raise ValueError(
                f"{name}: layer {layer_name!r}, tensor {tensor_name}: the rowwise and columnwise GEMM "
                f"operands are different objects (a mixed plan: one GEMM quantized differently or not "
                f"at all); dump quantized_tensor only where both GEMMs use the same quantization"
            )
        want_hp, want_q = config.get("high_precision_tensor", False), config.get("quantized_tensor", False)
        if not (want_hp or want_q):
            log_once(
                f"Feature={name}: neither high_precision_tensor nor quantized_tensor is set for tensor "
                f"{tensor_name}; nothing is dumped",
                layer_name,
            )
            return
        payload = {}
        if want_hp and tensor is not None:
            payload["high_precision"] = detached_clone(tensor)
        quantized = row if row is not None else col
        if want_q and quantized is not None:
            payload["quantized"] = detached_clone(quantized)
        if not payload:
            log_once(
                f"Feature={name}: tensor {tensor_name} has none of the requested representations; nothing is dumped",
                layer_name,
                logging.WARNING,
            )
            return
        current = active.session()
        path = dump_path(current.log_dir, current.rank, iteration, layer_name, tensor_name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            current.log_message(
                f"Feature={name}: overwriting existing dump {path}",
                layer_name,
                logging.INFO,
                extra_cachable_args=(path, iteration),
            )
        torch.save(payload, path)
        log_once(f"Feature={name}, API=inspect_tensor: {tensor_name}", layer_name)
