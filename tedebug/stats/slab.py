"""`RowSlab`: preallocated float64 partial rows on one device, handed out during a step and read back at its end.

A kernel backend that can write a whole statistics row to a device address (``basic_stats_into``) gets its rows
from here instead of allocating, gathering and merging small tensors per feed: a feed costs one kernel launch.
Rows are handed out in order from chunks of `CHUNK_ROWS` rows (a new chunk when the step needs more; chunks are
kept for the next steps), `host_rows()` reads every row handed out this step back with one transfer per chunk in
use, and `reset()` makes the rows available again for the next step.  `start_host_copy()` enqueues those
transfers without waiting (into pinned host mirrors of the chunks; the caller records an event and waits on it
before `host_rows()`), so the read-back can finish a step later (`tedebug.stats.readback`).

Rows are written on the stream current at the feed and read back on the stream current at the step; both are
the same stream in ordinary training (tedebug's own kernels launch on torch's current stream).

A row taken with `take_scratch` comes with a scratch area of the backend's size (`row_scratch_bytes`): its launch
leaves its per-block partials there, and the backend's `finish_rows` turns every such scratch into its row with one
launch per chunk before the rows are read (`start_host_copy`, `host_tensor`, `row`) or handed out again (`reset`).
The statistics pass then does its end once per step instead of once per launch (docs/performance.md, section 23).
The backend's `finish_rows` leaves a row taken with `take` alone, and marks each scratch it finished empty.  The
scratch areas (`ScratchAreas`) can be shared by slabs that take turns, as the engine's two slab sets of a device
do: once a slab's rows are written (launched at its read-back, on the stream), its areas are free for the other
slab's launches; a slab that takes a scratch row while another has rows waiting in the areas has those written
first.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

CHUNK_ROWS = 256


class ScratchAreas:
    """The row scratch areas of one device, `CHUNK_ROWS` rows per area, for one backend's scratch size at a time;
    `user`: the slab whose scratch rows may be waiting in them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.areas: List[torch.Tensor] = []
        self.bases: List[int] = []
        self.row_bytes = 0
        self.backend: Optional[Any] = None  # the backend whose `row_scratch_bytes` the areas have
        self.user: Optional["RowSlab"] = None

    def serve(self, slab: "RowSlab", backend: Any) -> None:
        """Make the areas `slab`'s, of `backend`'s size: the scratch rows another slab (or backend) left waiting are
        written first."""
        if self.user is not None:
            self.user._finish()
        self.user = slab
        if backend is not self.backend:
            size = backend.row_scratch_bytes(self.device)
            if size != self.row_bytes:
                self.areas, self.bases, self.row_bytes = [], [], size
            self.backend = backend

    def grow(self, chunk_index: int) -> None:
        """Areas up to `chunk_index` (zeros: an empty scratch has no partials waiting)."""
        while len(self.areas) <= chunk_index:
            area = torch.zeros((CHUNK_ROWS, self.row_bytes), dtype=torch.uint8, device=self.device)
            self.areas.append(area)
            self.bases.append(area.data_ptr())


