"""``nvdlfw_inspect.debug_features.generic_feature_api``: `GenericConfigAPIMapper`, the tensor-only config parser
of section-level (namespace ``base``) features.  tedebug's own ``base`` namespace (`tedebug.namespace.BaseNamespace`)
plays the part of nvdlfw's ``GenericFrameworkAPI``."""

from __future__ import annotations

import copy
from typing import Any, Optional, Tuple

from tedebug.compat.nvdlfw_inspect.base import BaseConfigAPIMapper

__all__ = ["GenericConfigAPIMapper"]


class GenericConfigAPIMapper(BaseConfigAPIMapper):
    """``parse_config_and_api(config, tensor_parsing=, tensor_name=)``: ``(True, cfg without enabled)`` when the
    tensor is listed, ``(False, None)`` when it is not or `tensor_parsing` is false."""

    def parse_config_and_api(
        self, config: dict, *, tensor_parsing: bool = False, tensor_name: Optional[str] = None, **kwargs: Any
    ) -> Tuple[bool, Optional[dict]]:
        if not tensor_parsing:
            return False, None
        parsed = self._process_tensor_config(copy.deepcopy(config), tensor_name)
        if parsed is None:
            return False, None
        parsed.pop("enabled", None)
        return True, parsed
