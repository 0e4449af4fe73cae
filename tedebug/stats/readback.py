"""`RowsInFlight`: one step's fed statistic rows on their way to the host.

`RowsInFlight(fed)` snapshots what the reduction and the emission need from every fed buffer (`FedRow`: key,
columns, emitters, iteration and reduction settings, which the next step may change) and enqueues every
device-to-host copy at once, without waiting: slab rows into the slabs' pinned mirrors (`RowSlab.start_host_copy`),
the buffers' own rows (one concatenation per device) and the quantize kernels' statistics vectors fed as rows (one
stack per device and vector length) with non-blocking copies, then one event per CUDA device.
`host_rows()` waits for those events and returns each buffer's row as Python floats in `columns` order (a row fed as
host values is taken as it is; a buffer
whose row is one slab row, the kernel path's usual case, is cut from one gather per slab and column layout); several
rows of one buffer (microbatches, slab rows next to a tensor row) are merged there with the exact combiners.

`tedebug.stats.engine.StatsEngine` calls both at once (a synchronous read-back), or calls `host_rows()` at the next
step (deferred read-back: the step returns without waiting for the GPU).  The slabs named by the snapshot must not
hand out rows again until `host_rows()` has returned; the engine alternates two sets of slabs for that.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tedebug.sinks.batch import Emitters
from tedebug.stats.buffers import BufferKey, StatBuffer, VectorRow
from tedebug.stats.definitions import Column, combine_rows
from tedebug.stats.slab import RowSlab


class FedRow:
    """What the reduction and the emission read from one fed buffer, fixed when its step ended."""

    __slots__ = (
        "key",
        "columns",
        "emitters",
        "iteration",
        "reduction_group",
        "skip_reduction",
        "row",
        "host_row",
        "slab_rows",
        "vector_rows",
        "positions",
        "nonfinite_positions",
    )

    def __init__(self, buffer: StatBuffer) -> None:
        self.key: BufferKey = buffer.key
        self.columns: Tuple[Column, ...] = buffer.columns
        self.emitters: Emitters = buffer.emitters
        self.iteration: Optional[int] = buffer.iteration
        self.reduction_group: Any = buffer.reduction_group
        self.skip_reduction: bool = buffer.skip_reduction
        if buffer.staged:  # (what reading `buffer.row` does: its staged feeds merged first)
            buffer.host_batch.resolve()
        self.row: Optional[torch.Tensor] = buffer._row
        self.host_row: Optional[List[float]] = buffer._host_row
        self.slab_rows: List[Tuple[RowSlab, int]] = buffer.slab_rows
        self.vector_rows: List[VectorRow] = buffer.vector_rows
        self.positions: Tuple[int, ...] = buffer.row_positions(buffer.slab_keys) if buffer.slab_rows else ()
        self.nonfinite_positions: Optional[Tuple[int, int]] = buffer.nonfinite_positions


class RowsInFlight:
    """The rows of one finished step, copied to the host asynchronously (see the module docstring)."""

    def __init__(self, fed: Sequence[StatBuffer]) -> None:
        self.entries: List[FedRow] = [FedRow(buffer) for buffer in fed]
        by_device: Dict[torch.device, List[FedRow]] = {}
        slabs: Dict[RowSlab, None] = {}
        #: statistics vectors fed as rows, by (device, length)
        vectors: Dict[Tuple[torch.device, int], List[Tuple[FedRow, VectorRow]]] = {}
        for entry in self.entries:  # (one pass; a row fed as host values needs none of it)
            if entry.row is not None:
                by_device.setdefault(entry.row.device, []).append(entry)
            for slab, _ in entry.slab_rows:
                slabs.setdefault(slab, None)
            for vector_row in entry.vector_rows:
                vector = vector_row.vector
                vectors.setdefault((vector.device, vector.numel()), []).append((entry, vector_row))
        self._slabs = list(slabs)
        self._row_groups: List[Tuple[List[FedRow], torch.Tensor]] = []
        cuda_devices = {slab.device for slab in self._slabs if slab.device.type == "cuda"}
        for slab in self._slabs:
            slab.start_host_copy()
        for device, entries in by_device.items():
            flat = torch.cat([e.row for e in entries])  # type: ignore[misc]  # by_device holds entries with a row
            if device.type == "cuda":
                flat = flat.to("cpu", non_blocking=True)  # into pinned memory: returns at once
                cuda_devices.add(device)
            self._row_groups.append((entries, flat))
        # statistics vectors fed as rows: one stack (one launch per batch of inputs) and one copy per device and length
        self._vector_groups: List[Tuple[List[Tuple[FedRow, VectorRow]], torch.Tensor]] = []
        for (device, _), members in vectors.items():
            stacked = torch.stack([vector_row.vector for _, vector_row in members])
            if device.type == "cuda":
                stacked = stacked.to("cpu", non_blocking=True)
                cuda_devices.add(device)
            self._vector_groups.append((members, stacked))
        self._events = []
        for device in cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)

    def host_rows(self) -> Dict[BufferKey, List[float]]:
        """Wait for the copies, then every entry's row as Python floats in `columns` order."""
        for event in self._events:
            event.synchronize()
        slab_tensors = {slab: slab.host_tensor() for slab in self._slabs}
        host: Dict[BufferKey, List[float]] = {}
        for entry in self.entries:
            if entry.host_row is not None:  # read on the host when it was fed: nothing to copy
                host[entry.key] = entry.host_row
        for entries, flat in self._row_groups:
            values = flat.tolist()
            offset = 0
            for entry in entries:
                host[entry.key] = values[offset : offset + len(entry.columns)]
                offset += len(entry.columns)
        vector_parts: Dict[BufferKey, List[List[float]]] = {}
        for members, stacked in self._vector_groups:
            for (entry, vector_row), values in zip(members, stacked.tolist()):
                numel = vector_row.numel
                row = [values[p] if p >= 0 else numel for p in vector_row.positions]
                vector_parts.setdefault(entry.key, []).append(row)
        if not self._slabs and not self._vector_groups:
            return host  # every row was fed as host values or as a tensor row (no slab row, no vector row)
        # An entry whose row is exactly one slab row (one feed through a kernel: the common case) takes its columns
        # from one gather per (slab, column positions), one whose row is exactly one statistics vector is that
        # vector's row; the others are merged below.
        single: Dict[Tuple[RowSlab, Tuple[int, ...]], List[FedRow]] = {}
        merged: List[FedRow] = []
        for entry in self.entries:
            if not entry.slab_rows and not entry.vector_rows:
                continue
            alone = entry.row is None and entry.host_row is None
            if alone and len(entry.slab_rows) == 1 and not entry.vector_rows:
                single.setdefault((entry.slab_rows[0][0], entry.positions), []).append(entry)
            elif alone and not entry.slab_rows and len(entry.vector_rows) == 1:
                host[entry.key] = vector_parts[entry.key][0]
            else:
                merged.append(entry)
        for (slab, positions), entries in single.items():
            rows = torch.tensor([entry.slab_rows[0][1] for entry in entries], dtype=torch.long)
            gathered = slab_tensors[slab].index_select(0, rows)[:, list(positions)].tolist()
            for entry, row in zip(entries, gathered):
                host[entry.key] = row
        slab_lists: Dict[RowSlab, List[List[float]]] = {}
        for entry in merged:
            parts = [host[entry.key]] if entry.row is not None or entry.host_row is not None else []
            for slab, index in entry.slab_rows:
                full = slab_lists.get(slab)
                if full is None:
                    full = slab_lists[slab] = slab_tensors[slab].tolist()
                parts.append([full[index][p] for p in entry.positions])
            parts.extend(vector_parts.get(entry.key, ()))
            if len(parts) == 1:
                host[entry.key] = parts[0]
            else:
                host[entry.key] = combine_rows(entry.columns, torch.tensor(parts, dtype=torch.float64)).tolist()
        return host


