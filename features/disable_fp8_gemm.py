"""`DisableFP8GEMM`: deprecated name of `DisableQuantizationGEMM` (same parameters and behaviour; a
DeprecationWarning is emitted when the feature is first used in a session)."""

from __future__ import annotations

import warnings

from tedebug.features.disable_quantization_gemm import DisableQuantizationGEMM
from tedebug.registry import register_feature


@register_feature(namespace="transformer_engine")
class DisableFP8GEMM(DisableQuantizationGEMM):
    """Deprecated alias of DisableQuantizationGEMM."""

    def __init__(self) -> None:
        super().__init__()
        warnings.warn(
            "DisableFP8GEMM is deprecated; use DisableQuantizationGEMM (same parameters)",
            DeprecationWarning,
            stacklevel=2,
        )
