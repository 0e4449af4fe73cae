"""``nvdlfw_inspect.config_manager.ConfigManager``: the active session's per-layer config lookup."""

from __future__ import annotations

__all__ = ["ConfigManager"]


class ConfigManager:
    """``get_config_for_layer(name)`` -> ``{namespace: {feature: config}}`` of the one section selecting the layer
    (``{}`` when none does); ``reset()`` drops the cached lookups.  Both need an initialised session."""

    @staticmethod
    def get_config_for_layer(layer_name: str) -> dict:
        from tedebug import debug_api

        return debug_api.session().config.layer_config(layer_name)

    @staticmethod
    def reset() -> None:
        from tedebug import debug_api

        if debug_api.DEBUG_MANAGER is not None:
            debug_api.DEBUG_MANAGER.config._cache.clear()