# ------------------------------------------------------------------------------------------------ slab steps
class SlabLayout:
    """What the emission of a *slab step* keeps from one step to the next: a step in which every fed buffer's row is
    exactly one row of one `RowSlab` (one kernel launch per tensor, the GPU path's usual step), with the same buffers,
    slab rows, emitters and slab layout as the step the layout was made for.

    Such a step's emission is one gather per column layout and one ``tolist``, and the batch it hands over has this
    layout's key (`ScalarBatch.same_layout` then compares one object), so a step costs a few attribute checks per
    buffer instead of a snapshot object, a classification and a row list each."""

    __slots__ = (
        "buffers",
        "emitters",
        "rows",
        "keys",
        "row_index",
        "columns",
        "groups",
        "parts",
        "key",
        "named",
        "nonfinite",
    )

    def __init__(self, fed: Sequence[StatBuffer]) -> None:
        first = fed[0]
        self.buffers: Tuple[StatBuffer, ...] = tuple(fed)
        self.emitters: Tuple[Emitters, ...] = tuple(b.emitters for b in fed)
        self.rows: Tuple[int, ...] = tuple(b.slab_rows[0][1] for b in fed)
        self.keys: Tuple[str, ...] = first.slab_keys
        #: the slab rows in buffer order (None: they are the slab's rows 0, 1, ... already)
        self.row_index: Optional[torch.Tensor] = (
            None if self.rows == tuple(range(len(fed))) else torch.tensor(self.rows, dtype=torch.long)
        )
        by_positions: Dict[Tuple[int, ...], List[int]] = {}
        for i, b in enumerate(fed):
            by_positions.setdefault(b.row_positions(self.keys), []).append(i)
        #: the columns of every row in the slab row when all buffers have the same (the usual case), else None and
        #: per column layout its columns and the buffers (positions in `buffers`) that have it
        self.columns: Optional[List[int]] = list(next(iter(by_positions))) if len(by_positions) == 1 else None
        self.groups: List[Tuple[List[int], List[int], torch.Tensor]] = [
            (list(positions), members, torch.tensor(members, dtype=torch.long))
            for positions, members in by_positions.items()
        ]
        #: (emitters, layer, tensor) of every row, and the `ScalarBatch` layout key made of them
        self.parts = [(b.emitters, b.key.layer, b.key.tensor) for b in fed]
        self.key: Tuple[Any, ...] = tuple(part for row in self.parts for part in row)
        self.named = any(e.names for e in self.emitters)  # (a batch with no named row has no one iteration)
        #: (position in `buffers`, NaN count column, Inf count column) of the buffers that count non-finite values
        self.nonfinite: List[Tuple[int, int, int]] = [
            (i, *b.nonfinite_positions) for i, b in enumerate(fed) if b.nonfinite_positions is not None
        ]

    def matches(self, fed: Sequence[StatBuffer], slab: RowSlab, iteration: Any) -> bool:
        """True when `fed` is a slab step of this layout, all of it at `iteration`."""
        if len(fed) != len(self.buffers):
            return False
        keys = self.keys
        for b, mine, emitters, row in zip(fed, self.buffers, self.emitters, self.rows):
            if b is not mine or b.emitters is not emitters or b.slab_keys is not keys or b.iteration != iteration:
                return False
            slab_rows = b.slab_rows
            if (
                len(slab_rows) != 1
                or slab_rows[0][0] is not slab
                or slab_rows[0][1] != row
                or b._row is not None
                or b._host_row is not None
                or b.staged
                or b.vector_rows
            ):
                return False
        return True


