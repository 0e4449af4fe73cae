"""The two host-side halves of the multi-rank deferred read-back (`tedebug.stats.distributed`), each a batch at a
time instead of a buffer at a time, against the rule per buffer:

- the vector a rank sends (`GroupReducer._vector`): every slot holds the buffer's row (`_device_row`), its fed flag
  and replica id, with slab rows and kernels' statistics vectors written in batches;
- the merge of the gathered matrix (`_merge_slots`): every slot's row is what the rule per buffer gives - the rows of
  the ranks that fed it, in rank order, less the later rows of a replica already kept (`keep_first_replicas`),
  merged by `combine_rows` (one row: itself) - bit for bit, for slots of different columns, fed by different
  ranks, with and without replicas."""

import random

import pytest
import torch

from tedebug.backends.fused_stats import ROWWISE_STATS
from tedebug.stats import StatsEngine
from tedebug.stats import distributed
from tedebug.stats import engine as engine_module
from tedebug.stats.definitions import Column, StatRequest, columns_for, combine_rows
from tedebug.stats.distributed import _SLOT_HEADER, GroupLayout, GroupReducer, _merge_slots
from tedebug.stats.reduce import keep_first_replicas

from support.features import RecordingSink
from support.kernel_inputs import with_reference_vector
from support.slab_backend import slab_backend

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


FP8_REQUESTS = tuple(StatRequest(name, name, recipe="") for name in ("underflows%", "mse", "scale_inv_min"))
HP_REQUESTS = tuple(StatRequest.parse_hp(name) for name in ("min", "max", "std", "l1_norm"))


def test_the_vector_holds_every_buffers_row_and_batches_the_usual_ones(monkeypatch):
    engine = StatsEngine(RecordingSink())
    g = torch.Generator().manual_seed(3)
    engine.feed("host", "activation", HP_REQUESTS, torch.randn(8, 16, generator=g), iteration=0)  # read on the host
    monkeypatch.setattr(engine_module, "backend_for", lambda x, b=slab_backend(): b)  # slab rows from CPU tensors
    for i in range(5):  # one slab row each: batched
        engine.feed(f"l{i}", "activation", HP_REQUESTS, torch.randn(8, 16, generator=g), iteration=0)
    for _ in range(2):  # two slab rows (microbatches): its own row
        engine.feed("twice", "activation", HP_REQUESTS, torch.randn(4, 16, generator=g), iteration=0)
    engine.feed("few", "gradient", HP_REQUESTS[:1], torch.randn(4, 4, generator=g), iteration=0)  # other columns
    for i in range(3):  # a kernel's vector holding every column: batched
        x = torch.randn(16, 32, generator=g) * 10.0**i
        engine.feed(f"q{i}", "activation", FP8_REQUESTS, x, iteration=0, quantized={"": with_reference_vector(x)})
    x = torch.randn(16, 32, generator=g)  # a vector without the count: its own row
    q = with_reference_vector(x, ROWWISE_STATS)
    engine.feed("no_count", "activation", FP8_REQUESTS[:2], x, iteration=0, quantized={"": q})
    buffers = engine._store.fed()
    assert buffers[0].key.layer == "host" and buffers[0].host_row is not None
    assert sum(len(b.slab_rows) == 1 and not b.vector_rows for b in buffers) == 6
    assert sum(len(b.vector_rows) == 1 for b in buffers) == 4
    layout = GroupLayout()
    layout.extend({b.key: b.columns for b in buffers})
    layout.extend({("unfed", "activation", ()): HP_COLUMNS})  # a slot of the layout this rank did not feed
    replicas = {("l1", "activation"): 0.0, ("q2", "activation"): 4.0}
    reducer = GroupReducer()
    cpu = torch.device("cpu")
    want = torch.zeros(layout.length, dtype=torch.float64)
    want[0] = 1.0
    for b in buffers:
        at = layout.offsets[b.key]
        want[at] = 1.0
        want[at + 1] = replicas.get((b.key.layer, b.key.tensor), distributed.NO_REPLICA)
        want[at + _SLOT_HEADER : at + _SLOT_HEADER + len(b.columns)] = reducer._device_row(b, cpu)
    own_rows = []
    real = reducer._device_row
    monkeypatch.setattr(reducer, "_device_row", lambda b, d: own_rows.append(b.key.layer) or real(b, d))
    vector, mine = reducer._vector(layout, buffers, True, replicas, cpu)
    assert sorted(own_rows) == ["no_count", "twice"]  # the others went in batches or with the header
    assert vector.dtype == torch.float64 and torch.equal(vector, want)
    assert mine == {b.key: want[layout.offsets[b.key] + 1].item() for b in buffers}
