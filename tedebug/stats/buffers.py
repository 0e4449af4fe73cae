"""Statistic buffers: one merged partial row per (layer, tensor, options) and step.

A buffer key is ``BufferKey(layer, tensor, options)`` where `options` is the caller's hashable tuple (the feature's
schedule plus its marker such as ``"fp8"`` / ``"nvfp4"``, so that two features never share a buffer).  Within one
step a non-weight buffer merges every feed (all microbatches, forward and backward) with the exact combiners of
`tedebug.stats.definitions`; a weight buffer keeps the first feed of the step only.  The row stays on the device
of the fed tensor until `StatsEngine.step` reads every row back at once; a kernel backend writes its rows into a
`RowSlab` instead (`slab_rows`), merged on the host at the step; a feed whose every partial is in the statistics
vector a quantize kernel already wrote for that very tensor keeps a reference to the vector (`vector_rows`: no work
at the feed, the vectors of a step are gathered together at its end); a CPU feed whose values were read on the host
keeps them as a list of Python floats (`host_row`: nothing to copy back, no tensor to build); a CPU feed staged in a
`tedebug.stats.host_batch.HostBatch` counts in `staged` until the batch resolves it into `host_row` / `row` (reading
either resolves it first).  Buffers persist
across steps (their reduction groups decide which collectives a rank joins); only the row is cleared at each step.

Everything a feed or an emission derives from the requests alone (the columns, the partial families to compute and
where each partial goes in the row, the emitted names) is derived once per buffer, when its requests are set.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any, Callable, Dict, Hashable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from tedebug.sinks.batch import Emitters
from tedebug.stats.definitions import (
    NONFINITE_COLUMNS,
    NUMEL,
    Column,
    StatRequest,
    columns_for,
    combine_rows,
    family_of,
    row_evaluator,
)
from tedebug.stats.slab import RowSlab

#: the partial families of quantization statistics (they read a quantized direction)
QUANTIZED_FAMILIES = frozenset(("underflow", "mse", "overflow", "scale_inv"))
#: one partial family to compute for a row: (family, qualifier, ((partial name, column index), ...))
FamilySlots = Tuple[str, Tuple[Any, ...], Tuple[Tuple[str, int], ...]]


class VectorRow(NamedTuple):
    """A feed's row kept as the float64 statistics vector a quantize kernel wrote (`StatBuffer.add_vector_row`)."""

    vector: torch.Tensor  # float64 [n], never written again after its quantization
    positions: Tuple[int, ...]  # per column (`columns` order): the vector index holding it, -1 for numel
    numel: float  # the numel column's value when the vector has no "numel" entry


class SlabRoute(NamedTuple):
    """How a feed launched a buffer's row into the step's slab: what `StatsEngine.slab_feeder` needs to do it again
    without `StatsEngine.feed`'s general path.  The launches are the backend's as that feed looked them up (a feed
    of the general path that finds other ones makes a new route)."""

    backend: Any  # the statistics backend `backend_for` chose for the tensor
    into: Callable[..., None]  # the backend's lone launch (``basic_stats_into``)
    group_into: Optional[Callable[..., None]]  # its group launch (``basic_stats_group_into``), None without one
    keys: Tuple[str, ...]  # the row's partial names, in order (``BASIC_ROW_KEYS``)
    host_values: bool  # the backend gives CPU tensors host values instead (``basic_partial_values``)
    #: the backend when its launches leave partials in a row scratch (``basic_stats_scratch_into``: the row is
    #: written at the step's end, `RowSlab.take_scratch`), else None
    scratch: Any = None


class BufferKey(NamedTuple):
    layer: str
    tensor: str
    options: Tuple[Hashable, ...]


