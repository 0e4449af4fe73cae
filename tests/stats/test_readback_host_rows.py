"""A step whose every buffer was fed as host values (CPU tensors, basic statistics) is read back as it is:
`RowsInFlight.host_rows` returns each buffer's own host row, with no copy and no tensor operator (counted)."""

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
