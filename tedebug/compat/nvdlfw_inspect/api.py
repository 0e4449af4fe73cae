"""``nvdlfw_inspect.api`` on top of `tedebug.debug_api` (``import tedebug.compat.nvdlfw_inspect.api as debug_api``).

Every function is tedebug's, with one difference in `initialize`: keyword arguments nvdlfw-inspect does not read
(``logger=`` from TE's docs, ``extensions=`` from old Megatron snippets) are ignored, as nvdlfw-inspect does, but
with a `UserWarning` naming them; `tedebug.debug_api.initialize` raises TypeError for them instead.  Every other
attribute (``DEBUG_MANAGER``, the namespaces ``debug_api.transformer_engine`` / ``debug_api.<custom>``, the
section-level APIs such as ``debug_api.log_tensor_stats``) is looked up in `tedebug.debug_api` at access time.
"""

from __future__ import annotations

import warnings
from typing import Any

from tedebug import debug_api as _debug_api

end_debug = _debug_api.end_debug
step = _debug_api.step
initialize_training_step = _debug_api.initialize_training_step
log_message = _debug_api.log_message
list_features = _debug_api.list_features
explain_features = _debug_api.explain_features
infer_and_assign_layer_names = _debug_api.infer_and_assign_layer_names
set_tensor_reduction_group = _debug_api.set_tensor_reduction_group
get_tensor_reduction_group = _debug_api.get_tensor_reduction_group
set_weight_tensor_tp_group_reduce = _debug_api.set_weight_tensor_tp_group_reduce

_PASSED_ON = ("tb_writer", "default_logging_enabled", "background_logging")


def initialize(
    config_file: Any = "",
    feature_dirs: Any = None,
    statistics_logger: Any = None,
    log_dir: Any = ".",
    init_training_step: int = 0,
    **kwargs: Any,
) -> None:
    """nvdlfw-inspect's ``initialize``; see the module docstring for the keyword arguments it ignores."""
    ignored = sorted(k for k in kwargs if k not in _PASSED_ON)
    if ignored:
        hint = " (the statistics sink argument is statistics_logger=)" if "logger" in ignored else ""
        warnings.warn(
            f"initialize: ignoring keyword argument(s) {ignored}, which nvdlfw-inspect does not read{hint}",
            UserWarning,
            stacklevel=2,
        )
    _debug_api.initialize(
        config_file,
        feature_dirs,
        statistics_logger,
        log_dir,
        init_training_step,
        **{k: v for k, v in kwargs.items() if k in _PASSED_ON},
    )


def __getattr__(name: str) -> Any:
    try:
        return getattr(_debug_api, name)
    except AttributeError:
        raise AttributeError(f"module 'nvdlfw_inspect.api' (tedebug.compat) has no attribute {name!r}") from None
