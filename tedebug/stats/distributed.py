"""Reduction of one step's statistic rows across ranks without waiting for the device (deferred read-back).

With several ranks, `tedebug.stats.engine.StatsEngine` in deferred mode hands every fed buffer of iteration N to a
`DeferredReduction`: per reduction group, ONE asynchronous ``all_gather_single`` (``all_gather_into_tensor`` before
torch 2.13) of a float64 vector built on the device of the group's collectives (NCCL: the current CUDA device; gloo:
the CPU, which costs a blocking copy for CUDA rows), then (CUDA) a non-blocking copy of the gathered matrix into
pinned host memory and an event. Nothing waits in that step; `finish()`, at the end of iteration N+1, waits for the
event (long done) and merges the rows on the host.

Every rank of a group must send a vector of the same length, so the vector follows a `GroupLayout` that all ranks of
the group agreed on: ``[pending, (fed, replica, row...) per slot]``. A buffer that is not in the layout yet (a new
buffer: the first enabled iteration, or a layer that runs on some ranks only) travels the synchronous way instead:
its host row is read back with the step's other host rows, the ``pending`` flag says so, and when any rank of the
group raised it, `finish()` runs one ``all_gather_object`` over the group with every rank's pending rows and layout
keys; all ranks merge those rows and extend their layout with the same union of keys, in the same order. This
happens in the first enabled step(s) only (on NCCL, ``all_gather_object`` waits for the device once there);
afterwards each step costs one collective per group. As in the synchronous reduction, every rank of a group must
join the group's collectives at the same steps (the engine's participation rule), so every rank must know the group:
each layer runs on every rank at its first enabled iteration.

Replicas: a tensor that every rank of a tensor-parallel group holds whole (the input of a column-parallel GEMM,
the output gradient of a row-parallel one) is counted once: each row carries the lowest global rank of its TP group
(``replica``, -1 for none) and the merge keeps the first row of each replica.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from tedebug.stats.copy_events import wait_for_copies
from tedebug.stats.definitions import Column, combine_row_batches, combine_rows
from tedebug.stats.reduce import keep_first_replicas, merge_host_rows

NO_REPLICA = -1.0
#: slot header: fed flag, replica id
_SLOT_HEADER = 2


def replica_id(group: Any) -> float:
    """The lowest global rank of `group` (identifies a TP group: the ranks holding the same replica)."""
    return float(min(dist.get_process_group_ranks(group)))


def collective_device(group: Any) -> torch.device:
    """The device the collectives of `group` take tensors on: CUDA when the group has NCCL (also a combined
    ``"cpu:gloo,cuda:nccl"`` group), else the CPU."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupLayout:
    """The slots (buffer key, columns) every rank of one reduction group sends, in an agreed order."""

    def __init__(self) -> None:
        self.slots: List[Tuple[Hashable, Tuple[Column, ...]]] = []
        self.offsets: Dict[Hashable, int] = {}  # key -> position of its slot header in the vector
        self.columns: Dict[Hashable, Tuple[Column, ...]] = {}  # key -> its columns
        self.length = 1  # the pending flag

    def __contains__(self, key: Hashable) -> bool:
        return key in self.offsets

    def fits(self, key: Hashable, columns: Tuple[Column, ...]) -> bool:
        """True when `key` has a slot with exactly these columns (a buffer whose requests changed does not fit:
        it keeps travelling as a host row)."""
        at = self.offsets.get(key)
        return at is not None and self.columns[key] == columns

    def extend(self, entries: Dict[Hashable, Tuple[Column, ...]]) -> None:
        """Append the entries not in the layout yet, sorted by ``repr(key)`` (the same order on every rank)."""
        for key in sorted((k for k in entries if k not in self.offsets), key=repr):
            columns = tuple(entries[key])
            self.offsets[key] = self.length
            self.columns[key] = columns
            self.slots.append((key, columns))
            self.length += _SLOT_HEADER + len(columns)


