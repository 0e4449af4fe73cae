"""Per-call parsing of one feature config: `gemms` / `gemms_struct` / `tensors` / `tensors_struct`.

`parse_feature_config` answers "does this feature config apply to (gemm, tensor), and with which parameters?".
It never mutates or aliases its input: the result is built from a deep copy.

Rules (as in TransformerEngine): the first `gemms_struct` / `tensors_struct` entry naming the requested GEMM /
tensor decides, and its keys override the feature-level keys; a `tensors_struct` may sit inside a `gemms_struct`
entry, not the other way round; a config without any GEMM (or tensor) list is an error when that kind of parsing
is asked for.

Tensor matching note: a scalar `tensors: activation` is accepted and treated as a one-name list. TransformerEngine
tests `name in value`, which for a string is substring containment; we compare names exactly. No valid tensor name
is a substring of another valid name, so the result is the same for every valid name.
"""

from __future__ import annotations

import copy
from typing import Optional

GEMM_NAMES = ("fprop", "dgrad", "wgrad")
TENSOR_NAMES = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")

#: tensor name -> (GEMM consuming the rowwise representation, GEMM consuming the columnwise one);
#: GEMM-output tensors have only the GEMM that produces them.
GEMMS_OF_TENSOR = {
    "weight": ("fprop", "dgrad"),
    "activation": ("fprop", "wgrad"),
    "gradient": ("dgrad", "wgrad"),
    "output": ("fprop", None),
    "wgrad": ("wgrad", None),
    "dgrad": ("dgrad", None),
}

MISSING_GEMMS = "Provide 'gemms_struct: List[Dict]' or 'gemms: List[str]' in the config yaml"
MISSING_TENSORS = "Provide 'tensors_struct: List[Dict]' or 'tensors: List[str]' in the config yaml."


def parse_feature_config(
    cfg: dict,
    *,
    gemm: Optional[str] = None,
    tensor_name: Optional[str] = None,
    gemm_parsing: bool,
    tensor_parsing: bool,
) -> Optional[dict]:
    """The parsed config for (gemm, tensor_name), or None when the feature config does not apply.

    GEMM parsing (when `gemm_parsing`) runs first and, if `tensor_parsing` is also set, parses the tensor inside the
    matched `gemms_struct` entry (or the outer config for `gemms`). With neither kind of parsing nothing applies.
    The result has `gemm` / `tensor` set, the list keys removed and `enabled` removed.
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"feature config must be a dict, got {type(cfg).__name__}")
    work = copy.deepcopy(cfg)
    if gemm_parsing:
        result = _parse_gemm(work, gemm, tensor_name, tensor_parsing)
    elif tensor_parsing:
        result = _parse_tensor(work, tensor_name)
    else:
        result = None
    if result is not None:
        result.pop("enabled", None)
    return result


def _check_gemm_names(names, where: str) -> None:
    for name in names:
        if name not in GEMM_NAMES:
            raise ValueError(f"Invalid gemm: {name!r} in {where}; expected one of {', '.join(GEMM_NAMES)}")


def _parse_gemm(cfg: dict, gemm: Optional[str], tensor_name: Optional[str], tensor_parsing: bool) -> Optional[dict]:
    if "gemms_struct" in cfg:
        entries = cfg.pop("gemms_struct")
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or "gemm" not in entry:
                raise ValueError(f"gemms_struct[{index}] must be a mapping with a 'gemm' key, got {entry!r}")
        _check_gemm_names([entry["gemm"] for entry in entries], "gemms_struct")
        for entry in entries:
            if entry["gemm"] != gemm:
                continue
            if "enabled" in entry:
                raise ValueError(f"'enabled' is not allowed inside a gemms_struct entry (gemm {gemm!r})")
            if tensor_parsing:
                entry = _parse_tensor(entry, tensor_name)
                if entry is None:
                    return None
            cfg.update(entry)
            return cfg
        return None
    if "gemms" in cfg:
        gemms = cfg.pop("gemms")
        _check_gemm_names(gemms, "gemms")
        if gemm not in gemms:
            return None
        if tensor_parsing:
            parsed = _parse_tensor(cfg, tensor_name)
            if parsed is None:
                return None
            cfg = parsed
        cfg["gemm"] = gemm
        return cfg
    raise ValueError(MISSING_GEMMS)


def _tensor_listed(tensors, tensor_name: Optional[str]) -> bool:
    if isinstance(tensors, str):
        return tensors == tensor_name
    return tensor_name in tensors


def _parse_tensor(cfg: dict, tensor_name: Optional[str]) -> Optional[dict]:
    if "tensors_struct" in cfg:
        entries = cfg.pop("tensors_struct")
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or "tensor" not in entry:
                raise ValueError(f"tensors_struct[{index}] must be a mapping with a 'tensor' key, got {entry!r}")
            if entry["tensor"] == tensor_name:
                cfg.update(entry)
                return cfg
        return None
    if "tensors" in cfg:
        tensors = cfg.pop("tensors")
        if not _tensor_listed(tensors, tensor_name):
            return None
        cfg["tensor"] = tensor_name
        return cfg
    raise ValueError(MISSING_TENSORS)
