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
step (deferred read-back: the step returns without waiting for the GPU).

The usual step takes a shorter way: when every fed buffer holds exactly one row (a slab row, a quantize kernel's
statistics vector or a CPU tensor's host row), `StepLayout` keeps what the read-back and the emission derive from
the buffers (row kinds, slab gather, vector groups, the batch's layout key) from one such step to the next, and
`OneRowStepInFlight` reads the step back with it, without a `FedRow` per buffer (docs/internals.md, "A step read
back through the layout of the last one").  The slabs named by the snapshot must not
hand out rows again until `host_rows()` has returned; the engine alternates two sets of slabs for that.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from tedebug.sinks.batch import Emitters
from tedebug.stats.buffers import BufferKey, StatBuffer, VectorRow
from tedebug.stats.copy_events import wait_for_copies
from tedebug.stats.definitions import Column, combine_row_batches
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
        wait_for_copies(self._events)
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
        #: (columns, rows to merge) -> (entries, their rows): merged together (microbatches: many buffers of k rows)
        batches: Dict[Tuple[Tuple[Column, ...], int], Tuple[List[FedRow], List[List[List[float]]]]] = {}
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
                batch = batches.setdefault((entry.columns, len(parts)), ([], []))
                batch[0].append(entry)
                batch[1].append(parts)
        for (columns, _), (entries, parts_of) in batches.items():
            # combine_rows' bits for each entry (definitions.combine_row_batches), a few ops for all of them
            values = combine_row_batches(columns, torch.tensor(parts_of, dtype=torch.float64)).tolist()
            for entry, row in zip(entries, values):
                host[entry.key] = row
        return host


# ------------------------------------------------------------------------------------------------ one-row steps
#: what a buffer's one row is in a one-row step (`StepLayout.slab_at` holds the slab row of a slab row, and these
#: negative codes for the others)
_HOST_ROW = -1  # Python floats read at the feed (`StatBuffer.host_row`: a CPU tensor's statistics)
_VECTOR_ROW = -2  # a quantize kernel's statistics vector (`StatBuffer.vector_rows`)


def _row_kind(b: StatBuffer) -> Optional[int]:
    """The slab row of `b`, `_HOST_ROW` or `_VECTOR_ROW` when it holds exactly one row of that kind and nothing
    else; None otherwise."""
    if b._row is not None or b.staged:
        return None
    slab_rows, vector_rows, host_row = b.slab_rows, b.vector_rows, b._host_row
    if slab_rows:
        return slab_rows[0][1] if len(slab_rows) == 1 and not vector_rows and host_row is None else None
    if vector_rows:
        return _VECTOR_ROW if len(vector_rows) == 1 and host_row is None else None
    return _HOST_ROW if host_row is not None else None


class StepLayout:
    """What the emission of a *one-row step* keeps from one step to the next.  In a one-row step every fed buffer
    holds exactly one row and nothing else: a row of the step's slab (one kernel launch per tensor, the GPU path's
    usual step with LogTensorStats), one statistics vector a quantize kernel wrote (LogFp8TensorStats, and
    LogTensorStats on quantized tensors) or the Python floats of a CPU tensor's statistics.  The layout holds for a
    later step with the same buffers, with rows of the same kinds, in the same slab rows, of the same vector lengths
    and column layouts, with the same emitters.

    Such a step is read back with one transfer for the slab and one stack and transfer per vector length, emitted
    with one gather per column layout and one ``tolist`` (none when every buffer is a slab row with the same columns,
    or a statistics vector of one length with the same positions: the gathered float64 array is the batch's,
    `OneRowStepInFlight.values`), and the batch it hands over has this
    layout's key (`ScalarBatch.same_layout` then compares one object): a few attribute checks per buffer instead of
    a `FedRow` snapshot, a classification and a row dict each."""

    __slots__ = (
        "buffers",
        "emitters",
        "slab_at",
        "first_slab",
        "hosts",
        "keys",
        "row_index",
        "column_index",
        "vector_gather",
        "groups",
        "vectors",
        "parts",
        "key",
        "named",
        "nonfinite",
        "nonfinite_index",
    )

    def __init__(self, fed: Sequence[StatBuffer]) -> None:
        self.buffers: Tuple[StatBuffer, ...] = tuple(fed)
        self.emitters: Tuple[Emitters, ...] = tuple(b.emitters for b in fed)
        #: per buffer, its slab row, `_HOST_ROW` or `_VECTOR_ROW` (the caller checked that every buffer has one)
        self.slab_at: Tuple[int, ...] = tuple(_row_kind(b) for b in fed)  # type: ignore[misc]
        slabbed = [i for i, at in enumerate(self.slab_at) if at >= 0]
        self.first_slab = slabbed[0] if slabbed else -1  # (where a step's slab is found)
        self.hosts: List[int] = [i for i, at in enumerate(self.slab_at) if at == _HOST_ROW]
        #: per vector length and device: (length, device index, members: (buffer position, the row's positions))
        vectors: Dict[Tuple[int, int], List[Tuple[int, Tuple[int, ...]]]] = {}
        for i, at in enumerate(self.slab_at):
            if at == _VECTOR_ROW:
                vector_row = fed[i].vector_rows[0]
                group = (vector_row.vector.numel(), vector_row.vector.get_device())
                vectors.setdefault(group, []).append((i, vector_row.positions))
        self.vectors: List[Tuple[int, int, List[Tuple[int, Tuple[int, ...]]]]] = [
            (length, device, members) for (length, device), members in vectors.items()
        ]
        self.keys: Tuple[str, ...] = fed[slabbed[0]].slab_keys if slabbed else ()
        rows = [self.slab_at[i] for i in slabbed]
        #: the slab rows of the slabbed buffers in their order (None: the slab's rows 0, 1, ... already)
        self.row_index: Optional[torch.Tensor] = (
            None if rows == list(range(len(rows))) else torch.tensor(rows, dtype=torch.long)
        )
        by_positions: Dict[Tuple[int, ...], List[int]] = {}
        for i in slabbed:
            by_positions.setdefault(fed[i].row_positions(self.keys), []).append(i)
        #: the slab columns of every buffer (for numpy's gather) when all are slab rows with the same columns (the
        #: usual LogTensorStats step on the GPU), else None; and per column layout: its slab columns, the buffers
        #: (positions in `buffers`) that have it and their places among the slabbed rows
        self.column_index: Optional[np.ndarray] = (
            np.array(next(iter(by_positions)), dtype=np.intp)
            if len(by_positions) == 1 and len(slabbed) == len(fed)
            else None
        )
        #: when every buffer is a vector row of one length and device with the same positions (the usual
        #: LogFp8TensorStats step): (the vector indices of the columns, 0 where a column is the numel, the numel
        #: columns), else None
        self.vector_gather: Optional[Tuple[np.ndarray, List[int]]] = None
        if len(self.vectors) == 1 and len(self.vectors[0][2]) == len(fed):
            positions = {members_positions for _, members_positions in self.vectors[0][2]}
            if len(positions) == 1:
                (common,) = positions
                self.vector_gather = (
                    np.array([p if p >= 0 else 0 for p in common], dtype=np.intp),
                    [c for c, p in enumerate(common) if p < 0],
                )
        place = {i: k for k, i in enumerate(slabbed)}
        self.groups: List[Tuple[List[int], List[int], torch.Tensor]] = [
            (list(positions), members, torch.tensor([place[i] for i in members], dtype=torch.long))
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
        #: `nonfinite` as three index arrays (rows, NaN count columns, Inf count columns), for a packed step's check
        self.nonfinite_index = tuple(np.array(column, dtype=np.intp) for column in zip(*self.nonfinite))

    def matches(self, fed: Sequence[StatBuffer], slab: Optional[RowSlab], iteration: Any) -> bool:
        """True when `fed` is a one-row step of this layout, its slab rows in `slab`, all of it at `iteration`."""
        if len(fed) != len(self.buffers):
            return False
        keys = self.keys
        for b, mine, emitters, at in zip(fed, self.buffers, self.emitters, self.slab_at):
            if b is not mine or b.emitters is not emitters or b.iteration != iteration or _row_kind(b) != at:
                return False
            if at >= 0 and (b.slab_rows[0][0] is not slab or b.slab_keys is not keys):
                return False
        for length, device, members in self.vectors:
            for i, positions in members:
                vector_row = fed[i].vector_rows[0]
                vector = vector_row.vector
                if vector_row.positions is not positions or vector.numel() != length or vector.get_device() != device:
                    return False
        return True


def one_row_step(fed: Sequence[StatBuffer]) -> Optional[Tuple[Optional[RowSlab], Any]]:
    """(the slab or None, the iteration) when `fed` (not empty) is a one-row step (`StepLayout`): every buffer
    holds exactly one row, its slab rows all of one slab and one slab layout, all at one iteration; else None."""
    slab, keys, iteration = None, None, fed[0].iteration
    for b in fed:
        at = _row_kind(b)
        if at is None or b.iteration != iteration:
            return None
        if at >= 0:
            if slab is None:
                slab, keys = b.slab_rows[0][0], b.slab_keys
            elif b.slab_rows[0][0] is not slab or b.slab_keys is not keys:
                return None
    return slab, iteration


class OneRowStepInFlight:
    """The rows of one finished one-row step (`StepLayout`) on their way to the host: the slab's transfer and the
    vectors' stacks and transfers enqueued and an event recorded at construction, without waiting (host rows are
    taken as they are); `values()` waits for them and returns every buffer's row in its `columns` order, in the
    layout's buffer order."""

    __slots__ = ("layout", "slab", "iteration", "_hosts", "_stacks", "_numels", "_events")

    def __init__(self, layout: StepLayout, fed: Sequence[StatBuffer], slab: Optional[RowSlab], iteration: Any) -> None:
        self.layout = layout
        self.slab = slab
        self.iteration = iteration
        self._hosts = [fed[i]._host_row for i in layout.hosts]  # (lists never modified once set: kept as they are)
        devices = set()
        if slab is not None:
            slab.start_host_copy()
            if slab.device.type == "cuda":
                devices.add(slab.device)
        #: per vector length: the stacked vectors (a host copy in flight), and each member's numel column
        self._stacks: List[torch.Tensor] = []
        self._numels: List[List[float]] = []
        for _, _, members in layout.vectors:
            vector_rows = [fed[i].vector_rows[0] for i, _ in members]
            stacked = torch.stack([v.vector for v in vector_rows])
            if stacked.is_cuda:
                devices.add(stacked.device)
                stacked = stacked.to("cpu", non_blocking=True)
            self._stacks.append(stacked)
            self._numels.append([v.numel for v in vector_rows])
        self._events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)

    def values(self) -> Union[np.ndarray, List[List[float]]]:
        """Every buffer's row in its `columns` order, in the layout's buffer order: one float64 array ``[buffers,
        columns]`` that nothing else holds when every buffer is a slab row with the same columns (the usual GPU
        step with LogTensorStats: a gather of the slab's host copy) or a statistics vector of one length with the
        same positions (the usual LogFp8TensorStats step: a gather of the stacked vectors, the numel columns
        filled in), so that no Python float is made (`ScalarBatch.from_packed`); else lists of Python floats."""
        wait_for_copies(self._events)
        layout = self.layout
        if layout.column_index is not None:  # every buffer a slab row with the same columns: the usual GPU step
            return self._slab_rows().numpy()[:, layout.column_index]
        if layout.vector_gather is not None:  # every buffer a vector row with the same positions
            indices, numel_columns = layout.vector_gather
            rows = self._stacks[0].numpy()[:, indices].astype(np.float64, copy=False)  # (float64 already: the kernels')
            if numel_columns:
                rows[:, numel_columns] = np.array(self._numels[0])[:, None]
            return rows
        values: List[Any] = [None] * len(layout.buffers)
        for i, row in zip(layout.hosts, self._hosts):
            values[i] = row
        if layout.groups:
            host = self._slab_rows()
            for columns, members, places in layout.groups:
                for i, row in zip(members, host.index_select(0, places)[:, columns].tolist()):
                    values[i] = row
        for (_, _, vector_members), stacked, numels in zip(layout.vectors, self._stacks, self._numels):
            for (i, positions), vector, numel in zip(vector_members, stacked.tolist(), numels):
                values[i] = [vector[p] if p >= 0 else numel for p in positions]
        return values

    def _slab_rows(self) -> torch.Tensor:
        """The step's slab rows on the host, in the order of the layout's slabbed buffers."""
        host = self.slab.host_tensor()  # type: ignore[union-attr]  # (a layout with slab rows has its slab)
        index = self.layout.row_index
        return host if index is None else host.index_select(0, index)
