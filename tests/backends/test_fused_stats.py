"""`tedebug.backends.fused_stats.FusedStats` on CPU: the mapping of statistic names to views of a kernel's vector
and the vector order its one-gather rows read."""

import torch

from tedebug.backends.fused_stats import (
    COLUMNWISE_STATS,
    FP8_STATS,
    FP8_STATS_WITH_SCALE,
    ROWWISE_STATS,
    FusedStats,
)


def test_keys_in_order_follow_the_vector_and_are_one_tuple_per_table():
    for table in (FP8_STATS, FP8_STATS_WITH_SCALE, ROWWISE_STATS, COLUMNWISE_STATS):
        vector = torch.arange(float(max(table.values()) + 1), dtype=torch.float64)
        a, b = FusedStats(vector, table), FusedStats(vector.clone(), table)
        order = a.keys_in_order
        assert [table[name] for name in order] == sorted(table.values())
        assert b.keys_in_order is order  # the same tuple for every vector of this table
        for name in order:
            assert a[name].item() == float(table[name])


def test_keys_in_order_of_an_ad_hoc_table():
    table = {"b": 1, "a": 2, "c": 0}
    stats = FusedStats(torch.tensor([10.0, 11.0, 12.0], dtype=torch.float64), table)
    assert stats.keys_in_order == ("c", "b", "a")
    assert dict(stats.items()).keys() == table.keys() and len(stats) == 3
    assert stats["a"].item() == 12.0
