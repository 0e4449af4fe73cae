"""A CPU stand-in for the kernel backend's row launches (`cupy_stats.basic_stats_into` / `basic_stats_group_into`):
each writes (numel, the basic partials in `keys` order) as float64 at the row address it is given, as the CUDA
kernel writes a row of the statistics engine's slab.  Patched in as `tedebug.stats.engine.backend_for`, it sends
CPU tensors down the GPU path's bookkeeping (slab rows, launch groups, one-row steps of slab rows).

`slab_backend(scratch=True)` also has the scratch launches (`cupy_stats.basic_stats_scratch_into` /
`basic_stats_group_scratch_into` / `row_scratch_bytes` / `finish_rows`): a launch writes a waiting flag and the row
into the row's scratch, and `finish_rows` copies each waiting one to its row and clears its flag, as the kernels
leave partials that ``ted_stats_finish_rows`` turns into rows.  `finished`, when given, gets the number of rows
each `finish_rows` call wrote."""

from __future__ import annotations

import ctypes
import types

import torch

from tedebug.backends import torch_ref


def slab_backend(
    keys=torch_ref.BASIC_KEYS, calls=None, scratch=False, finished=None, extra_scratch_bytes=0, fixed_row=None
):
    """The stand-in module for partials `keys` (any order of `torch_ref.BASIC_KEYS`); `calls`, when given, gets
    every tensor a row is written for; `scratch`: with the scratch launches (`extra_scratch_bytes` added to its
    scratch size).  `fixed_row` (a tensor): every launch writes the row of that one tensor, computed once, whatever
    tensor it is given (no arithmetic per launch: for timing the bookkeeping around the launches, as
    tools/probe_hot_path.py's ``--only gpu-path`` does; the logged values are then that tensor's)."""
    row_keys = ("numel",) + tuple(keys)

    def row_of(x):
        partials = torch_ref.basic_partials(x)
        return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64)] + [partials[k] for k in keys])

    fixed = row_of(fixed_row) if fixed_row is not None else None

    def basic_stats_into(x, address):
        if calls is not None:
            calls.append(x)
        values = fixed if fixed is not None else row_of(x)
        ctypes.memmove(address, values.data_ptr(), 8 * len(row_keys))

    def basic_stats_group_into(items):
        for x, address in items:
            basic_stats_into(x, address)

    backend = types.SimpleNamespace(
        BASIC_KEYS=tuple(keys),
        BASIC_ROW_KEYS=row_keys,
        basic_stats_into=basic_stats_into,
        basic_stats_group_into=basic_stats_group_into,
        basic_partials=torch_ref.basic_partials,
    )
    if not scratch:
        return backend
    row_bytes = 8 * len(row_keys)

    def basic_stats_scratch_into(x, address):
        basic_stats_into(x, address + 8)
        ctypes.c_double.from_address(address).value = 1.0  # partials waiting

    def basic_stats_group_scratch_into(items):
        for x, address in items:
            basic_stats_scratch_into(x, address)

    def finish_rows(device, scratch_ptr, scratch_bytes, rows_ptr, width, count):
        assert device.type == "cpu" and width == len(row_keys)
        written = 0
        for r in range(count):
            flag = ctypes.c_double.from_address(scratch_ptr + r * scratch_bytes)
            if flag.value:
                ctypes.memmove(rows_ptr + r * row_bytes, scratch_ptr + r * scratch_bytes + 8, row_bytes)
                flag.value = 0.0
                written += 1
        if finished is not None:
            finished.append(written)

    backend.basic_stats_scratch_into = basic_stats_scratch_into
    backend.basic_stats_group_scratch_into = basic_stats_group_scratch_into
    backend.row_scratch_bytes = lambda device: 8 + row_bytes + extra_scratch_bytes
    backend.finish_rows = finish_rows
    return backend