class StatBuffer:
    """The requests and the merged partial row of one buffer key."""

    def __init__(self, key: BufferKey, requests: Tuple[StatRequest, ...], *, is_weight: bool) -> None:
        self.key = key
        self._set_requests(requests)
        self.is_weight = is_weight
        self.reduction_group: Any = None
        self.skip_reduction = False
        self.iteration: Optional[int] = None
        self._row: Optional[torch.Tensor] = None  # float64 [len(columns)] on the feed's device
        #: the step's row as Python floats in `columns` order, when its only feed gave host values (`accumulate_host`)
        self._host_row: Optional[List[float]] = None
        #: feeds of this step waiting in a `tedebug.stats.host_batch.HostBatch` (`host_batch`), merged into the row
        #: when the batch resolves: at the step, or as soon as `row` or `host_row` is read
        self.staged = 0
        self.host_batch: Any = None
        #: rows of this step written by a kernel into a `RowSlab` (full backend layout), read back at the step
        self.slab_rows: List[Tuple[RowSlab, int]] = []
        self.slab_keys: Tuple[str, ...] = ()  # the partial names of a slab row, in order
        #: how the last feed that went to the slab launched its row (`SlabRoute`), for `StatsEngine.slab_feeder`;
        #: None until a feed takes that path (and again once the store is reset)
        self.slab_route: Optional[SlabRoute] = None
        #: rows of this step that are quantize kernels' statistics vectors, gathered at the step
        self.vector_rows: List[VectorRow] = []
        #: the immutable ``stats`` object `requests` were last parsed from (`StatsEngine.feed`'s fast path)
        self.stats_source: Any = None
        #: its place in the `BufferStore`'s creation order (the order of the emitted rows)
        self.order = 0

    def _set_requests(self, requests: Tuple[StatRequest, ...]) -> None:
        self.requests = requests
        self.columns: Tuple[Column, ...] = columns_for(requests)
        self.families: Tuple[FamilySlots, ...] = family_slots(self.columns)
        self.numel_index = self.columns.index(NUMEL)
        #: positions of the NaN and Inf count columns in `columns` (None unless both are there)
        self.nonfinite_positions: Optional[Tuple[int, int]] = (
            (self.columns.index(NONFINITE_COLUMNS[0]), self.columns.index(NONFINITE_COLUMNS[1]))
            if all(column in self.columns for column in NONFINITE_COLUMNS)
            else None
        )
        self.stat_names: Tuple[str, ...] = tuple(f"{self.key.layer}_{self.key.tensor}_{r.name}" for r in requests)
        #: True when the basic family produces every column but numel (`StatsEngine`'s one-vector feed path)
        self.basic_only = len(self.families) == 1 and self.families[0][0] == "basic"
        #: (recipe, columnwise) when every partial family is a quantization statistic of that one quantized
        #: direction (underflows, mse, overflows, scale_inv): the row may then be one gather of a quantize kernel's
        #: statistics vector (`StatsEngine`'s fused path); None otherwise
        qualifiers = {qualifier for family, qualifier, _ in self.families}
        self.quantized_source: Optional[Tuple[Any, ...]] = (
            next(iter(qualifiers))
            if len(qualifiers) == 1 and all(family in QUANTIZED_FAMILIES for family, _, _ in self.families)
            else None
        )
        #: `host_gather` of the CPU basic layout (`torch_ref.BASIC_ROW_KEYS`), kept by its first user (the staged
        #: feeds' replay, `tedebug.stats.host_batch`): no look-up per feed
        self.basic_host_gather: Optional[Callable[[Sequence[float]], List[float]]] = None
        self._covered: Dict[Tuple[str, ...], bool] = {}
        self._gathers: Dict[tuple, Any] = {}  # index tensors per device, numpy index arrays
        self._positions: Dict[Tuple[str, ...], Tuple[int, ...]] = {}
        self._vector_positions: Dict[Tuple[str, ...], Tuple[int, ...]] = {}
        #: (emitted name, request name) per request, and the final values of them all from a merged row in
        #: `columns` order (one generated function: `row_evaluator`)
        self.emitters = Emitters(
            tuple((name, r.name) for name, r in zip(self.stat_names, requests)), row_evaluator(requests, self.columns)
        )

    def covered_by(self, keys: Tuple[str, ...]) -> bool:
        """True when every column but numel is a partial named in `keys` (remembered per keys order)."""
        covered = self._covered.get(keys)
        if covered is None:
            covered = self._covered[keys] = all(column == NUMEL or column.name in keys for column in self.columns)
        return covered

    def basic_gather(self, keys: Tuple[str, ...], device: torch.device) -> torch.Tensor:
        """Index tensor on `device` taking the row (in `columns` order) from ``cat([numel], vector)``, the vector
        holding the partials named `keys` in that order (the basic vector, or a quantize kernel's statistics
        vector; made once per keys order and device)."""
        index = self._gathers.get((keys, device))
        if index is None:
            positions = [0 if column == NUMEL else 1 + keys.index(column.name) for column in self.columns]
            index = self._gathers[(keys, device)] = torch.tensor(positions, dtype=torch.long, device=device)
        return index

    def host_gather(self, keys: Tuple[str, ...]) -> Callable[[Sequence[float]], List[float]]:
        """A function taking the row (a list in `columns` order) from host values laid out as `keys` (partial names,
        ``"numel"`` included): the CPU feed path's gather, made once per keys order."""
        gather = self._gathers.get((keys, "host"))
        if gather is None:
            pick = itemgetter(*self.row_positions(keys))
            if len(self.columns) == 1:
                gather = lambda values: [pick(values)]  # noqa: E731 - itemgetter of one position gives the value
            else:
                gather = lambda values: list(pick(values))  # noqa: E731
            self._gathers[(keys, "host")] = gather
        return gather

    def row_positions(self, keys: Tuple[str, ...]) -> Tuple[int, ...]:
        """Positions in a full row laid out as `keys` (partial names, ``"numel"`` included) of `columns`."""
        positions = self._positions.get(keys)
        if positions is None:
            positions = self._positions[keys] = tuple(keys.index(column.name) for column in self.columns)
        return positions

    def vector_positions(self, keys: Tuple[str, ...]) -> Tuple[int, ...]:
        """Per column, its index in a vector holding the partials `keys` in that order; -1 for the numel column when
        `keys` has no ``"numel"`` (the caller checked `covered_by`; remembered per keys order)."""
        positions = self._vector_positions.get(keys)
        if positions is None:
            positions = tuple(keys.index(column.name) if column.name in keys else -1 for column in self.columns)
            self._vector_positions[keys] = positions
        return positions

    @property
    def row(self) -> Optional[torch.Tensor]:
        """The step's merged row as a float64 tensor (staged feeds merged first), or None."""
        if self.staged:
            self.host_batch.resolve()
        return self._row

    @row.setter
    def row(self, value: Optional[torch.Tensor]) -> None:
        self._row = value

    @property
    def host_row(self) -> Optional[List[float]]:
        """The step's row as Python floats when its only feed gave host values (staged feeds merged first), or
        None."""
        if self.staged:
            self.host_batch.resolve()
        return self._host_row

    @host_row.setter
    def host_row(self, value: Optional[List[float]]) -> None:
        self._host_row = value

    @property
    def fed(self) -> bool:
        """True when the buffer received a feed since the last step (a staged one included)."""
        return (
            self._row is not None
            or self._host_row is not None
            or self.staged > 0
            or bool(self.slab_rows)
            or bool(self.vector_rows)
        )

    def add_vector_row(self, vector: torch.Tensor, keys: Tuple[str, ...], numel: int) -> None:
        """Record a feed whose row is read from a quantize kernel's statistics `vector` (partials named `keys`, in
        that order, covering every column but maybe numel) at the step: nothing is computed now.  The vector must
        not be written again (each quantization allocates its own); the caller checked that a weight buffer was not
        fed yet this step."""
        self.vector_rows.append(VectorRow(vector, self.vector_positions(keys), float(numel)))

    def set_requests(self, requests: Tuple[StatRequest, ...]) -> None:
        """Change the requested statistics; only allowed while the buffer holds no row for this step."""
        if requests is self.requests or requests == self.requests:
            return
        if self.fed:
            raise ValueError(
                f"statistics buffer {tuple(self.key)} was fed with stats {[r.name for r in self.requests]} this "
                f"step and now with {[r.name for r in requests]}; one buffer must get the same stats every feed"
            )
        self._set_requests(requests)

    def accumulate_host(self, values: List[float]) -> None:
        """Merge a new per-feed row given as Python floats in `self.columns` order (a CPU feed's host values): kept
        as it is when it is the step's first row, else merged as `accumulate` merges (the same float64 values)."""
        if len(values) != len(self.columns):
            raise ValueError(f"buffer {tuple(self.key)}: row of {len(values)} values, expected {len(self.columns)}")
        if self.staged:  # earlier feeds of this step first, in feed order
            self.host_batch.resolve()
        if not self.fed:
            self._host_row = values
        elif not self.is_weight:
            self.accumulate(torch.tensor(values, dtype=torch.float64))

    def accumulate(self, row: torch.Tensor) -> None:
        """Merge a new per-feed row (float64, columns in `self.columns` order)."""
        if row.shape != (len(self.columns),):
            raise ValueError(
                f"buffer {tuple(self.key)}: row of shape {tuple(row.shape)}, expected ({len(self.columns)},)"
            )
        if self.staged:  # earlier feeds of this step first, in feed order
            self.host_batch.resolve()
        if self._host_row is not None:  # a host row first: merged as the tensor it stands for
            self._row, self._host_row = torch.tensor(self._host_row, dtype=torch.float64), None
        if self._row is None:
            self._row = row
        elif self.is_weight:
            return
        else:
            self._row = combine_rows(self.columns, torch.stack([self._row, row.to(self._row.device)]))

    def clear(self) -> None:
        """Forget this step's row (requests, group and options stay; the owner of a `host_batch` discards it)."""
        self._row = self._host_row = None
        self.staged = 0
        if self.slab_rows:
            self.slab_rows = []
        if self.vector_rows:
            self.vector_rows = []


