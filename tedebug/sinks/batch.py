"""`ScalarBatch`: the statistics of one step in columnar form, as `tedebug.stats.engine.StatsEngine` emits them.

A batch holds one row per emitted buffer: ``(emitters, row, iteration, layer, tensor)``, where `emitters` is the
buffer's `Emitters`: its ``(name, stat)`` pairs (one per statistic, in request order) and ``values_of(row)``, the
final values of them all from its merged row (one call per buffer: `tedebug.stats.definitions.row_evaluator`
generates it).  It is a read-only ``Sequence[Record]`` (`tedebug.sinks.base.Record`): the records ``(name, value,
iteration, layer, tensor, stat)`` are built on first use and cached, so any sink (`Sink.log_scalars`, a user object,
TensorBoard) receives it as it would a list of records.  The file sinks (`tedebug.sinks.text`, `tedebug.sinks.jsonl`)
read its columns instead, each computed once per batch whatever the number of sinks:

* `values`: the value of every record as a Python float, in record order (every ``values_of`` runs once per batch);
* `iteration`: the iteration of every record, or None when they differ;
* `layout` / `same_layout`: a key of the sequence of (name, layer, tensor, stat): the rows' emitters, layer and
  tensor objects, compared by identity.  A buffer keeps its emitters tuple while its requests stay the same, so
  consecutive steps logging the same buffers have the same layout, and a sink can reuse the line pieces it made
  for the last one.  The same layout implies the same names; a different one only means "make them again".

A batch never changes once built: the rows must not be modified after they are handed over (the engine makes new
ones every step), and `emitters` never changes (an immutable `Emitters`).  A batch may also hold its rows as one
float64 array (`ScalarBatch.from_packed`: the usual GPU step's statistics), made into lists of Python floats only
when a reader needs rows; a writer process receives the array's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union, overload

from tedebug.sinks.background import Record


class Emitters(NamedTuple):
    """What a buffer emits: the ``(name, stat)`` pair of each statistic (emitted name, requested statistic, in
    request order) and `values_of`, the list of their final values from one merged row, in the same order."""

    names: Tuple[Tuple[str, str], ...]
    values_of: Callable[[Any], List[Any]]


#: ``(emitters, row, iteration, layer, tensor)``: one buffer of a batch
BatchRow = Tuple[Emitters, Any, Any, Any, Any]

_EMITTERS = itemgetter(0)
_NAMES = attrgetter("names")
_UNSET: Any = object()  # a column not computed yet (None is a valid `iteration`)


class ScalarBatch(Sequence):
    """One step's statistics: a read-only sequence of records with cached columns (see the module docstring)."""

    __slots__ = ("_rows", "_packed", "_len", "_raw", "_values", "_records", "_iteration", "_layout")

    def __init__(
        self, rows: Iterable[BatchRow], layout: Optional[Tuple[Any, ...]] = None, iteration: Any = _UNSET
    ) -> None:
        """`layout` and `iteration`, when given, are the batch's `layout` and `iteration` as the caller knows them
        (a caller that emits the same rows every step keeps one layout object: `same_layout` is then one
        comparison)."""
        self._rows: Optional[Tuple[BatchRow, ...]] = tuple(rows)
        #: (parts, array, iteration) of a batch made by `from_packed` (its `_rows` are made when first read)
        self._packed: Optional[Tuple[Sequence[Tuple[Emitters, Any, Any]], Any, Any]] = None
        self._len: Optional[int] = None
        self._raw: Optional[List[Any]] = None  # value_of(row) of every record, as returned
        self._values: Optional[List[float]] = None
        self._records: Optional[List[Record]] = None
        self._iteration: Any = iteration
        self._layout: Optional[Tuple[Any, ...]] = layout

    @classmethod
    def from_packed(
        cls,
        parts: Sequence[Tuple[Emitters, Any, Any]],
        array: Any,
        row_iteration: Any,
        layout: Optional[Tuple[Any, ...]] = None,
        iteration: Any = _UNSET,
    ) -> "ScalarBatch":
        """The batch of the rows ``(emitters, array[i], row_iteration, layer, tensor)`` for ``parts[i] = (emitters,
        layer, tensor)``, where `array` is a float64 numpy array ``[len(parts), columns]`` that nothing else holds.
        Its rows become lists of Python floats (``array.tolist()``) only when a reader needs them; `packed_rows`
        gives the array itself, whose bytes a writer process receives as they are (`tedebug.sinks.process_wire`)."""
        batch = cls((), layout, iteration)
        batch._rows = None
        batch._packed = (parts, array, row_iteration)
        return batch

    def _all_rows(self) -> Tuple[BatchRow, ...]:
        """The batch's rows (those of a `from_packed` batch made now, once)."""
        rows = self._rows
        if rows is None:
            parts, array, iteration = self._packed  # type: ignore[misc]
            rows = self._rows = tuple(
                (emitters, row, iteration, layer, tensor)
                for (emitters, layer, tensor), row in zip(parts, array.tolist())
            )
        return rows

    def packed_rows(self) -> Any:
        """The float64 array of a `from_packed` batch's rows (one row per buffer; do not modify), else None."""
        return None if self._packed is None else self._packed[1]

    # ------------------------------------------------------------------------------------------- sequence
    def __len__(self) -> int:
        if self._len is None:
            emitters = map(_EMITTERS, self._all_rows() if self._packed is None else self._packed[0])
            self._len = sum(map(len, map(_NAMES, emitters)))
        return self._len

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> List[Record]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[Record, List[Record]]:
        return self.records[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __repr__(self) -> str:
        return f"ScalarBatch({len(self)} records of {len(self.row_parts())} buffers)"

    @property
    def records(self) -> List[Record]:
        """The ``(name, value, iteration, layer, tensor, stat)`` records, in order (built once; do not modify)."""
        if self._records is None:
            raw = iter(self._raw_values())
            records: List[Record] = []
            for emitters, _, iteration, layer, tensor in self._all_rows():
                records.extend([(name, next(raw), iteration, layer, tensor, stat) for name, stat in emitters.names])
            self._records = records
        return self._records

    # ------------------------------------------------------------------------------------------- columns
    def evaluate(self) -> "ScalarBatch":
        """Run every ``values_of`` now (an error it raises is raised here); returns the batch."""
        self._raw_values()
        return self

    def _raw_values(self) -> List[Any]:
        """The value of every statistic, in record order, as the emitters' ``values_of`` return them."""
        if self._raw is None:
            raw: List[Any] = []
            for emitters, row, _, _, _ in self._all_rows():
                values = emitters.values_of(row)
                if len(values) != len(emitters.names):
                    raise ValueError(f"{len(values)} values for the {len(emitters.names)} statistics {emitters.names}")
                raw += values
            self._raw = raw
        return self._raw

    @property
    def values(self) -> List[float]:
        """The value of every record as a Python float (``float(value)``), in record order (do not modify)."""
        if self._values is None:
            raw = self._raw_values()
            self._values = raw if set(map(type, raw)) <= {float} else list(map(float, raw))
        return self._values

    @property
    def iteration(self) -> Any:
        """The iteration of every record, or None when they differ (or the batch is empty)."""
        if self._iteration is _UNSET:
            try:
                iterations = {row[2] for row in self._all_rows() if row[0].names}
            except TypeError:  # an unhashable iteration: treated as mixed
                iterations = set()
            self._iteration = iterations.pop() if len(iterations) == 1 else None
        return self._iteration

    @property
    def layout(self) -> Tuple[Any, ...]:
        """The emitters, layer and tensor objects of every row, flattened (see `same_layout`)."""
        if self._layout is None:
            self._layout = tuple(chain.from_iterable(self.row_parts()))
        return self._layout

    def same_layout(self, layout: Optional[Tuple[Any, ...]]) -> bool:
        """True when `layout` (another batch's `layout`) holds the same objects as this batch's, so both batches have
        the same sequence of (name, layer, tensor, stat)."""
        mine = self.layout
        if layout is mine:
            return True
        return layout is not None and len(layout) == len(mine) and all(map(is_, layout, mine))

    def row_parts(self) -> List[Tuple[Emitters, Any, Any]]:
        """``(emitters, layer, tensor)`` of every row: the layout (what a writer process receives as plain data,
        `tedebug.sinks.process_wire`)."""
        if self._packed is not None:
            return list(self._packed[0])
        return [(emitters, layer, tensor) for emitters, _, _, layer, tensor in self._all_rows()]

    def merged_rows(self) -> List[Any]:
        """The row of every buffer, as given (what each `Emitters.values_of` takes)."""
        return [row[1] for row in self._all_rows()]

    def row_iterations(self) -> List[Any]:
        """The iteration of every row, in order."""
        if self._packed is not None:
            return [self._packed[2]] * len(self._packed[0])
        return [row[2] for row in self._all_rows()]

    def name_parts(self) -> List[Tuple[Any, Any, Any, Any]]:
        """``(name, layer, tensor, stat)`` of every record, in order (what a sink makes its cached line pieces of)."""
        parts: List[Tuple[Any, Any, Any, Any]] = []
        for emitters, _, _, layer, tensor in self._all_rows():
            parts.extend([(name, layer, tensor, stat) for name, stat in emitters.names])
        return parts


class DeferredBatch:
    """A step's statistics whose final formulas have not run yet: `log_deferred` calls it for the evaluated
    `ScalarBatch` (a formula's error is then the build's, not the first sink's); `batch()` is the same batch not
    evaluated, for a writer that evaluates elsewhere (the writer process evaluates the formulas it receives)."""

    __slots__ = ("rows", "layout", "iteration", "packed")

    def __init__(
        self,
        rows: Iterable[BatchRow],
        layout: Optional[Tuple[Any, ...]] = None,
        iteration: Any = _UNSET,
        packed: Optional[Tuple[Sequence[Tuple[Emitters, Any, Any]], Any, Any]] = None,
    ) -> None:
        """`packed`: ``(parts, array, row_iteration)`` of `ScalarBatch.from_packed` instead of `rows` (then empty)."""
        self.rows = rows
        self.layout = layout  # (`ScalarBatch`'s optional arguments, passed on)
        self.iteration = iteration
        self.packed = packed

    def batch(self) -> ScalarBatch:
        if self.packed is not None:
            return ScalarBatch.from_packed(*self.packed, self.layout, self.iteration)
        return ScalarBatch(self.rows, self.layout, self.iteration)

    def __call__(self) -> ScalarBatch:
        return self.batch().evaluate()
