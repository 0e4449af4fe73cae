"""`JsonlSink`: one JSON object per statistic, one object per line, for offline analysis (pandas, jq, DuckDB).

Record: ``{"iteration", "name", "layer", "tensor", "stat", "value"}`` (layer / tensor / stat are null for scalars
logged without the structured keywords).  The output is strict JSON: a NaN or ±Inf value is written as
``"value": null`` plus ``"nonfinite": "nan" | "inf" | "-inf"``.  Records are buffered in memory and written at
`flush()` (every `debug_api.step()`) and `close()`, all lines of a flush in one `RecordFile` write (whole lines only,
even when the disk fills up).  The file is truncated when the sink is created unless ``append=True``; missing parent
directories are created.

Each line is exactly ``json.dumps(make_record(...), allow_nan=False)``; the encoded ``name`` / ``layer`` /
``tensor`` / ``stat`` part of a line is cached per sink (statistic names repeat every step), so only the iteration
and the value are encoded per scalar.  A `tedebug.sinks.batch.ScalarBatch` of one iteration whose name parts are all
plain strings (a step of `StatsEngine`) is encoded at once: the line pieces holding its names are cached per layout
and joined with the iteration's opening and the values' reprs (the same bytes; ``%``-formatting a template of the
whole batch costs more, the literal text being scanned character by character).

The values of such a batch are written by `value_texts`: Python's ``repr`` of each float (what ``json.dumps``
writes), taken from one ``orjson.dumps`` of the whole column when the optional `orjson` package is installed
(``pip install tedebug[fast]``; its shortest round-trip digits equal ``repr``'s, about 15 times faster), except
where the two spell a value differently (a magnitude below 1e-4, where ``repr`` switches to an exponent earlier;
NaN and infinities), which are written by ``repr`` as before.
"""

from __future__ import annotations

import json
import math
import operator
import os
from itertools import chain, compress, count
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tedebug.sinks.base import Record, Sink
from tedebug.sinks.batch import ScalarBatch
from tedebug.sinks.record_file import RecordFile

_orjson: Optional[ModuleType]
try:  # optional (the `fast` extra): the batch's value texts in one call
    import orjson as _orjson
except ImportError:  # pragma: no cover - the test extra installs it; `value_texts` falls back to repr
    _orjson = None


def nonfinite_label(value: float) -> Optional[str]:
    """``"nan"``, ``"inf"``, ``"-inf"`` for non-finite values, None for finite ones."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return None


def make_record(
    name: str, value: Any, iteration: int, *, layer: Optional[str], tensor: Optional[str], stat: Optional[str]
) -> Dict[str, Any]:
    """The JSON object of one scalar."""
    value = float(value)
    label = nonfinite_label(value)
    record: Dict[str, Any] = {
        "iteration": int(iteration),
        "name": name,
        "layer": layer,
        "tensor": tensor,
        "stat": stat,
        "value": None if label else value,
    }
    if label:
        record["nonfinite"] = label
    return record


#: what follows ``"value": `` in the line of a non-finite value, by its label (`nonfinite_label`, also its repr)
_NONFINITE_TEXT = {label: f'null, "nonfinite": "{label}"' for label in ("nan", "inf", "-inf")}


#: magnitudes at which Python's ``repr`` and orjson write the same text: from here on both use positional
#: notation up to 1e16 and the same ``e+NN`` form above; below it ``repr`` writes ``1e-05`` where orjson writes
#: ``0.00001`` (and ``1e-09`` where it writes ``1e-9``)
_SAME_TEXT_FROM = 1e-4
_FLOAT64_MAX = float(np.finfo(np.float64).max)
#: below this many values one ``repr`` per value costs less than the column call and its check
_COLUMN_MIN = 16


def value_texts(values: List[float]) -> List[str]:
    """The text following ``"value": `` in the JSON line of each value (floats): ``repr(value)``, as ``json.dumps``
    writes a float, or for NaN / ±Inf the ``null, "nonfinite": ...`` text of `make_record`'s record."""
    if _orjson is not None and len(values) >= _COLUMN_MIN:
        texts = _orjson.dumps(values).decode()[1:-1].split(",")
        column = np.array(values, dtype=np.float64)
        magnitudes = np.abs(column)
        # written by repr: non-zero magnitudes below `_SAME_TEXT_FROM`, NaN (every comparison False) and infinities
        differ = ~((magnitudes >= _SAME_TEXT_FROM) & (magnitudes <= _FLOAT64_MAX)) & (column != 0)
        redo = np.flatnonzero(differ).tolist()
    else:
        texts = list(map(repr, values))
        redo = (
            []
            if all(map(math.isfinite, values))
            else list(compress(count(), map(operator.not_, map(math.isfinite, values))))
        )
    for i in redo:
        text = repr(values[i])
        texts[i] = _NONFINITE_TEXT.get(text, text)  # repr of NaN / ±Inf: "nan", "inf", "-inf"
    return texts


def _names_part(name: Any, layer: Any, tensor: Any, stat: Any) -> str:
    """The ``"name": ..., "layer": ..., "tensor": ..., "stat": ...`` part of a record line, as `json.dumps` writes
    it."""
    return ", ".join(
        f"{json.dumps(k)}: {json.dumps(v, allow_nan=False)}"
        for k, v in (("name", name), ("layer", layer), ("tensor", tensor), ("stat", stat))
    )


