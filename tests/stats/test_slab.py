"""`RowSlab` on the CPU: rows handed out in order across chunks, each with the address where its row starts (what a
kernel writes to), the same rows again after `reset`, and `host_tensor` holding exactly the rows handed out.
Scratch rows (`take_scratch`, with the stand-in backend of `tests/support/slab_backend.py`): written once, by one
call per chunk, before they are read or the rows handed out again, and only those."""

import ctypes

import torch

from tedebug.stats import slab as slab_module
from tedebug.stats.slab import RowSlab, ScratchAreas
from support.slab_backend import slab_backend


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


def _scratch_fill(address: int, value: float, width: int) -> None:
    """What the stand-in backend's scratch launch leaves: a waiting flag and the row (here `value` everywhere)."""
    values = torch.full((width + 1,), value, dtype=torch.float64)
    values[0] = 1.0
    ctypes.memmove(address, values.data_ptr(), 8 * (width + 1))


def test_scratch_rows_are_written_once_before_they_are_read(monkeypatch):
    monkeypatch.setattr(slab_module, "CHUNK_ROWS", 3)
    finished = []
    backend = slab_backend(keys=("min", "max", "sum", "l1_norm"), scratch=True, finished=finished)
    slab = RowSlab(torch.device("cpu"), 5)
    plain_index, _ = slab.take()  # a row its launch writes itself, among the scratch rows
    slab.row(plain_index).fill_(-1.0)
    taken = [slab.take_scratch(backend) for _ in range(4)]
    assert [index for index, _ in taken] == [1, 2, 3, 4] and slab.used == 5
    assert len({address for _, address in taken}) == 4
    for index, address in taken:
        _scratch_fill(address, float(index), 5)
    assert finished == []  # nothing is written until a row is read
    expected = torch.tensor([-1.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)[:, None].expand(5, 5)
    assert torch.equal(slab.host_tensor(), expected)
    assert finished == [2, 2]  # one call per chunk in use; the plain row left alone
    assert torch.equal(slab.host_tensor(), expected) and finished == [2, 2]  # written once
    slab.reset()
    assert finished == [2, 2]  # every scratch was written: reset has nothing to finish
    index, address = slab.take_scratch(backend)
    _scratch_fill(address, 9.0, 5)
    assert slab.row(index)[0].item() == 9.0 and finished == [2, 2, 1]


def test_a_reset_writes_the_scratch_rows_nobody_read(monkeypatch):
    """A scratch left waiting would become the row of a later step's plain row at the same index."""
    finished = []
    backend = slab_backend(keys=("min", "max"), scratch=True, finished=finished)
    slab = RowSlab(torch.device("cpu"), 3)
    _, address = slab.take_scratch(backend)
    _scratch_fill(address, 5.0, 3)
    slab.reset()
    assert finished == [1]
    index, _ = slab.take()
    slab.row(index).fill_(7.0)
    _, second = slab.take_scratch(backend)
    _scratch_fill(second, 8.0, 3)
    assert slab.host_tensor().tolist() == [[7.0] * 3, [8.0] * 3] and finished == [1, 1]


def test_scratch_rows_of_two_backends_in_one_step():
    """The first backend's rows are written when the second's are taken; a larger scratch gets new areas."""
    first_done, second_done = [], []
    first = slab_backend(keys=("min", "max"), scratch=True, finished=first_done)
    second = slab_backend(keys=("min", "max"), scratch=True, finished=second_done, extra_scratch_bytes=64)
    slab = RowSlab(torch.device("cpu"), 3)
    _, a = slab.take_scratch(first)
    _scratch_fill(a, 1.0, 3)
    _, b = slab.take_scratch(second)
    assert first_done == [1]
    _scratch_fill(b, 2.0, 3)
    assert slab.host_tensor().tolist() == [[1.0] * 3, [2.0] * 3]
    assert second_done == [1]


def test_two_slabs_taking_turns_share_their_scratch_areas():
    """The engine's two slab sets of a device: the same areas; a slab taking a scratch row while the other has rows
    waiting there has those written first."""
    finished = []
    backend = slab_backend(keys=("min", "max"), scratch=True, finished=finished)
    areas = ScratchAreas(torch.device("cpu"))
    first, second = RowSlab(torch.device("cpu"), 3, areas), RowSlab(torch.device("cpu"), 3, areas)
    _, a = first.take_scratch(backend)
    _scratch_fill(a, 1.0, 3)
    first.start_host_copy()  # its read-back: the row written
    assert finished == [1]
    _, b = second.take_scratch(backend)
    assert b == a  # the other set's launches use the same scratch
    _scratch_fill(b, 2.0, 3)
    _, c = first.take_scratch(backend)  # (a slab reset without its rows read: not the engine's order)
    assert finished == [1, 1] and c != b  # the second slab's row was written before the first took the areas
    _scratch_fill(c, 3.0, 3)
    assert second.host_tensor().tolist() == [[2.0] * 3]
    assert first.host_tensor().tolist() == [[1.0] * 3, [3.0] * 3] and finished == [1, 1, 1]