class RowSlab:
    """Rows of `width` float64 values on `device` (see the module docstring); `scratch`: the scratch areas it shares
    with slabs that take turns with it (its own when not given)."""

    def __init__(self, device: torch.device, width: int, scratch: Optional[ScratchAreas] = None) -> None:
        if width <= 0:
            raise ValueError(f"RowSlab: width must be positive, got {width}")
        self.device = device
        self.width = width
        self._chunks: List[torch.Tensor] = []
        self._bases: List[int] = []
        self._used = 0
        self._row_bytes = 8 * width
        self._mirrors: List[torch.Tensor] = []  # pinned host copies of the chunks (CUDA slabs only)
        self._copied = 0  # rows `start_host_copy` enqueued into the mirrors since the last `reset`
        self._scratch = scratch if scratch is not None else ScratchAreas(device)  # (`take_scratch`)
        self._finisher: Optional[Any] = None  # the backend of this step's scratch rows, until `_finish` ran

    @property
    def used(self) -> int:
        """Rows handed out since the last `reset`."""
        return self._used

    def take(self) -> Tuple[int, int]:
        """Hand out the next row; returns its index and its device address (where `row(index)` starts: a kernel writes
        the row there)."""
        index = self._used
        chunk_index, row = divmod(index, CHUNK_ROWS)
        if chunk_index >= len(self._chunks):
            self._add_chunk()
        self._used = index + 1
        return index, self._bases[chunk_index] + row * self._row_bytes

    def take_scratch(self, backend: Any) -> Tuple[int, int]:
        """`take` for a launch that leaves its partials in a row scratch of `backend` (a module with
        `row_scratch_bytes` and `finish_rows`, as `tedebug.backends.cupy_stats`): returns the row's index and its
        scratch's device address; the row is written by ``backend.finish_rows`` before it is read.  Scratch rows
        of another backend taken earlier in the step are written first."""
        scratch = self._scratch
        if scratch.user is not self or backend is not scratch.backend:
            scratch.serve(self, backend)
        index = self._used
        chunk_index, row = divmod(index, CHUNK_ROWS)
        if chunk_index >= len(self._chunks):
            self._add_chunk()
        if chunk_index >= len(scratch.areas):
            scratch.grow(chunk_index)
        self._used = index + 1
        self._finisher = backend
        return index, scratch.bases[chunk_index] + row * scratch.row_bytes

    def _add_chunk(self) -> None:
        chunk = torch.empty((CHUNK_ROWS, self.width), dtype=torch.float64, device=self.device)
        self._chunks.append(chunk)
        self._bases.append(chunk.data_ptr())

    def _finish(self) -> None:
        """Have the backend of this step's scratch rows, if any wait, write them (one launch per chunk in use, on the
        current stream)."""
        backend, self._finisher = self._finisher, None
        if backend is None:
            return
        scratch = self._scratch
        for index, count in self._in_use():
            if index < len(scratch.areas):
                backend.finish_rows(
                    self.device, scratch.bases[index], scratch.row_bytes, self._bases[index], self.width, count
                )

    def row(self, index: int) -> torch.Tensor:
        """Row `index` as a float64 view (for callers that need a tensor)."""
        self._finish()
        return self._chunks[index // CHUNK_ROWS][index % CHUNK_ROWS]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The rows at `index` (int64 on the slab's device, each below `used`) as one float64 tensor ``[len(index),
        width]``: a copy, gathered by one op (and a concatenation of the chunks in use when there are several)."""
        self._finish()
        chunks = [self._chunks[i][:count] for i, count in self._in_use()]
        table = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return table.index_select(0, index)

    def _in_use(self):
        """(chunk index, rows in use) of every chunk in use."""
        remaining = self._used
        for index in range(len(self._chunks)):
            if remaining <= 0:
                return
            count = min(remaining, CHUNK_ROWS)
            yield index, count
            remaining -= count

    def start_host_copy(self) -> None:
        """Enqueue the copy of every row handed out this step to pinned host memory on the current stream, without
        waiting (CUDA slabs; a CPU slab is read in place).  Record an event after it and wait on that event before
        `host_rows()`; take no more rows until `reset()`."""
        self._finish()
        if self.device.type != "cuda":
            return
        for index, count in self._in_use():
            if index == len(self._mirrors):
                self._mirrors.append(torch.empty((CHUNK_ROWS, self.width), dtype=torch.float64, pin_memory=True))
            self._mirrors[index][:count].copy_(self._chunks[index][:count], non_blocking=True)
        self._copied = self._used

    def host_tensor(self) -> torch.Tensor:
        """Every row handed out this step as one float64 CPU tensor ``[used, width]``: from the host mirrors after
        `start_host_copy` (whose event the caller waited on), else with one blocking device-to-host copy per chunk
        in use (a CPU slab: its own rows)."""
        self._finish()
        mirrored = self._copied == self._used and self._used > 0
        parts = [
            self._mirrors[index][:count] if mirrored else self._chunks[index][:count].cpu()
            for index, count in self._in_use()
        ]
        if not parts:
            return torch.empty((0, self.width), dtype=torch.float64)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def host_rows(self) -> List[List[float]]:
        """`host_tensor` as Python floats, one list per row."""
        return self.host_tensor().tolist()

    def reset(self) -> None:
        """Make every row available again (call after `host_rows`).  Scratch rows never read are written first: a
        scratch still holding partials would otherwise be written over a later step's row at its index."""
        self._finish()
        self._used = 0
        self._copied = 0
