"""`StatsEngine`: feed tensors into statistic buffers, and at each step reduce, emit and clear.

`feed` computes the per-feed partials of the requested statistics (through `tedebug.backends`) and merges them
into the buffer's row on the tensor's device — no host synchronisation.  A basic-only feed of a small CPU tensor
is only copied into this step's staging (`tedebug.stats.host_batch.HostBatch`); `step` first reduces every staged
tensor together (`torch_ref.basic_partial_rows`) and merges each row, in feed order, into its buffer as Python
floats (`StatBuffer.accumulate_host`): no tensor is built and nothing is copied back at the step.  A CPU tensor the
batch does not take gets the backend's host values at once (`basic_partial_values`: the same floats).  A feed
of quantization statistics that a quantize kernel already counted for exactly this tensor (its statistics vector,
`tedebug.backends.fused_stats`) keeps a reference to that vector (`StatBuffer.add_vector_row`): no tensor op at all;
the step gathers every such vector at once.  A `SlabFeeder` (`slab_feeder`) is the usual GPU feed of one buffer (a
slab row) without `feed`'s general checks, for a buffer whose last feed went to the slab (LogTensorStats keeps one per
layer and tensor).
`step(finished_iteration)` reads every fed row back (`tedebug.stats.readback`: all copies enqueued at once; the usual
step, whose every buffer holds one row, through the layout kept from the last such step), runs one
collective per reduction group (`tedebug.stats.reduce`), evaluates the final formulas as Python floats and emits
``metric_logger.log_scalar("<layer>_<tensor>_<stat>", value, iteration, layer=, tensor=, stat=)`` in
buffer-creation order, statistics in request order (as one ``metric_logger.log_scalars(records)`` batch when the
logger has that method; `tedebug.sinks.MetricLogger` gets a ``log_deferred(build)`` callable instead, so that a
background writer evaluates the final formulas).  A batch is a `tedebug.sinks.batch.ScalarBatch`: a sequence of
records built from each buffer's emitters and merged row, whose values the file sinks read as one column (each
formula evaluated once per step, whatever the number of sinks).

Deferred read-back (`defer_read_back`, set by a background-logging session whose sinks all run on the writer
thread): `step(N)` enqueues iteration N's copies and returns without waiting for the GPU, after reducing and emitting
iteration N-1, whose copies finished long ago.  With several torch.distributed ranks the rows of iteration N go
into one asynchronous collective per reduction group (`tedebug.stats.distributed.GroupReducer`), whose result is
read and merged at step N+1.  So a training loop that never synchronises keeps the GPU's queue full across
steps.  `finish_pending()` emits the iteration still in flight (the session calls it when it flushes or closes).
Two sets of slabs alternate, so that the next step's kernels never write rows that are still being copied.

Participation rule (as in TransformerEngine): a rank that fed nothing this step joins the collectives only if some
layer's noted next enabled iteration is ≤ the finished iteration; otherwise it performs no communication at all.
Ranks join the groups of every buffer they ever created, so every layer is expected to run on every rank at its
first enabled iteration (the same assumption TransformerEngine makes).
"""

from __future__ import annotations

import logging
import math
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from tedebug.backends import backend_for, dispatch
from tedebug.backends.fused_stats import FusedStats, fused_vector, high_precision_row, high_precision_slot
from tedebug.config.parsing import GEMMS_OF_TENSOR
from tedebug.sinks.batch import DeferredBatch
from tedebug.stats import launch_group
from tedebug.stats import reduce as _reduce
from tedebug.stats.buffers import BufferKey, BufferStore, SlabRoute, StatBuffer
from tedebug.stats.definitions import StatRequest
from tedebug.stats.host_batch import HostBatch
from tedebug.stats.distributed import NO_REPLICA, DeferredReduction, GroupReducer, replica_id
from tedebug.stats.readback import FedRow, OneRowStepInFlight, RowsInFlight, StepLayout, one_row_step
from tedebug.stats.slab import RowSlab, ScratchAreas


#: `feed`'s `quantized` when none was given (never modified)
_NO_QUANTIZED: Mapping[str, Any] = MappingProxyType({})
#: distinct (numel, device) constants kept by `StatsEngine._numel_tensor` before the cache starts over
_NUMEL_CACHE_SIZE = 1024


