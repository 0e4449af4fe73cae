"""The merge of the multi-rank deferred read-back (`tedebug.stats.distributed._merge_slots`): from the gathered
matrix, every slot's row is what the rule per buffer gives - the rows of the ranks that fed it, in rank order, less
the later rows of a replica already kept (`keep_first_replicas`), merged by `combine_rows` (one row: itself) - bit
for bit, for slots of different columns, fed by different ranks, with and without replicas."""

import random

import pytest
import torch

from tedebug.stats.definitions import Column, StatRequest, columns_for, combine_rows
from tedebug.stats.distributed import _SLOT_HEADER, GroupLayout, _merge_slots
from tedebug.stats.reduce import keep_first_replicas

HP_COLUMNS = columns_for([StatRequest.parse_hp(name) for name in ("min", "max", "mean", "std", "l1_norm")])
FP8_COLUMNS = (Column("numel"), Column("underflows_num", ("", False)), Column("sq_err", ("", False)))


def _per_buffer(layout, key, matrix):
    """The rule, one buffer at a time (what the read-back did before the slots were merged together)."""
    at, columns = layout.offsets[key], layout.columns[key]
    rows = [
        (r[at + _SLOT_HEADER : at + _SLOT_HEADER + len(columns)], r[at + 1]) for r in matrix.tolist() if r[at] != 0.0
    ]
    kept = keep_first_replicas(rows)
    return list(kept[0]) if len(kept) == 1 else combine_rows(columns, torch.tensor(kept, dtype=torch.float64)).tolist()


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_slot_gets_the_per_buffer_rule_bit_for_bit(ranks, seed):
    rng = random.Random(seed * 100 + ranks)
    layout = GroupLayout()
    keys = [("layer", f"t{i}", ()) for i in range(40)]
    layout.extend({key: HP_COLUMNS if i % 3 else FP8_COLUMNS for i, key in enumerate(keys)})
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(ranks, layout.length, generator=g, dtype=torch.float64) * 1e3
    mine = []
    for i, key in enumerate(keys):
        at = layout.offsets[key]
        numel = at + _SLOT_HEADER  # the numel column comes first in both column sets
        matrix[:, numel] = torch.randint(1, 500, (ranks,), generator=g).double()
        fed = [rng.random() < 0.7 for _ in range(ranks)]
        fed[0] = True  # rank 0's view: it fed every key it merges
        replica = [float(rng.choice([-1, -1, 0, 2])) if i % 4 else -1.0 for _ in range(ranks)]
        for r in range(ranks):
            matrix[r, at], matrix[r, at + 1] = float(fed[r]), replica[r]
        mine.append(key)
    matrix[0, layout.offsets[keys[5]] + _SLOT_HEADER + 1] = float("nan")
    got = _merge_slots(layout, mine, matrix)
    assert set(got) == set(mine)
    for key in mine:
        want = _per_buffer(layout, key, matrix)
        assert len(got[key]) == len(want)
        assert all(a == b or (a != a and b != b) for a, b in zip(got[key], want)), key


def test_a_replica_counts_once_and_unfed_ranks_not_at_all():
    layout = GroupLayout()
    key = ("layer", "activation", ())
    layout.extend({key: FP8_COLUMNS})
    at = layout.offsets[key]
    matrix = torch.zeros(4, layout.length, dtype=torch.float64)
    #          fed  replica  numel underflows sq_err
    rows = [(1.0, 0.0, 10.0, 1.0, 0.5), (1.0, 0.0, 10.0, 1.0, 0.5), (1.0, 2.0, 6.0, 2.0, 0.25), (0.0, -1.0, 99, 9, 9)]
    for r, row in enumerate(rows):
        matrix[r, at : at + 5] = torch.tensor(row, dtype=torch.float64)
    assert _merge_slots(layout, [key], matrix) == {key: [16.0, 3.0, 0.75]}
