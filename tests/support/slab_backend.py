"""A CPU stand-in for the kernel backend's row launches (`cupy_stats.basic_stats_into` / `basic_stats_group_into`):
each writes (numel, the basic partials in `keys` order) as float64 at the row address it is given, as the CUDA
kernel writes a row of the statistics engine's slab.  Patched in as `tedebug.stats.engine.backend_for`, it sends
CPU tensors down the GPU path's bookkeeping (slab rows, launch groups, one-row steps of slab rows)."""

from __future__ import annotations

import ctypes
import types

import torch

from tedebug.backends import torch_ref


def slab_backend(keys=torch_ref.BASIC_KEYS, calls=None):
    """The stand-in module for partials `keys` (any order of `torch_ref.BASIC_KEYS`); `calls`, when given, gets
    every tensor a row is written for."""
    row_keys = ("numel",) + tuple(keys)

    def basic_stats_into(x, address):
        if calls is not None:
            calls.append(x)
        partials = torch_ref.basic_partials(x)
        values = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64)] + [partials[k] for k in keys])
        ctypes.memmove(address, values.data_ptr(), 8 * len(row_keys))

    def basic_stats_group_into(items):
        for x, address in items:
            basic_stats_into(x, address)

    return types.SimpleNamespace(
        BASIC_KEYS=tuple(keys),
        BASIC_ROW_KEYS=row_keys,
        basic_stats_into=basic_stats_into,
        basic_stats_group_into=basic_stats_group_into,
        basic_partials=torch_ref.basic_partials,
    )