def family_slots(columns: Tuple[Column, ...]) -> Tuple[FamilySlots, ...]:
    """The (family, qualifier) pairs producing `columns` (numel excluded), in column order, each with the
    (partial name, column index) pairs it fills."""
    slots: Dict[Tuple[str, Tuple[Any, ...]], List[Tuple[str, int]]] = {}
    for index, column in enumerate(columns):
        family = family_of(column)
        if family != "meta":
            slots.setdefault((family, column.qualifier), []).append((column.name, index))
    return tuple((family, qualifier, tuple(pairs)) for (family, qualifier), pairs in slots.items())


class BufferStore:
    """All buffers of a session in creation order, and the ones a feed reached since the last step (`touched`): a step
    looks at those only, so a step in which nothing is logged costs nothing per buffer of the session."""

    def __init__(self) -> None:
        self._buffers: Dict[BufferKey, StatBuffer] = {}
        #: the buffer of a `BufferKey` or of the plain tuple of its fields (a NamedTuple hashes and compares as its
        #: fields), or None: the dict's own ``get`` (every feed looks its buffer up)
        self.get: Callable[[tuple], Optional[StatBuffer]] = self._buffers.get  # type: ignore[assignment]
        #: the buffers a feed reached since the last `clear_step`, as dict keys (no duplicates): every path that
        #: gives a buffer a row first adds it (``touched[buffer] = None``; one dict object for the store's life, so
        #: a feed may keep a reference to it)
        self.touched: Dict[StatBuffer, None] = {}

    def get_or_create(self, key: BufferKey, requests: Tuple[StatRequest, ...], *, is_weight: bool) -> StatBuffer:
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = StatBuffer(key, requests, is_weight=is_weight)
            buffer.order = len(self._buffers)
            self._buffers[key] = buffer
        else:
            buffer.set_requests(requests)
            buffer.is_weight = is_weight
        return buffer

    def __iter__(self) -> Iterator[StatBuffer]:
        return iter(self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def fed(self) -> List[StatBuffer]:
        """Buffers fed since the last step, in creation order."""
        buffers = [b for b in self.touched if b.fed]
        buffers.sort(key=_creation_order)  # (feeds may come in another order than the buffers were made)
        return buffers

    def clear_step(self, slab_rows_only: bool = False) -> None:
        """Forget the step's rows (of the touched buffers: no other buffer holds one).  `slab_rows_only`: every
        touched buffer was given slab rows and nothing else since the last step (a step fed only by
        `tedebug.stats.engine.SlabFeeder`s, which the engine recognises), so that list is all there is to drop."""
        if slab_rows_only:
            for buffer in self.touched:
                buffer.slab_rows = []  # (a new list: a step still in flight may hold the old one)
        else:
            for buffer in self.touched:
                buffer.clear()
        self.touched.clear()

    def reset(self) -> None:
        """Drop every buffer; their slab routes are cleared first, so a feeder kept by a feature
        (`tedebug.stats.engine.SlabFeeder`) refuses every call from then on."""
        for buffer in self._buffers.values():
            buffer.slab_route = None
        self._buffers.clear()
        self.touched.clear()


_creation_order = attrgetter("order")