class _Exchange:
    """The asynchronous all-gather of one group for one step."""

    def __init__(self, group: Any, layout: GroupLayout, vector: torch.Tensor) -> None:
        self.group = group
        self.layout = layout
        world = dist.get_world_size(group)
        self._gathered = torch.empty(world * vector.numel(), dtype=torch.float64, device=vector.device)
        self._vector = vector  # kept alive until the collective has read it
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # name before torch 2.13
        self._work = gather(self._gathered, vector, group=group, async_op=True)
        self._event = None
        self._host: Optional[torch.Tensor] = None
        if vector.device.type == "cuda":
            self._work.wait()  # NCCL: the current stream waits for the collective; the host does not
            self._work = None
            self._host = torch.empty(self._gathered.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(self._gathered, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(vector.device))

    def matrix(self) -> torch.Tensor:
        """The gathered vectors, float64 ``[ranks of the group, layout length]`` on the host (waits for the
        collective / the copy)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            wait_for_copies((self._event,))
        host = self._gathered if self._host is None else self._host  # pinned copy: set together with the event
        return host.reshape(dist.get_world_size(self.group), -1)


class DeferredReduction:
    """One step's group reductions in flight (see the module docstring).  Built by `GroupReducer.start`."""

    def __init__(self) -> None:
        #: per group: (exchange, {key: replica}) of this rank's fed buffers in the layout
        self.exchanges: List[Tuple[_Exchange, Dict[Hashable, float]]] = []
        #: per group: (group, layout, {key: (columns, replica)} of this rank's pending fed buffers)
        self.pending: List[Tuple[Any, GroupLayout, Dict[Hashable, Tuple[Tuple[Column, ...], float]]]] = []

    def finish(self, host: Dict[Hashable, List[float]]) -> Dict[Hashable, List[float]]:
        """Merged rows of every reduced buffer this rank fed, in its `columns` order; `host` holds the host rows
        of the pending buffers."""
        merged: Dict[Hashable, List[float]] = {}
        for (exchange, mine), (group, layout, pending) in zip(self.exchanges, self.pending):
            matrix = exchange.matrix()
            if mine:
                merged.update(_merge_slots(layout, list(mine), matrix))
            if not bool((matrix[:, 0] != 0.0).any()):
                continue
            # some rank has buffers outside the layout: one synchronous exchange of those rows and the layouts
            local = {key: (columns, host[key], replica) for key, (columns, replica) in pending.items()}
            gathered: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (local, dict(layout.slots)), group=group)
            for key, (columns, _, _) in local.items():
                rows = [(g[0][key][:2], g[0][key][2]) for g in gathered if key in g[0]]
                values = merge_host_rows(key, keep_first_replicas(rows))
                merged[key] = [values[c] for c in columns]
            union: Dict[Hashable, Tuple[Column, ...]] = {}
            for rank_pending, rank_layout in gathered:
                union.update(rank_layout)
                union.update({key: entry[0] for key, entry in rank_pending.items()})
            layout.extend(union)
        return merged


def _merge_slots(layout: GroupLayout, keys: List[Hashable], matrix: torch.Tensor) -> Dict[Hashable, List[float]]:
    """The merged rows of the slots of `keys` from the gathered `matrix` (``[ranks, layout length]``): of each slot
    the rows of the ranks that fed it, less the later rows of a replica already kept (`keep_first_replicas`' rule),
    combined by `combine_rows`' rules.  Slots of the same columns whose ranks kept are the same are merged together
    (`combine_row_batches`, the same bits), so a step costs a few tensor ops per kind of slot, not per buffer."""
    by_columns: Dict[Tuple[Column, ...], List[Hashable]] = {}
    for key in keys:
        by_columns.setdefault(layout.columns[key], []).append(key)
    merged: Dict[Hashable, List[float]] = {}
    for columns, same in by_columns.items():
        at = torch.tensor([layout.offsets[key] for key in same])
        fed = (matrix[:, at] != 0.0).numpy()  # [ranks, slots]
        replica = matrix[:, at + 1].numpy()
        values = matrix[:, (at + _SLOT_HEADER)[:, None] + torch.arange(len(columns))]  # [ranks, slots, columns]
        kept = _first_replicas(fed, replica)
        by_ranks: Dict[Tuple[bool, ...], List[int]] = {}
        for slot, ranks in enumerate(map(tuple, kept.T.tolist())):
            by_ranks.setdefault(ranks, []).append(slot)
        for ranks, slots in by_ranks.items():
            rows = values[[r for r, on in enumerate(ranks) if on]][:, slots].transpose(0, 1)  # [slots, kept, columns]
            if rows.shape[1] == 1:
                out = rows[:, 0]
            else:
                out = combine_row_batches(columns, rows.contiguous())
            for slot, row in zip(slots, out.tolist()):
                merged[same[slot]] = row
    return merged