class JsonlSink(Sink):
    """Appends one JSON line per statistic to `path` (written at flush / close)."""

    thread_safe = True  # only the background writer calls it (see tedebug.sinks.base)

    def __init__(self, path: str, *, append: bool = False) -> None:
        self.path = os.fspath(path)
        self._file = RecordFile(self.path, append=append)
        self._pending: List[str] = []
        self._encoded_names: Dict[tuple, str] = {}
        #: the same cache for names, layers, tensors and stats that are all exactly `str` (a str key equals only
        #: str keys, so the plain tuple is an exact key)
        self._str_names: Dict[tuple, str] = {}
        #: the layout of the last `ScalarBatch` encoded and its lines' name pieces (None: a name part is not a str)
        self._batch_layout: Optional[tuple] = None
        self._batch_names: Optional[List[str]] = None

    def writer_process_spec(self) -> Optional[Tuple[str, str, dict]]:
        if type(self) is not JsonlSink:  # a subclass may write differently: it stays in this process
            return None
        return (__name__, "JsonlSink", {"path": os.path.abspath(self.path), "append": True})

    def log_scalar(
        self,
        name: str,
        value: Any,
        iteration: int,
        *,
        layer: Optional[str] = None,
        tensor: Optional[str] = None,
        stat: Optional[str] = None,
    ) -> None:
        self._pending.append(self._line(name, value, iteration, layer, tensor, stat))

    def log_scalars(self, records: Sequence[Record]) -> None:
        """`_line` of every record; records whose names are all plain strings (the statistics every step) and whose
        value is finite take the cached-names line directly; a one-iteration `ScalarBatch` whose names are all plain
        strings is encoded all at once (`_batch_text`)."""
        line, str_names, isfinite = self._line, self._str_names, math.isfinite
        pending = self._pending
        if type(records) is ScalarBatch and records.iteration is not None:
            names = self._names_for(records)
            if names is not None:
                pending.append(self._batch_text(names, records))
                return
        heads: Dict[Any, str] = {}  # iteration -> the line's opening (equal iterations: equal text)
        for record in records:
            name, value, iteration, layer, tensor, stat = record
            cached = str_names.get((name, layer, tensor, stat))
            if cached is not None:
                value = float(value)
                if isfinite(value):
                    head = heads.get(iteration)
                    if head is None:
                        head = heads[iteration] = f'{{"iteration": {int(iteration)!r}, '
                    pending.append(f'{head}{cached}, "value": {value!r}}}')
                    continue
            pending.append(line(*record))

    def _names_for(self, batch: ScalarBatch) -> Optional[List[str]]:
        """The name piece ``<names part>, "value": `` of every line of `batch` (made when the layout changed); None
        when a name part is not a plain str."""
        if not batch.same_layout(self._batch_layout):
            parts = batch.name_parts()
            self._batch_names = None
            if all(type(p) is str for p in chain.from_iterable(parts)):
                str_names = self._str_names
                pieces = []
                for key in parts:
                    names = str_names.get(key)
                    if names is None:
                        names = str_names[key] = _names_part(*key)
                    pieces.append(f'{names}, "value": ')
                self._batch_names = pieces
            self._batch_layout = batch.layout
        return self._batch_names

    @staticmethod
    def _batch_text(names: List[str], batch: ScalarBatch) -> str:
        """The lines of a one-iteration `batch` (`names`: its `_names_for`), ``"\\n"``-joined as `flush` joins."""
        values = batch.values
        texts = value_texts(values)
        parts: List[Any] = [f'{{"iteration": {int(batch.iteration)!r}, ', None, None, "}\n"] * len(values)
        parts[1::4] = names
        parts[2::4] = texts
        parts[-1] = "}"
        return "".join(parts)

    def _line(self, name: Any, value: Any, iteration: Any, layer: Any, tensor: Any, stat: Any) -> str:
        """``json.dumps(make_record(...), allow_nan=False)``, with the name part cached per distinct names."""
        value = float(value)
        iteration = int(iteration)
        key: Optional[tuple]  # None: a name part is unhashable
        key = (type(name), name, type(layer), layer, type(tensor), tensor, type(stat), stat)
        try:
            names = self._encoded_names.get(key)
        except TypeError:  # unhashable name parts: the plain encoder
            names = key = None
        if names is None:
            line = json.dumps(
                make_record(name, value, iteration, layer=layer, tensor=tensor, stat=stat), allow_nan=False
            )
            if key is not None:
                names = self._encoded_names[key] = _names_part(name, layer, tensor, stat)
                if type(name) is str and type(layer) is str and type(tensor) is str and type(stat) is str:
                    self._str_names[(name, layer, tensor, stat)] = names
            return line
        label = nonfinite_label(value)
        if label is None:
            return f'{{"iteration": {iteration!r}, {names}, "value": {value!r}}}'
        return f'{{"iteration": {iteration!r}, {names}, "value": null, "nonfinite": "{label}"}}'

    def flush(self) -> None:
        if self._file.closed:
            raise ValueError(f"JsonlSink({self.path!r}) is closed")
        if self._pending:
            text = "\n".join(self._pending) + "\n"
            self._pending.clear()  # a batch that cannot be written is dropped, never written twice or in part
            self._file.write(text)

    def close(self) -> None:
        if self._file.closed:
            return
        self.flush()
        self._file.close()