def is_slab_step(fed: Sequence[StatBuffer]) -> bool:
    """True when every buffer of `fed` (not empty) holds exactly one slab row, all of one slab, one slab layout and
    one iteration, and nothing else (a `SlabLayout` can be made of it)."""
    if not fed or len(fed[0].slab_rows) != 1:
        return False
    slab, keys, iteration = fed[0].slab_rows[0][0], fed[0].slab_keys, fed[0].iteration
    for b in fed:
        slab_rows = b.slab_rows
        if (
            len(slab_rows) != 1
            or slab_rows[0][0] is not slab
            or b.slab_keys is not keys
            or b.iteration != iteration
            or b._row is not None
            or b._host_row is not None
            or b.staged
            or b.vector_rows
        ):
            return False
    return True


class SlabStepInFlight:
    """The rows of one finished slab step (`SlabLayout`) on their way to the host: the slab's transfer enqueued
    and an event recorded at construction, without waiting; `values()` waits for it and returns every buffer's row
    as Python floats in its `columns` order, in the layout's buffer order."""

    __slots__ = ("layout", "slab", "iteration", "_event")

    def __init__(self, layout: SlabLayout, slab: RowSlab, iteration: Any) -> None:
        self.layout = layout
        self.slab = slab
        self.iteration = iteration
        slab.start_host_copy()
        self._event = None
        if slab.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(slab.device))

    def values(self) -> List[List[float]]:
        if self._event is not None:
            self._event.synchronize()
        layout = self.layout
        host = self.slab.host_tensor()
        if layout.row_index is not None:
            host = host.index_select(0, layout.row_index)
        if layout.columns is not None:
            return host[:, layout.columns].tolist()
        values: List[Any] = [None] * len(layout.buffers)
        for columns, members, index in layout.groups:
            for i, row in zip(members, host.index_select(0, index)[:, columns].tolist()):
                values[i] = row
        return values