def _first_replicas(fed: np.ndarray, replica: np.ndarray) -> np.ndarray:
    """Which rows to keep (bool ``[ranks, slots]``): those fed, less each row whose replica id (>= 0) an earlier
    rank's row of the same slot has (ids < 0 are no replica)."""
    kept = fed.copy()
    ranks, slots = np.nonzero(fed & (replica >= 0))  # in rank order
    if ranks.size:
        _, first = np.unique(np.stack([slots, replica[ranks, slots]], axis=1), axis=0, return_index=True)
        later = np.ones(ranks.size, dtype=bool)
        later[first] = False
        kept[ranks[later], slots[later]] = False
    return kept


class GroupReducer:
    """The agreed layouts of every reduction group of a session, and `start` of one step's reductions."""

    def __init__(self) -> None:
        self._layouts: Dict[Hashable, GroupLayout] = {}
        self._index_cache: Dict[Tuple[Tuple[int, ...], torch.device], torch.Tensor] = {}

    def reset(self) -> None:
        self._layouts.clear()
        self._index_cache.clear()

    def start(
        self,
        groups: Sequence[Any],
        group_key,
        fed_by_group: Dict[Hashable, List[Any]],
        replicas: Dict[Tuple[str, str], float],
    ) -> DeferredReduction:
        """Launch one all-gather per group of `groups` (in that order, the same on every rank).  `fed_by_group`:
        group key -> this rank's fed buffers (`StatBuffer`s) reduced over it; `replicas`: (layer, tensor) -> the
        replica id of tensors held whole by a TP group."""
        step = DeferredReduction()
        for group in groups:
            gkey = group_key(group)
            layout = self._layouts.setdefault(gkey, GroupLayout())
            device = collective_device(group)
            fed = fed_by_group.get(gkey, [])
            in_layout = [b for b in fed if layout.fits(b.key, b.columns)]
            pending = {
                b.key: (b.columns, replicas.get((b.key.layer, b.key.tensor), NO_REPLICA))
                for b in fed
                if not layout.fits(b.key, b.columns)
            }
            vector, mine = self._vector(layout, in_layout, bool(pending), replicas, device)
            step.exchanges.append((_Exchange(group, layout, vector), mine))
            step.pending.append((group, layout, pending))
        return step

    def _vector(
        self,
        layout: GroupLayout,
        buffers: List[Any],
        pending: bool,
        replicas: Dict[Tuple[str, str], float],
        device: torch.device,
    ):
        """This rank's vector for `layout` on `device`, built without a host synchronisation: the slot headers
        (with the rows read on the host, and zeros for the others) copied from the host, then the device rows
        written in.  The usual buffers - one slab row, or one quantize kernel's statistics vector holding every
        column - are written a batch at a time (one gather and one indexed copy per slab and column layout, or per
        vector layout); any other buffer its own row."""
        header = [0.0] * layout.length
        header[0] = 1.0 if pending else 0.0
        mine: Dict[Hashable, float] = {}
        #: (slab, column positions) -> (slab row indices, slot row starts); (vector length, positions) -> (vectors,
        #: slot row starts), every vector on `device`; others: (slot row start, row)
        from_slabs: Dict[Tuple[Any, Tuple[int, ...]], Tuple[List[int], List[int]]] = {}
        from_vectors: Dict[Tuple[int, Tuple[int, ...]], Tuple[List[torch.Tensor], List[int]]] = {}
        others: List[Tuple[int, torch.Tensor]] = []
        for buffer in buffers:
            at = layout.offsets[buffer.key]
            replica = replicas.get((buffer.key.layer, buffer.key.tensor), NO_REPLICA)
            header[at], header[at + 1] = 1.0, replica
            mine[buffer.key] = replica
            start = at + _SLOT_HEADER
            row, host_row = buffer.row, buffer.host_row
            if row is None and host_row is not None and not buffer.slab_rows and not buffer.vector_rows:
                header[start : start + len(host_row)] = host_row  # values read on the host: they travel as the header
                continue
            alone = row is None and host_row is None
            if alone and len(buffer.slab_rows) == 1 and not buffer.vector_rows:
                slab, index = buffer.slab_rows[0]
                if slab.device == device:
                    batch = from_slabs.setdefault((slab, buffer.row_positions(buffer.slab_keys)), ([], []))
                    batch[0].append(index)
                    batch[1].append(start)
                    continue
            elif alone and len(buffer.vector_rows) == 1 and not buffer.slab_rows:
                vector, positions = buffer.vector_rows[0].vector, buffer.vector_rows[0].positions
                if vector.device == device and -1 not in positions:
                    stack = from_vectors.setdefault((vector.numel(), positions), ([], []))
                    stack[0].append(vector)
                    stack[1].append(start)
                    continue
            others.append((start, self._device_row(buffer, device)))
        vector = _on(torch.tensor(header, dtype=torch.float64), device)
        for (slab, positions), (indices, starts) in from_slabs.items():
            rows = slab.rows(_on(torch.tensor(indices), device)).index_select(1, self._index(positions, device))
            vector.index_copy_(0, self._destination(starts, len(positions), device), rows.reshape(-1))
        for (_, positions), (vectors, starts) in from_vectors.items():
            rows = torch.stack(vectors).index_select(1, self._index(positions, device)).to(torch.float64)
            vector.index_copy_(0, self._destination(starts, len(positions), device), rows.reshape(-1))
        for start, row in others:
            vector[start : start + row.numel()] = row
        return vector, mine

    @staticmethod
    def _destination(starts: List[int], width: int, device: torch.device) -> torch.Tensor:
        """The vector positions of rows of `width` written at `starts`, flattened in row order, on `device`."""
        return _on((torch.tensor(starts)[:, None] + torch.arange(width)).reshape(-1), device)

    def _device_row(self, buffer: Any, device: torch.device) -> torch.Tensor:
        """The buffer's merged row for this step in `columns` order, on `device` (torch ops only)."""
        parts: List[torch.Tensor] = []
        if buffer.row is not None:
            parts.append(buffer.row)
        if buffer.host_row is not None:
            parts.append(torch.tensor(buffer.host_row, dtype=torch.float64))
        if buffer.slab_rows:
            positions = buffer.row_positions(buffer.slab_keys)
            for slab, index in buffer.slab_rows:
                parts.append(slab.row(index).index_select(0, self._index(positions, slab.device)))
        for vector_row in buffer.vector_rows:  # a quantize kernel's statistics vector (numel at -1 when not in it)
            vector, positions = vector_row.vector, vector_row.positions
            if -1 in positions:
                vector = torch.cat((vector.new_full((1,), vector_row.numel), vector))
                positions = tuple(p + 1 for p in positions)
            parts.append(vector.index_select(0, self._index(positions, vector.device)))
        # rows on another device than the group's collectives (gloo with CUDA tensors): a blocking copy
        parts = [p if p.device == device else p.to(device) for p in parts]
        if len(parts) == 1:
            return parts[0].to(torch.float64)
        return combine_rows(buffer.columns, torch.stack(parts).to(torch.float64))

    def _index(self, positions: Tuple[int, ...], device: torch.device) -> torch.Tensor:
        index = self._index_cache.get((positions, device))
        if index is None:
            index = self._index_cache[(positions, device)] = torch.tensor(positions, dtype=torch.long, device=device)
        return index


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a new CPU tensor) on `device` without waiting: a CUDA device gets a non-blocking copy from pinned
    memory."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["GroupReducer", "GroupLayout", "DeferredReduction", "replica_id", "collective_device", "NO_REPLICA"]
