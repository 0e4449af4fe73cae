"""`RowSlab` on the CPU: rows handed out in order across chunks, each with the address where its row starts (what a
kernel writes to), the same rows again after `reset`, and `host_tensor` holding exactly the rows handed out."""

import torch

from tedebug.stats import slab as slab_module
from tedebug.stats.slab import RowSlab


def test_rows_their_addresses_and_reuse(monkeypatch):
    monkeypatch.setattr(slab_module, "CHUNK_ROWS", 3)  # several chunks from a few rows
    slab = RowSlab(torch.device("cpu"), 5)
    taken = [slab.take() for _ in range(7)]
    assert [index for index, _ in taken] == list(range(7)) and slab.used == 7
    for index, address in taken:
        assert address == slab.row(index).data_ptr()
        slab.row(index).fill_(float(index))
    assert torch.equal(slab.host_tensor(), torch.arange(7, dtype=torch.float64)[:, None].expand(7, 5))
    slab.reset()
    assert slab.used == 0 and slab.take() == taken[0]  # the same rows (chunks are kept)
    assert slab.host_tensor().shape == (1, 5)
