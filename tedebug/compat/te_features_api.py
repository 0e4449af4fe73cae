"""``TEConfigAPIMapper`` for features written against TransformerEngine's ``transformer_engine.debug.features.api``.

TE's mapper parses ``gemms`` / ``gemms_struct`` / ``tensors`` / ``tensors_struct`` into the config of one hook call
(first matching entry, its keys over the outer ones); tedebug's `tedebug.registry.FeatureMapper` implements the same
algorithm, so the TE name is that class.  A TE-style feature (``@Registry.register_feature(namespace=
"transformer_engine")`` on a ``TEConfigAPIMapper`` subclass) then runs in tedebug's ``transformer_engine`` namespace
unchanged.
"""

from __future__ import annotations

from tedebug.registry import FeatureMapper

__all__ = ["TEConfigAPIMapper"]


class TEConfigAPIMapper(FeatureMapper):
    """TE's config mapper: ``parse_config_and_api(config, *, gemm_parsing, tensor_parsing, gemm=, tensor_name=)``."""