class StatsEngine:
    """Buffers, reduction and emission of statistics for one debug session."""

    def __init__(
        self,
        metric_logger,
        *,
        log_message: Optional[Callable[..., Any]] = None,
        flush_at_step: bool = True,
        defer_read_back: bool = False,
    ) -> None:
        self.metric_logger = metric_logger
        #: flush the logger at the end of `step`; False when the owner flushes it itself (`DebugSession.step`
        #: decides when the background writer runs)
        self.flush_at_step = flush_at_step
        #: leave each step's rows in flight until the next step (see the module docstring)
        self.defer_read_back = defer_read_back
        self.log_message = log_message
        self._store = BufferStore()
        self._touched = self._store.touched
        self._next_iter: Dict[str, int] = {}
        self._nonfinite_reported = False
        self._request_cache: Dict[tuple, Tuple[StatRequest, ...]] = {}
        self._numel_tensors: Dict[Tuple[int, torch.device], torch.Tensor] = {}
        self._slabs: Dict[torch.device, RowSlab] = {}  # this step's slabs
        self._step_layout: Optional[StepLayout] = None  # the last one-row step's layout (`_one_row_step`)
        #: (layout, the buffers in feed order) of the last step when it was a one-row step whose rows were all rows
        #: of one slab taken in feed order (`_note_slab_order`): a next step fed the same way is that step again
        self._slab_order: Optional[Tuple[StepLayout, List[StatBuffer]]] = None
        #: `feed` (the general path) ran since the last step: only a step fed by `SlabFeeder`s alone may repeat
        #: the last one (`_repeated_step`)
        self._general_feed = False
        self._spare_slabs: Dict[torch.device, RowSlab] = {}  # the other set (deferred read-back alternates them)
        #: per device, the row scratch areas both sets share (a set's rows are written at its read-back, before the
        #: other set's launches on the stream)
        self._scratch_areas: Dict[torch.device, ScratchAreas] = {}
        self._in_flight: Optional[Tuple[Any, Dict[torch.device, RowSlab]]] = None
        #: (layer, tensor) -> replica id of a tensor every rank of a TP group holds whole (`note_tp_replicas`)
        self._replicas: Dict[Tuple[str, str], float] = {}
        self._replica_groups: Dict[str, Tuple[Any, Tuple[str, ...]]] = {}  # layer -> (TP group, tensor names)
        self._group_reducer = GroupReducer()
        #: this step's staged CPU feeds (`tedebug.stats.host_batch`), reduced together at the step
        self._host_batch = HostBatch()
        #: a feed has recorded a `SlabRoute` (`slab_feeder` may give a feeder): a session of CPU tensors, which never
        #: records one, need not ask
        self.has_slab_routes = False

    # ------------------------------------------------------------------------------------------------ feeding
    def feed(
        self,
        layer: str,
        tensor_name: str,
        stats: Iterable[Any],
        tensor: Optional[torch.Tensor],
        *,
        iteration: int,
        options: Tuple[Hashable, ...] = (),
        quantized: Optional[Mapping[str, Any]] = None,
        reduction_group: Any = None,
        skip_reduction: bool = False,
        is_weight: bool = False,
    ) -> None:
        """Add one tensor to the buffer ``(layer, tensor_name, options)``.

        `stats`: statistic names (plain high-precision names are parsed with `StatRequest.parse_hp`) or
        `StatRequest` objects.  `tensor`: the high-precision tensor, or None when only scale statistics are
        requested.  `quantized`: recipe name (``""`` = training recipe) -> QuantizedTensor for quantized stats.
        Empty tensors are ignored; a weight buffer keeps its first feed of the step.
        """
        self._general_feed = True
        # a plain tuple finds the BufferKey entry (a NamedTuple hashes and compares as its fields)
        key = (layer, tensor_name, options if type(options) is tuple else tuple(options))
        buffer = self._store.get(key)
        if buffer is not None and stats is buffer.stats_source:
            requests = buffer.requests  # the same immutable stats object as the last feed: already parsed
        else:
            requests = self._requests(layer, tensor_name, stats)
        if type(tensor) is not torch.Tensor or not tensor.is_floating_point():  # (a plain float tensor passes)
            _check_tensor(layer, tensor_name, tensor)
        quantized = dict(quantized) if quantized else _NO_QUANTIZED
        numel = tensor.numel() if tensor is not None else self._numel_from_quantized(layer, tensor_name, quantized)
        if numel == 0:
            return
        if buffer is None or requests is not buffer.requests:
            buffer = self._store.get_or_create(BufferKey(*key), requests, is_weight=is_weight)
            buffer.stats_source = stats if _immutable_entries(stats) else None
        self._touched[buffer] = None  # (before any path below gives it a row: the step looks at these only)
        buffer.is_weight = is_weight
        buffer.iteration = iteration
        buffer.reduction_group = reduction_group
        buffer.skip_reduction = skip_reduction
        if is_weight and buffer.fed:  # a weight buffer keeps its first feed of the step
            return
        if buffer.quantized_source is not None and tensor is not None and quantized:
            # every partial in the statistics vector the quantize kernel wrote for this very tensor: the feed keeps
            # a reference to it and the step gathers all such vectors at once (no launch, nothing computed now)
            fused = _kernel_vector(buffer, tensor, quantized)
            if fused is not None:
                buffer.add_vector_row(fused.vector, fused.keys_in_order, numel)
                return
        try:
            if buffer.basic_only and tensor is not None:
                backend = backend_for(tensor)
                values_of = getattr(backend, "basic_partial_values", None)
                if values_of is not None and tensor.is_cpu:  # host values: the row as Python floats
                    rows_of = getattr(backend, "basic_partial_rows", None)
                    if rows_of is not None and self._host_batch.stage(buffer, tensor, rows_of):
                        return  # copied; reduced with the step's other staged tensors when the row is read
                    values = (float(numel),) + values_of(tensor)  # (read detached: no autograd record of the math)
                    buffer.accumulate_host(buffer.host_gather(backend.BASIC_ROW_KEYS)(values))
                    return
                into = getattr(backend, "basic_stats_into", None)
                if into is not None:
                    fused_row = high_precision_row(tensor)
                    if fused_row is not None:  # the quantizer's amax pass computed this very row: keep it
                        buffer.add_vector_row(fused_row, backend.BASIC_ROW_KEYS, numel)
                        return
                    into, group_into, scratch = _slab_launches(backend, into)
                    route = buffer.slab_route
                    if (
                        route is None
                        or route.backend is not backend
                        or route.into is not into
                        or route.group_into is not group_into
                    ):
                        route = buffer.slab_route = SlabRoute(
                            backend, into, group_into, backend.BASIC_ROW_KEYS, values_of is not None, scratch
                        )
                        self.has_slab_routes = True
                    self._launch_slab_row(buffer, tensor, route)
                    return
            if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
                with torch.no_grad():  # statistics are no part of the model's graph: record no autograd nodes
                    row = self._compute_row(buffer, tensor, quantized, numel)
            else:
                row = self._compute_row(buffer, tensor, quantized, numel)
        except (ValueError, TypeError) as err:
            raise type(err)(f"statistics of layer {layer!r}, tensor {tensor_name!r}: {err}") from err
        buffer.accumulate(row)

    def slab_feeder(self, key: Tuple[str, str, Tuple[Hashable, ...]], stats: Any) -> Optional["SlabFeeder"]:
        """The few-step form of `feed` for the buffer of `key` (``(layer, tensor name, options)``) while it is fed this
        very immutable `stats` object and its feeds go to the slab (`SlabFeeder`), or None when `feed` must take
        the next call: no such buffer yet, another stats object, or its last feed did not reach the slab."""
        buffer = self._store.get(key)
        if buffer is None or stats is None or buffer.stats_source is not stats or buffer.slab_route is None:
            return None
        return SlabFeeder(self, buffer, buffer.slab_route, stats)

    def _launch_slab_row(self, buffer: StatBuffer, tensor: torch.Tensor, route: SlabRoute) -> None:
        """One launch writing `tensor`'s whole row into this step's slab; inside a layer's launch group the launch
        waits for the group's other tensors (`tedebug.stats.launch_group`)."""
        device = tensor.device
        slab = self._slabs.get(device)
        if slab is None or slab.width != len(route.keys):
            slab = self._new_slab(device, len(route.keys))
        index, address = slab.take() if route.scratch is None else slab.take_scratch(route.scratch)
        launch_group.submit(route.group_into, route.into, tensor, address)
        # the row the kernel writes into `slab` for this step, laid out as the route's partial names (the caller
        # checked that a weight buffer was not fed yet this step: a weight keeps its first feed)
        buffer.slab_rows.append((slab, index))
        buffer.slab_keys = route.keys

    def _new_slab(self, device: torch.device, width: int) -> RowSlab:
        """A new slab of rows of `width` for this step on `device` (`_launch_slab_row` found none of that width),
        sharing the device's scratch areas."""
        scratch = self._scratch_areas.get(device)
        if scratch is None:
            scratch = self._scratch_areas[device] = ScratchAreas(device)
        slab = self._slabs[device] = RowSlab(device, width, scratch)
        return slab

    def _requests(self, layer: str, tensor_name: str, stats: Iterable[Any]) -> Tuple[StatRequest, ...]:
        """The parsed, de-duplicated requests; a list or tuple of plain names is parsed once per session."""
        entries = stats if type(stats) is tuple else tuple(stats)
        if not all(type(e) is str for e in entries):
            return _parse_requests(layer, tensor_name, entries)  # StatRequests parse to themselves; mappings vary
        key = (tensor_name, entries)
        cached = self._request_cache.get(key)
        if cached is None:
            cached = self._request_cache[key] = _parse_requests(layer, tensor_name, entries)
        return cached

    @staticmethod
    def _numel_from_quantized(layer: str, tensor_name: str, quantized: Mapping[str, Any]) -> int:
        if not quantized:
            raise ValueError(
                f"layer {layer!r}, tensor {tensor_name!r}: tensor is None and no quantized tensor was given"
            )
        return next(iter(quantized.values())).numel()

    def _compute_row(self, buffer: StatBuffer, x, quantized: Mapping[str, Any], numel: int) -> torch.Tensor:
        if x is None:
            missing_x = [r.name for r in buffer.requests if r.needs_tensor]
            if missing_x:
                raise ValueError(f"stats {missing_x} need the high-precision tensor, which is None")
        device = x.device if x is not None else next(iter(quantized.values())).device
        numel_value = self._numel_tensor(numel, device)
        backend = backend_for(x)
        if buffer.basic_only:
            row_of = getattr(backend, "basic_partials_row", None)
            if row_of is not None:  # one vector from the backend, one gather: no per-partial tensors
                vector = row_of(x)
                if vector.device != device:
                    vector = vector.to(device)
                source = torch.cat((numel_value.reshape(1), vector))
                return source.index_select(0, buffer.basic_gather(backend.BASIC_KEYS, device))
        values: List[Optional[torch.Tensor]] = [None] * len(buffer.columns)
        values[buffer.numel_index] = numel_value
        for family, qualifier, slots in buffer.families:
            partials = _family_partials(backend, family, qualifier, x, quantized)
            for name, index in slots:
                value = partials[name]
                values[index] = value if value.device == device else value.to(device)
        return torch.stack(values)  # type: ignore[arg-type]  # the loop above filled every slot

    def _numel_tensor(self, numel: int, device: torch.device) -> torch.Tensor:
        """0-d float64 `numel` on `device`, made once per (numel, device) and only ever read (rows copy it)."""
        key = (numel, device)
        value = self._numel_tensors.get(key)
        if value is None:
            if len(self._numel_tensors) >= _NUMEL_CACHE_SIZE:
                self._numel_tensors.clear()
            value = self._numel_tensors[key] = torch.full((), float(numel), dtype=torch.float64, device=device)
        return value

    # ------------------------------------------------------------------------------------------------ schedule
    def note_next_iteration(self, layer: str, next_iter: Optional[int]) -> None:
        """Record the next iteration at which `layer` may feed (None = never again: the layer is dropped)."""
        if next_iter is None:
            self._next_iter.pop(layer, None)
        else:
            self._next_iter[layer] = int(next_iter)

    def note_tp_replicas(self, layer: str, tensor_names: Tuple[str, ...], tp_group: Any) -> None:
        """The tensors `tensor_names` of `layer` are held whole by every rank of `tp_group` (copies): a reduction
        over a group containing several of those ranks counts them once.  Cheap when nothing changed."""
        if tp_group is None or not _reduce.distributed_ready():
            return
        noted = self._replica_groups.get(layer)
        if noted is not None and noted[0] is tp_group and noted[1] == tensor_names:
            return
        self._replica_groups[layer] = (tp_group, tensor_names)
        replica = replica_id(tp_group)
        for name in tensor_names:
            self._replicas[(layer, name)] = replica

    # ------------------------------------------------------------------------------------------------ step
    def defers(self) -> bool:
        """True when `step` leaves the rows of its iteration in flight until the next step."""
        return self.defer_read_back

    @property
    def has_in_flight(self) -> bool:
        """True when an iteration's rows are still in flight (deferred read-back; emitted by `finish_pending`)."""
        return self._in_flight is not None

    def step(self, finished_iteration: int) -> None:
        """Reduce the buffers fed since the last step, emit their statistics, and clear them (deferred read-back:
        start their transfer and emit the previous step's instead)."""
        try:
            self._host_batch.resolve()  # every staged CPU feed reduced together, merged into its buffer's row
        except BaseException:
            self._host_batch.discard()
            self._store.clear_step()
            raise
        repeated = self._repeated_step()
        fed = list(repeated[0].buffers) if repeated is not None else self._store.fed()
        if self.defers():
            # the previous iteration first: its reduction may extend the group layouts this iteration uses
            previous, self._in_flight = self._in_flight, None
            try:
                if previous is not None:
                    self._finish(*previous)  # its slabs become the spare set
            finally:
                try:
                    started = self._start(fed, finished_iteration, repeated)
                except BaseException:
                    for slab in self._slabs.values():
                        slab.reset()
                    raise
                finally:
                    self._store.clear_step(slab_rows_only=repeated is not None)
                if started is not None:
                    self._in_flight = (started, self._slabs)
                    self._slabs, self._spare_slabs = self._spare_slabs, {}
            return
        self.finish_pending()
        due = any(n <= finished_iteration for n in self._next_iter.values())
        try:
            if not fed and not due:
                return
            communicate = _reduce.distributed_ready()
            one_row = self._one_row_step(fed, repeated) if fed and not communicate else None
            if one_row is not None:
                self._emit_one_row(one_row, one_row.values())
                return
            rows = RowsInFlight(fed)
            host = rows.host_rows()
            merged = self._reduce(rows.entries, host, communicate)
            self._emit(rows.entries, merged)
        finally:
            self._store.clear_step(slab_rows_only=repeated is not None)  # (a repeated step: slab feeds only)
            for slab in self._slabs.values():
                slab.reset()

    def _start(
        self,
        fed: List[StatBuffer],
        finished_iteration: int,
        repeated: Optional[Tuple[StepLayout, List[StatBuffer], RowSlab]],
    ):
        """Deferred read-back: start iteration `finished_iteration`'s transfers (and, with several ranks, its
        collectives); None when this rank has nothing to do (the participation rule of the module docstring)."""
        if not _reduce.needs_communication():
            if not fed:
                return None
            return self._one_row_step(fed, repeated) or RowsInFlight(fed)
        if not fed and not any(n <= finished_iteration for n in self._next_iter.values()):
            return None
        # each distinct group object's order key asked once (buffers share a few groups)
        order_keys: Dict[int, Any] = {}

        def order_key(group: Any) -> Any:
            key = order_keys.get(id(group))
            if key is None:
                key = order_keys[id(group)] = _reduce.group_order_key(group)
            return key

        known: Dict[int, Any] = {}
        for b in self._store:
            if not b.skip_reduction:
                known.setdefault(id(b.reduction_group), b.reduction_group)
        by_group: Dict[Any, List[StatBuffer]] = {}
        for b in fed:
            if not b.skip_reduction:
                by_group.setdefault(order_key(b.reduction_group), []).append(b)
        reduction = self._group_reducer.start(
            _reduce.ordered_groups(list(known.values())), order_key, by_group, self._replicas
        )
        pending = {key for _, _, keys in reduction.pending for key in keys}
        return _StepInFlight(
            [FedRow(b) for b in fed], RowsInFlight([b for b in fed if b.skip_reduction or b.key in pending]), reduction
        )

    def finish_pending(self) -> None:
        """Reduce and emit the iteration whose rows are still in flight, if any (deferred read-back)."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._finish(*previous)

    def _one_row_step(
        self, fed: List[StatBuffer], repeated: Optional[Tuple[StepLayout, List[StatBuffer], RowSlab]] = None
    ) -> Optional[OneRowStepInFlight]:
        """The step's rows as a one-row step (`tedebug.stats.readback.StepLayout`: the layout of the last such
        step when it still fits, else a new one), or None when `fed` is not one.  `repeated`: what
        `_repeated_step` found (`fed` is then its layout's buffers)."""
        iteration = fed[0].iteration
        if repeated is not None:
            self._slab_order = (repeated[0], repeated[1])  # (still this step's order)
            return OneRowStepInFlight(repeated[0], fed, repeated[2], iteration)
        layout = self._step_layout
        if layout is not None:
            at = layout.first_slab
            slab = fed[at].slab_rows[0][0] if 0 <= at < len(fed) and len(fed[at].slab_rows) == 1 else None
            if layout.matches(fed, slab, iteration):
                self._note_slab_order(layout, slab)
                return OneRowStepInFlight(layout, fed, slab, iteration)
        found = one_row_step(fed)
        if found is None:
            return None
        layout = self._step_layout = StepLayout(fed)
        self._note_slab_order(layout, found[0])
        return OneRowStepInFlight(layout, fed, found[0], iteration)

    def _note_slab_order(self, layout: StepLayout, slab: Optional[RowSlab]) -> None:
        """Keep the feed order of this one-row step (`layout`, just checked against its buffers) when its rows are
        all rows of `slab`, the step's one slab, taken in that order: row i is the i-th buffer fed."""
        order = list(self._touched)
        if (
            slab is None
            or layout.hosts
            or layout.vectors
            or len(self._slabs) != 1
            or slab.used != len(order)
            or len(order) != len(layout.buffers)
            or any(b.slab_rows[0] != (slab, i) for i, b in enumerate(order))
        ):
            return
        self._slab_order = (layout, order)

    def _repeated_step(self) -> Optional[Tuple[StepLayout, List[StatBuffer], RowSlab]]:
        """(the last step's layout, its feed order, this step's slab) when this step repeats the last one-row step
        of slab rows (`_note_slab_order`), else None.  Taken at the start of every step (a step that is not found
        to be such a step again keeps nothing).

        Why it is that step again, checked in a few C-level operations rather than buffer by buffer
        (`StepLayout.matches`): no general `feed` ran, so every feed since the last step was a `SlabFeeder`'s,
        which gives a buffer slab rows and nothing else, and changes neither its requests (emitters, columns) nor
        its route (slab keys); the buffers were touched in the last step's order, so each took its first row at
        the last step's index; the slab holds as many rows as there are buffers, so each holds exactly one; and
        every buffer was fed at one iteration."""
        known, self._slab_order = self._slab_order, None
        general, self._general_feed = self._general_feed, False
        if known is None or general or len(self._slabs) != 1:
            return None
        layout, order = known
        touched = self._touched
        (slab,) = self._slabs.values()
        if slab.used != len(order) or len(touched) != len(order) or list(touched) != order:
            return None
        iterations = list(map(_ITERATION_OF, order))
        if iterations.count(iterations[0]) != len(iterations):
            return None
        return layout, order, slab

    def _finish(self, rows: Any, slabs: Dict[torch.device, RowSlab]) -> None:
        one_row = isinstance(rows, OneRowStepInFlight)
        try:
            host = rows.values() if one_row else rows.host_rows()
        finally:
            for slab in slabs.values():
                slab.reset()
            if not self._spare_slabs:
                self._spare_slabs = slabs
        if one_row:
            self._emit_one_row(rows, host)
            return
        if isinstance(rows, _StepInFlight):
            merged = {e.key: host[e.key] for e in rows.entries if e.skip_reduction}
            merged.update(rows.reduction.finish(host))  # type: ignore[arg-type]  # its keys are `host`'s BufferKeys
            self._emit(rows.entries, merged)
            return
        self._emit(rows.entries, self._reduce(rows.entries, host, False))

    def _reduce(
        self, fed: List[FedRow], host: Dict[BufferKey, List[float]], communicate: bool
    ) -> Dict[BufferKey, List[float]]:
        """Every fed buffer's merged row, in its `columns` order (its host row when it is not reduced)."""
        if not communicate:
            return host  # (`host` holds the row of every fed buffer and nothing else: no copy of it is needed)
        merged: Dict[BufferKey, List[float]] = {}
        for buffer in fed:
            if buffer.skip_reduction:
                merged[buffer.key] = host[buffer.key]
        known = [b.reduction_group for b in self._store if not b.skip_reduction]
        for group in _reduce.ordered_groups(known):
            gkey = _reduce.group_order_key(group)
            local = {
                b.key: (b.columns, host[b.key], self._replicas.get((b.key.layer, b.key.tensor), NO_REPLICA))
                for b in fed
                if not b.skip_reduction and _reduce.group_order_key(b.reduction_group) == gkey
            }
            for key, rows in _reduce.gather_rows(local, group).items():
                values = _reduce.merge_host_rows(key, rows)
                merged[key] = [values[column] for column in local[key][0]]
        return merged

    def _emit(self, fed: List[FedRow], merged: Dict[BufferKey, List[float]]) -> None:
        rows: List[tuple] = []
        for buffer in fed:
            values = merged[buffer.key]
            layer_name, tensor_name, _ = buffer.key
            rows.append((buffer.emitters, values, buffer.iteration, layer_name, tensor_name))
            positions = buffer.nonfinite_positions
            if (
                positions is not None
                and not self._nonfinite_reported
                and (values[positions[0]] or values[positions[1]])
            ):
                # (a count that is not zero: the first non-finite values)
                self._report_nonfinite(buffer.key, buffer.iteration, positions, values)
        self._log_batch(DeferredBatch(rows))

    def _log_batch(self, records: DeferredBatch) -> None:
        """Hand a step's batch to the metric logger (the final formulas run when a writer builds it, or in the
        writer process), then flush it when the engine flushes at each step."""
        log_deferred = getattr(self.metric_logger, "log_deferred", None)
        log_scalars = getattr(self.metric_logger, "log_scalars", None)
        if callable(log_deferred):
            log_deferred(records)
        elif callable(log_scalars):
            log_scalars(records())
        else:
            for name, value, iteration, layer, tensor, stat in records():
                self.metric_logger.log_scalar(name, value, iteration, layer=layer, tensor=tensor, stat=stat)
        flush = getattr(self.metric_logger, "flush", None)
        if self.flush_at_step and callable(flush):
            flush()

    def _emit_one_row(self, step: OneRowStepInFlight, values: Union[np.ndarray, List[List[float]]]) -> None:
        """`_emit` of a one-row step: the rows in the layout's order, with its layout key and iteration.  `values`
        (`OneRowStepInFlight.values`) is one float64 array in the usual GPU step, which the batch keeps as it is
        (`ScalarBatch.from_packed`: a writer process receives its bytes, no Python float is made here)."""
        layout, iteration = step.layout, step.iteration
        batch_iteration = iteration if layout.named else None
        packed = values if isinstance(values, np.ndarray) else None
        if layout.nonfinite and not self._nonfinite_reported:
            if packed is not None:  # the buffers whose counts are not zero, in the layout's order: one numpy pass
                at_rows, nan_cols, inf_cols = layout.nonfinite_index
                counted = [
                    layout.nonfinite[k] for k in np.flatnonzero(packed[at_rows, nan_cols] + packed[at_rows, inf_cols])
                ]
            else:
                counted = [(i, n, f) for i, n, f in layout.nonfinite if values[i][n] or values[i][f]]
            for i, nan_at, inf_at in counted:
                self._report_nonfinite(layout.buffers[i].key, iteration, (nan_at, inf_at), values[i])
                if self._nonfinite_reported:
                    break
        if packed is not None:
            self._log_batch(DeferredBatch((), layout.key, batch_iteration, packed=(layout.parts, packed, iteration)))
            return
        rows = [
            (emitters, row, iteration, layer, tensor) for (emitters, layer, tensor), row in zip(layout.parts, values)
        ]
        self._log_batch(DeferredBatch(rows, layout.key, batch_iteration))

    def _report_nonfinite(
        self, key: BufferKey, iteration: Any, positions: Tuple[int, int], values: Sequence[float]
    ) -> None:
        """Write the first non-finite values' message (once per session) when the row `values` of buffer `key`
        counts any (`positions`: where its NaN and Inf counts are)."""
        if self._nonfinite_reported or self.log_message is None:
            return
        nan_at, inf_at = positions
        nans, infs = values[nan_at], values[inf_at]
        if nans == 0 and infs == 0:
            return
        self._nonfinite_reported = True
        layer, tensor_name, _ = key
        gemms = "/".join(g for g in GEMMS_OF_TENSOR.get(tensor_name, ()) if g) or "-"
        self.log_message(
            f"First non-finite values: layer={layer} tensor={tensor_name} gemm={gemms} "
            f"iteration={iteration} nan_count={_count_text(nans)} inf_count={_count_text(infs)}",
            layer_name=layer,
            level=logging.WARNING,
        )

    def reset(self) -> None:
        """Drop every buffer, the next-iteration table and the non-finite report state."""
        self._host_batch.discard()
        self._store.reset()
        self._next_iter.clear()
        self._nonfinite_reported = False
        self._request_cache.clear()
        self._numel_tensors.clear()
        self._slabs.clear()
        self._spare_slabs.clear()
        self._scratch_areas.clear()
        self._step_layout = None
        self._slab_order = None
        self._general_feed = False
        self._in_flight = None
        self._replicas.clear()
        self._replica_groups.clear()
        self._group_reducer.reset()


class SlabFeeder:
    """`StatsEngine.feed` of one buffer's usual GPU feed in a few steps (`StatsEngine.slab_feeder` makes it; a feature
    keeps it for the buffer's next feeds: LogTensorStats, one per layer and tensor).

    `feed` takes a call when the buffer is still fed `stats` and still sends its feeds to the slab by the route the
    feeder was made with, and `feed` would send `tensor` there again: a non-empty floating-point tensor for which
    `backend_for` answers the route's backend, not a CPU tensor of a backend that gives those host values, and no
    quantize pass computed its basic row (`high_precision_row`).  It then does what `feed` does for it, without the
    general checks: the buffer noted as touched, with this feed's iteration and reduction arguments, and (unless a
    weight buffer was fed this step: a weight keeps its first feed) a slab row taken and its launch handed to the
    layer's launch group.  It answers False, having changed nothing, for any other call, which `feed` must take; a
    general feed that finds another backend makes a new route, and the engine's `reset` clears every route, so a
    feeder of a replaced route or a reset engine refuses every call from then on."""

    __slots__ = ("engine", "buffer", "route", "stats")

    def __init__(self, engine: StatsEngine, buffer: StatBuffer, route: SlabRoute, stats: Any) -> None:
        self.engine = engine
        self.buffer = buffer
        self.route = route
        self.stats = stats

    def feed(self, tensor: Any, iteration: int, reduction_group: Any, skip_reduction: bool, is_weight: bool) -> bool:
        buffer, route = self.buffer, self.route
        if (
            buffer.slab_route is not route
            or buffer.stats_source is not self.stats
            or not isinstance(tensor, torch.Tensor)
            or not tensor.is_floating_point()
            or tensor.numel() == 0
            or backend_for(tensor) is not route.backend
            or (route.host_values and tensor.is_cpu)
            or (high_precision_slot.slot is not None and high_precision_row(tensor) is not None)
        ):
            return False
        engine = self.engine
        engine._touched[buffer] = None
        buffer.is_weight = is_weight
        buffer.iteration = iteration
        buffer.reduction_group = reduction_group
        buffer.skip_reduction = skip_reduction
        if not (is_weight and buffer.fed):
            engine._launch_slab_row(buffer, tensor, route)
        return True


class _StepInFlight:
    """A step of a multi-rank deferred read-back: the emission snapshot of every fed buffer, the host transfers of
    the buffers reduced on the host (skip_reduction, or new to their group's layout) and the group collectives."""

    def __init__(self, entries: List[FedRow], rows: RowsInFlight, reduction: DeferredReduction) -> None:
        self.entries = entries
        self.rows = rows
        self.reduction = reduction

    def host_rows(self) -> Dict[BufferKey, List[float]]:
        return self.rows.host_rows()


# ------------------------------------------------------------------------------------------------ helpers
_ITERATION_OF = attrgetter("iteration")


def _count_text(count: float) -> str:
    """A count column's value as the message writes it: an integer, or the value itself when it is not a finite
    number (a row no kernel wrote: reported, where `int` would raise in the middle of the step)."""
    return str(int(count)) if math.isfinite(count) else str(count)


def _slab_launches(backend: Any, into: Callable[..., None]) -> Tuple[Callable[..., None], Any, Any]:
    """(lone launch, group launch or None, the scratch backend or None) of a slab row through `backend`, whose
    ``basic_stats_into`` is `into`: its scratch launches when it has them (the row is written at the step's end,
    `RowSlab.take_scratch`), else its row launches."""
    scratch_into = getattr(backend, "basic_stats_scratch_into", None)
    if scratch_into is not None:
        return scratch_into, getattr(backend, "basic_stats_group_scratch_into", None), backend
    return into, getattr(backend, "basic_stats_group_into", None), None


def _check_tensor(layer: str, tensor_name: str, tensor: Any) -> None:
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"layer {layer!r}, tensor {tensor_name!r}: statistics need a torch.Tensor in high precision, got "
            f"{type(tensor).__name__} (quantized tensors go in `quantized=`)"
        )
    if not tensor.is_floating_point():
        raise TypeError(
            f"layer {layer!r}, tensor {tensor_name!r}: statistics need a floating-point high-precision tensor, "
            f"got dtype {tensor.dtype}"
        )


