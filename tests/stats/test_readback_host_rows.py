"""`RowsInFlight.host_rows`: a step whose every buffer was fed as host values (CPU tensors, basic statistics) is read
back as it is - each buffer's own host row, with no copy and no tensor operator (counted); buffers fed several times
(microbatches) are merged a batch at a time, each with its own bits."""

from __future__ import annotations

import torch

from tedebug.stats import StatsEngine
from tedebug.stats.readback import RowsInFlight
from support.concurrency import AtenCounter


def test_host_rows_of_a_cpu_step_are_the_fed_rows():
    engine = StatsEngine(None)
    g = torch.Generator().manual_seed(7)
    for i in range(3):
        engine.feed(f"L{i}", "activation", ("min", "max", "std"), torch.randn(8, 4, generator=g), iteration=0)
    fed = engine._store.fed()
    assert len(fed) == 3 and all(b.host_row is not None for b in fed)
    rows = RowsInFlight(fed)
    with AtenCounter() as counter:
        host = rows.host_rows()
    assert counter.ops == []
    assert list(host) == [b.key for b in fed]
    assert all(host[b.key] is b.host_row and len(b.host_row) == len(b.columns) for b in fed)


def test_microbatch_rows_merge_together_with_each_buffers_own_bits(monkeypatch):
    """Buffers fed several times in a step (microbatches) through the slab are merged a batch at a time (per columns
    and number of rows, `combine_row_batches`): each gets the bits `combine_rows` gives its own rows, whatever the
    number of microbatches (here 2, 3 and 5, and 7 for a buffer whose columns differ), in a few operators."""
    from support.slab_backend import slab_backend
    from tedebug.stats import StatRequest
    from tedebug.stats import engine as engine_module
    from tedebug.stats.definitions import combine_rows

    monkeypatch.setattr(engine_module, "backend_for", lambda x, b=slab_backend(): b)
    engine = StatsEngine(None)
    g = torch.Generator().manual_seed(11)
    hp = tuple(StatRequest.parse_hp(name) for name in ("min", "max", "std", "l1_norm", "dynamic_range"))
    fed_rows = {}  # layer -> the rows of its feeds, each in its buffer's columns order
    plan = [(f"L{i}", hp, 2 + i % 3 + (i % 3 == 2)) for i in range(12)] + [("other", hp[:2], 7)]
    for layer, stats, feeds in plan:
        for _ in range(feeds):
            x = torch.randn(16, 8, generator=g) * float(torch.rand((), generator=g) * 100)
            engine.feed(layer, "activation", stats, x, iteration=0)
            buffer = engine._store.get((layer, "activation", ()))
            slab, index = buffer.slab_rows[-1]
            fed_rows.setdefault(layer, []).append(
                [slab.row(index)[p].item() for p in buffer.row_positions(buffer.slab_keys)]
            )
    fed = engine._store.fed()
    rows = RowsInFlight(fed)
    with AtenCounter() as counter:
        host = rows.host_rows()
    for buffer in fed:
        want = combine_rows(buffer.columns, torch.tensor(fed_rows[buffer.key.layer], dtype=torch.float64)).tolist()
        assert host[buffer.key] == want, buffer.key.layer  # bit for bit (no NaN here)
    assert len(counter.ops) < 150  # per batch of (columns, rows): 130 here; merged a buffer at a time, 481
