"""tedebug.stats: statistic definitions (partials, combiners, final formulas), buffers, reduction and the engine.

Public names: `StatsEngine`, `StatRequest`, and the statistic kinds (`KINDS`, `HP_KINDS`, `QUANTIZED_KINDS`,
`BLOCKWISE_KIND`).
"""

from tedebug.stats.definitions import (
    BLOCKWISE_KIND,
    HP_KINDS,
    KINDS,
    QUANTIZED_KINDS,
    StatRequest,
    blockwise_stat_name,
)
from tedebug.stats.engine import StatsEngine

__all__ = [
    "BLOCKWISE_KIND",
    "HP_KINDS",
    "KINDS",
    "QUANTIZED_KINDS",
    "StatRequest",
    "StatsEngine",
    "blockwise_stat_name",
]