def _immutable_entries(stats: Any) -> bool:
    """True for a tuple of names and `StatRequest`s (an object whose parse can never change)."""
    return type(stats) is tuple and all(type(e) is str or type(e) is StatRequest for e in stats)


def _parse_requests(layer: str, tensor_name: str, entries: Sequence[Any]) -> Tuple[StatRequest, ...]:
    """`StatRequest.parse_hp` of every entry, the first of each name kept."""
    requests: List[StatRequest] = []
    names = set()
    for entry in entries:
        request = StatRequest.parse_hp(entry, tensor_name=tensor_name)
        if request.name not in names:
            names.add(request.name)
            requests.append(request)
    if not requests:
        raise ValueError(f"layer {layer!r}, tensor {tensor_name!r}: feed() needs at least one statistic")
    return tuple(requests)


def _kernel_vector(buffer: StatBuffer, x: torch.Tensor, quantized: Mapping[str, Any]) -> Optional[FusedStats]:
    """The statistics vector a quantize kernel wrote for exactly `x` (`tedebug.backends.fused_stats`) holding every
    partial of `buffer`'s row (all quantization statistics of one direction, `buffer.quantized_source`), or None.

    Not taken when the torch reference was asked for explicitly (``use_backend("torch")`` /
    ``TEDEBUG_BACKEND=torch``): the reference then recomputes every statistic, an independent check of the
    quantizer's own counts.  The vector is on `x`'s device: a quantizer writes it where it quantizes `x`."""
    recipe, columnwise = buffer.quantized_source  # type: ignore[misc]  # the caller checked it is set
    q = quantized.get(recipe)
    if q is None:
        return None
    fused = fused_vector(q, x, "columnwise" if columnwise else "rowwise")
    if fused is None or not buffer.covered_by(fused.keys_in_order) or dispatch.requested_backend() == "torch":
        return None
    return fused


def _family_partials(backend, family: str, qualifier: Tuple[Any, ...], x, quantized: Mapping[str, Any]):
    """The partials dict of one family from `backend` (`backend_for(x)`)."""
    if family == "basic":
        return backend.basic_partials(x)
    if family == "blockwise":
        return backend.blockwise_dynamic_range_partials(x, *qualifier)
    recipe, columnwise = qualifier
    if recipe not in quantized:
        raise ValueError(
            f'no quantized tensor for recipe {recipe!r} ("" = training recipe); got recipes {sorted(quantized)}'
        )
    q = quantized[recipe]
    usage = "columnwise" if columnwise else "rowwise"
    if family == "underflow":
        return backend.underflow_partials(x, q, usage)
    if family == "mse":
        return backend.mse_partials(x, q, usage)
    if family == "overflow":
        return backend.overflow_partials(x, q, usage)
    if family == "scale_inv":
        return backend.scale_inv_partials(q, usage)
    raise ValueError(f"unknown partial family {family!r}")
