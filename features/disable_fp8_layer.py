"""`DisableFP8Layer`: deprecated name of `DisableQuantizationLayer` (same parameters and behaviour; a
DeprecationWarning is emitted when the feature is first used in a session)."""

from __future__ import annotations

import warnings

from tedebug.features.disable_quantization_layer import DisableQuantizationLayer
from tedebug.registry import register_feature


@register_feature(namespace="transformer_engine")
class DisableFP8Layer(DisableQuantizationLayer):
    """Deprecated alias of DisableQuantizationLayer."""

    def __init__(self) -> None:
        super().__init__()
        warnings.warn(
            "DisableFP8Layer is deprecated; use DisableQuantizationLayer (same parameters)",
            DeprecationWarning,
            stacklevel=2,
        )
