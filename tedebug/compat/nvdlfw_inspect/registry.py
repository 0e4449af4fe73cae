"""``nvdlfw_inspect.registry``: ``Registry.register_feature``, ``Registry.register_namespace_api``, ``api_method``.

The decorators tag classes (`tedebug.registry`); each `debug_api.initialize` registers the tagged classes of the
modules it loads into a fresh per-session registry.  There is no process-global ``Registry.data``.
"""

from __future__ import annotations

from tedebug.registry import api_method, register_feature, register_namespace_api

__all__ = ["Registry", "api_method"]


class Registry:
    """nvdlfw-inspect's registry decorators (static; the registry itself is per session in tedebug)."""

    @staticmethod
    def register_feature(namespace: str = "transformer_engine"):
        """``@Registry.register_feature(namespace="...")``: a feature class of that namespace."""
        return register_feature(namespace)

    @staticmethod
    def register_namespace_api(namespace: str):
        """``@Registry.register_namespace_api(namespace="...")``: the API class of a custom namespace."""
        return register_namespace_api(namespace)
