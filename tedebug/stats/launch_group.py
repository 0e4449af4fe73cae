"""Statistics launches grouped per layer call: one kernel launch for the tensors a GEMM call logs together.

Why: on the GPU each statistics launch pays the ramp-up and the drain of a pass over memory, about 12 µs on an H200
whatever the tensor's size, and a layer that logs its six tensors launches six times per step.  A launch whose blocks
reduce up to three tensors at the same time (`cupy_stats.basic_stats_group_into`) pays them once (docs/performance.md,
section 3).

How: a layer opens a group around the code that feeds a GEMM call's tensors (`open_group` / `close_group`: the
forward of one linear GEMM, its backward).  `StatsEngine.feed` hands the launch of a tensor's statistics row to
`submit`, which queues it while this thread's group is open; the queue is launched `GROUP_MAX` tensors at a time
of one device and dtype, when it is full and when the group closes.  The rows' slab addresses are taken at the feed,
so the buffers are the same; only the launch moves, to a point the layer chooses where nothing has changed the
tensors since their feed (the group holds a reference to each, so none is freed before its launch).  Feeds outside
a group (a DebugQuantizer used without tedebug's layers, `debug_api` calls of user code) launch at once, as before.

A group is per thread (the backward of a layer runs on autograd's thread); an inner `open_group` while one is open
joins it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

#: the most tensors one grouped launch takes (``ted_stats_group``'s arguments; `cupy_stats.GROUP_MAX`, which this
#: module does not import: the kernel backends load only where a kernel runs; tests/backends/test_stats_group_launch.py
#: holds the two equal)
GROUP_MAX = 3

#: (the backend's group launch, the backend's lone launch, tensor, row address)
Deferred = Tuple[Callable[..., None], Callable[..., None], torch.Tensor, int]


class _OpenGroup(threading.local):
    """This thread's ``queue``: its open group's deferred launches, or None (the class attribute: a thread that
    never opened a group reads None without raising)."""

    queue: Optional[List[Deferred]] = None


_THREAD = _OpenGroup()


def pending() -> Optional[List[Deferred]]:
    """This thread's open group (its queue of deferred launches), or None when no group is open."""
    return _THREAD.queue


def open_group() -> bool:
    """Open a group on this thread; False when one is already open (the caller then leaves it to its opener)."""
    if _THREAD.queue is not None:
        return False
    _THREAD.queue = []
    return True


def close_group(opened: bool) -> None:
    """Launch what the group deferred and close it (`opened`: what `open_group` returned; False: nothing to do)."""
    if not opened:
        return
    queue = _THREAD.queue
    _THREAD.queue = None
    if queue:
        _launch(queue)


def submit(group_into: Optional[Callable[..., None]], into: Callable[..., None], x: Any, address: int) -> None:
    """Launch the statistics row of `x` into `address`: queued while this thread's group is open (launched once the
    queue holds `GROUP_MAX` tensors, or when the group closes), at once through `into` when no group is open or the
    backend has no group launch (`group_into` None)."""
    queue = _THREAD.queue
    if queue is None or group_into is None:
        into(x, address)
        return
    queue.append((group_into, into, x, address))
    if len(queue) >= GROUP_MAX:
        batch = queue[:]
        queue.clear()
        _launch(batch)


def _launch(queue: List[Deferred]) -> None:
    """Launch deferred rows: the tensors of one backend, device and dtype together, `GROUP_MAX` at a time, in feed
    order.  The usual queue (a GEMM call's tensors) is one such group: checked, not sorted into a dict."""
    group_into, _, x, _ = queue[0]
    device, dtype = x.get_device(), x.dtype  # (an index: no device object)
    groups: Iterable[List[Deferred]] = (queue,)
    for entry in queue:
        other = entry[2]
        if entry[0] is not group_into or other.dtype is not dtype or other.get_device() != device:
            by_key: dict = {}
            for queued in queue:
                x = queued[2]
                by_key.setdefault((queued[0], x.get_device(), x.dtype), []).append(queued)
            groups = by_key.values()
            break
    for entries in groups:
        for start in range(0, len(entries), GROUP_MAX):
            chunk = entries[start : start + GROUP_MAX] if len(entries) > GROUP_MAX else entries
            if len(chunk) == 1:
                _, into, x, address = chunk[0]
                into(x, address)
            else:
                chunk[0][0]([(x, address) for _, _, x, address in chunk])


__all__ = ["GROUP_MAX", "close_group", "open_group", "pending", "submit"]
