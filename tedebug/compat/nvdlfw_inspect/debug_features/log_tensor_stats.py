"""nvdlfw-inspect's generic, section-level ``LogTensorStats`` (namespace ``base``), as nvdlfw-inspect defines it.

Configured at section level (outside ``transformer_engine:``) and called explicitly by the training script:
``debug_api.log_tensor_stats(layer_name, tensor=t, tensor_name="activation", [iteration=], [skip_reduction=],
[reduction_group=])``.  TE never calls it, so in a TE-style run the block is inert.

- Statistics (case-insensitive, logged lower-case): min, max, mean, std (torch's unbiased std), l1_norm, l2_norm,
  computed in the tensor's dtype and returned as a dict of 0-d float32 tensors; each is also logged as
  ``<layer>_<tensor>_<stat>`` through the session's sinks at the call's iteration (values stay on the device; the
  sinks read them).  Unknown names are a config error at load (nvdlfw raises at the first call).
- Schedule: ``freq`` / ``start_step`` / ``end_step`` / ``start_end_list`` with tedebug's semantics
  (`tedebug.config.schedule`: inclusive ends, including the end of a ``start_end_list`` pair, where nvdlfw's
  generic feature excludes it).  An inactive iteration, a missing ``stats`` list or a ``tensor`` that is not a
  torch.Tensor returns ``{}``.
- Reduction (only with torch.distributed and more than one rank): ``skip_reduction=True`` keeps the local tensor;
  else ``reduction_group=`` or the group set by ``debug_api.set_tensor_reduction_group`` all-gathers the tensor
  along dim 0 and every rank of it logs; else the tensor is gathered on the last rank, which alone logs (the others
  return ``{}``).  These are collectives: every rank must make the same calls.

Subclasses (TE's statistics features subclass this class in nvdlfw) extend ``_get_supported_stats_list`` (callable
unbound with ``None`` as ``self``) and inherit the tensor-only ``parse_config_and_api``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from tedebug import active
from tedebug.compat.nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from tedebug.compat.nvdlfw_inspect.utils import (
    gather_along_first_dim,
    gather_tensor_on_last_rank,
    get_distributed_world_size,
)
from tedebug.config.schedule import SCHEDULE_KEYS, Schedule
from tedebug.features.base import schedule_of
from tedebug.registry import api_method, register_feature

GENERIC_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm")
CONFIG_KEYS = ("enabled", "tensors", "tensors_struct", "stats") + SCHEDULE_KEYS

_COMPUTE = {
    "min": torch.min,
    "max": torch.max,
    "mean": torch.mean,
    "std": torch.std,
    "l1_norm": lambda t: torch.linalg.vector_norm(t, ord=1),
    "l2_norm": lambda t: torch.linalg.vector_norm(t, ord=2),
}


@register_feature(namespace="base")
class LogTensorStats(GenericConfigAPIMapper):
    """Section-level statistics of tensors the script passes to ``debug_api.log_tensor_stats(...)``: min, max, mean,
    std, l1_norm, l2_norm, on a freq / start_step / end_step / start_end_list schedule."""

    def _get_supported_stats_list(self) -> set:
        return set(GENERIC_STATS)

    @classmethod
    def statistic_names(cls) -> list:
        """The names `tedebug schema --stats` lists (a subclass's extended `_get_supported_stats_list` included)."""
        return sorted(cls._get_supported_stats_list(None))

    @classmethod
    def validate_feature_config(cls, cfg: dict) -> None:
        """Config-load checks of this class (subclasses, e.g. TE-style features, are not checked: they define their
        own parameters and statistics): known keys, ``stats`` names, tensors given, schedule values valid."""
        if cls is not LogTensorStats:
            return
        for key in cfg:
            if key not in CONFIG_KEYS:
                error = ValueError(
                    f"LogTensorStats (section level): unknown key {key!r}; expected one of {', '.join(CONFIG_KEYS)}"
                )
                error.key_path = (key,)
                raise error
        if "tensors" not in cfg and "tensors_struct" not in cfg:
            raise ValueError(
                "Provide 'tensors_struct: List[Dict]' or 'tensors: List[str]' (the tensors whose "
                "statistics debug_api.log_tensor_stats logs)"
            )
        supported = set(GENERIC_STATS)
        levels = [((), cfg)] + [
            (("tensors_struct", i), entry)
            for i, entry in enumerate(cfg.get("tensors_struct") or ())
            if isinstance(entry, dict)
        ]
        for path, level in levels:
            stats = level.get("stats", [])
            if not isinstance(stats, list):
                error = ValueError(f"stats must be a list of statistic names, got {stats!r}")
                error.key_path = path + ("stats",)
                raise error
            for index, stat in enumerate(stats):
                if not isinstance(stat, str) or stat.lower() not in supported:
                    error = ValueError(
                        f"LogTensorStats (section level): statistic {stat!r} is not supported; "
                        f"supported: {sorted(supported)}"
                    )
                    error.key_path = path + ("stats", index)
                    raise error
            Schedule.from_config({**cfg, **level})

    @api_method
    def log_tensor_stats(
        self,
        config: dict,
        layer_name: str,
        tensor: Any = None,
        tensor_name: Optional[str] = None,
        iteration: int = 0,
        skip_reduction: bool = False,
        reduction_group: Any = None,
        **kwargs: Any,
    ) -> Dict[str, torch.Tensor]:
        session = active.session()
        if not isinstance(tensor, torch.Tensor) or not config.get("stats"):
            return {}
        if not schedule_of(config).is_active(iteration):
            return {}
        session.log_message(f"Feature=LogTensorStats, API=log_tensor_stats, TENSOR={tensor_name}: Called", layer_name)
        tensor = _reduce(session, layer_name, tensor.detach(), skip_reduction, reduction_group)
        if tensor is None:  # gathered on the last rank; this rank does not log
            return {}
        results = {}
        for stat in config["stats"]:
            name = stat.lower()
            value = _COMPUTE[name](tensor).to(torch.float32)
            results[name] = value
            session.metric_logger.log_scalar(
                f"{layer_name}_{tensor_name}_{name}", value, iteration, layer=layer_name, tensor=tensor_name, stat=name
            )
        return results


def _reduce(
    session: Any, layer_name: str, tensor: torch.Tensor, skip_reduction: bool, reduction_group: Any
) -> Optional[torch.Tensor]:
    if skip_reduction or get_distributed_world_size() == 1:
        return tensor
    group = reduction_group if reduction_group is not None else session.reduction_group
    if group is not None:
        return gather_along_first_dim(tensor, group)[0]
    session.log_message(
        "`reduction_group` not found and `skip_reduction` is False: the tensor is gathered on the "
        "last rank, which alone logs its statistics",
        layer_name,
        logging.WARNING,
    )
    return gather_tensor_on_last_rank(tensor)[0]
