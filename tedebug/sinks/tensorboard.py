"""`TensorBoardSink`: statistics as TensorBoard scalars, grouped per layer, with a cross-layer chart layout.

Tag styles:

* ``"hierarchical"`` (default): tag ``<layer>/<tensor>/<stat>``, so TensorBoard groups one layer's charts
  together; in addition a custom-scalars layout (the "Custom Scalars" tab) has one category per tensor and one
  multi-line chart per (tensor, stat) whose regex matches that statistic across all layers.  Use it for
  interactive exploration.
  Charts hold at most `MAX_LINES_PER_CHART` (16) layers: the layers of one (tensor, stat) are grouped by layer type
  (`layer_type`: the last name component, ``qkv``, ``proj``, ``fc1``, ``fc2``) and a type with more
  layers is cut into consecutive runs of 16 (block ranges), each its own chart named after its first and last
  layer; one chart's lines stay distinguishable by colour.  The first chart of each (tensor, stat) is its
  cross-layer summary (below).
* ``"flat"``: TransformerEngine's tag ``<layer>_<tensor>_<stat>`` (the same string as the text stats file).  Use
  it when dashboards or scripts already parse TransformerEngine's tags.

Cross-layer summaries (``summaries=True``, the default for the hierarchical style): for each (tensor, stat) and
each iteration, ``summary/<tensor>/<stat>/max``, ``.../p90`` (90th percentile over layers, linear interpolation)
and ``.../median`` scalars, and a text ``summary/<tensor>/<stat>/argmax`` naming the layer with the max and its
value (TEXT tab).  A non-finite value counts as the max (its layer is named).  They are written at `flush()` from
the statistics of the step, so the worst layer is visible without opening every layer's chart (TensorBoard's
default "ignore outliers in chart scaling" hides exactly that line in a chart of all layers).

User scalars: `log_user_scalar(tag, value, iteration)` writes a scalar of the training script (the loss, the
learning rate) through the same writer, under its own tag, and adds a chart for it to a "user" category at the
top of the custom-scalars layout, next to the statistics.  It is safe to call from the training thread while the
background writer writes statistics (torch's ``SummaryWriter`` queue is locked; the layout state has a lock).

A scalar logged without the structured keywords (layer / tensor / stat None) is written under its flat name.  The
layout is rewritten (whole) at `flush()` when new (tensor, stat) pairs appeared since the last write — at most
once per step, as `debug_api.step()` flushes once — and at `close()`.  NaN and Inf values are written as they are
(TensorBoard displays them).

Batches (`log_scalars`, one step's statistics): with a torch ``SummaryWriter`` the scalars of one iteration are
written as *one* event whose summary holds one value per scalar (``simple_value``, float32, exactly what
``add_scalar`` stores), instead of one event per scalar: readers (TensorBoard, ``EventAccumulator``) decode the same
(tag, step, value) series, and the writer's bounded event queue no longer makes the caller wait for its thread
once per scalar (about 40 µs each on CPU).  Other writer objects receive one ``add_scalar`` call per scalar.  A
one-iteration `ScalarBatch` (a step of tedebug's statistics) takes no Python work per record: per batch layout the
sink works out once the summary's wire bytes with a 4-byte hole per value, its charts and its summary groups
(`_BatchWire`), and each step fills the holes with the values (the same bytes as the per-record path).

Checksums: the sink makes TensorBoard's record writer use a C CRC-32C (`tedebug.sinks.tb_crc`; the pure-Python one
costs about 25 ms per step of statistics); the event files are byte-identical.

Thread safety (`thread_safe`, for the background writer of `tedebug.sinks.base.MetricLogger`): True when the sink
owns its writer or the writer is a torch ``SummaryWriter`` (whose event queue is locked); a user-supplied writer of
any other type is called in the caller's thread.

The writer process (``background_logging="process"``, the default): a sink given `log_dir` owns its writer, a
torch-free `tedebug.sinks.tb_events.EventWriter` (the same events as a ``SummaryWriter``), so the statistics writer
process writes it whole (`writer_process_spec`): the statistics, the summaries, the layout, and the user scalars,
which `log_user_scalar` on this object then queues for that process (they reach the file with the next step's
statistics, or at `end_debug()`).  One event file per run, written by one process.  A sink wrapping a given writer
stays in the training process.
"""

from __future__ import annotations

import operator
import re
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tedebug.sinks.base import Record, Sink
from tedebug.sinks.batch import ScalarBatch
from tedebug.sinks.tb_crc import use_fast_crc
from tedebug.sinks.tb_events import EventWriter

TAG_STYLES = ("hierarchical", "flat")
MAX_LINES_PER_CHART = 16
SUMMARY_PREFIX = "summary"
SUMMARY_PERCENTILE = 90
USER_CATEGORY = "user"


def hierarchical_tag(layer: str, tensor: str, stat: str) -> str:
    """``<layer>/<tensor>/<stat>``."""
    return f"{layer}/{tensor}/{stat}"


def torch_summary_writer(writer: Any) -> bool:
    """True when `writer` is a ``torch.utils.tensorboard.SummaryWriter`` (without importing tensorboard)."""
    module = sys.modules.get("torch.utils.tensorboard.writer")
    return module is not None and isinstance(writer, module.SummaryWriter)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _value_prefix(tag: str) -> bytes:
    """Wire bytes of ``Summary.value`` (field 1) holding ``Summary.Value(tag=tag, simple_value=...)`` up to the 4
    bytes of the float: field 1 (tag, length-delimited), then the key of field 2 (simple_value, fixed32)."""
    encoded = tag.encode("utf-8")
    body = b"\x0a" + _varint(len(encoded)) + encoded + b"\x15"
    return b"\x0a" + _varint(len(body) + 4) + body


def stat_regex(tensor: str, stat: str, layers: Optional[Sequence[str]] = None) -> str:
    """A regex matching the hierarchical tag of (`tensor`, `stat`) for every layer, or for `layers` only."""
    if layers is None:
        return f".*/{re.escape(tensor)}/{re.escape(stat)}$"
    return f"^(?:{'|'.join(map(re.escape, layers))})/{re.escape(tensor)}/{re.escape(stat)}$"


def summary_regex(tensor: str, stat: str) -> str:
    """A regex matching the summary scalars (max, p90, median) of (`tensor`, `stat`)."""
    return f"^{SUMMARY_PREFIX}/{re.escape(tensor)}/{re.escape(stat)}/(?:max|p{SUMMARY_PERCENTILE}|median)$"


def layer_type(layer: str) -> str:
    """The type of a layer for chart grouping: its last dotted component (``blocks.3.mlp.fc1`` -> ``fc1``,
    ``model.layers.7.self_attn.q_proj`` -> ``q_proj``); ``Layer`` for TransformerEngine's default names
    ``Layer_<n>``; the last two components when the last is a number (``blocks.3.mlp.0`` -> ``mlp.0``)."""
    if re.fullmatch(r"Layer_\d+", layer):
        return "Layer"
    parts = layer.split(".")
    if parts[-1].isdigit() and len(parts) > 1:
        return f"{parts[-2]}.{parts[-1]}"
    return parts[-1]


def chart_groups(layers: Sequence[str], max_lines: int = MAX_LINES_PER_CHART) -> List[Tuple[str, List[str]]]:
    """(label, layers) of the charts of one (tensor, stat): by `layer_type` in first-seen order, each type cut into
    runs of at most `max_lines` layers (label ``<type> <first>..<last>`` when a type needs several charts)."""
    by_type: Dict[str, List[str]] = {}
    for layer in layers:
        by_type.setdefault(layer_type(layer), []).append(layer)
    groups = []
    for kind, members in by_type.items():
        if len(members) <= max_lines:
            groups.append((kind, members))
            continue
        for start in range(0, len(members), max_lines):
            chunk = members[start : start + max_lines]
            groups.append((f"{kind} {chunk[0]}..{chunk[-1]}", chunk))
    return groups


def cross_layer_summary(layers: Sequence[str], values: Sequence[float]) -> Tuple[float, float, float, str, float]:
    """(max, p90, median, argmax layer, its value) of one statistic over layers; a non-finite value is the max."""
    array = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(array)
    worst = int(np.flatnonzero(~finite)[0]) if not finite.all() else int(np.argmax(array))
    kept = array[finite]
    p_high = float(np.percentile(kept, SUMMARY_PERCENTILE)) if kept.size else float("nan")
    median = float(np.median(kept)) if kept.size else float("nan")
    return float(array[worst]), p_high, median, layers[worst], float(array[worst])


class _BatchWire:
    """What `TensorBoardSink` writes for every `ScalarBatch` of one layout, worked out once: the wire bytes of the
    ``Summary`` with a 4-byte hole per value (each value's tag prefix, `_value_prefix`), where the values go, and the
    (tensor, stat) groups of the cross-layer summaries with their layers and value positions.  `summary(values)` is
    the ``Summary`` `TensorBoardSink._summary` builds from the same tags and values, byte for byte."""

    def __init__(self, tags: List[str], parts: List[Tuple[str, str, str, str]], prefixes: Dict[str, bytes]) -> None:
        self.template, self.holes = _wire_template(tags, prefixes)
        by_group: Dict[Tuple[str, str], Tuple[List[str], List[int]]] = {}
        for index, (_, layer, tensor, stat) in enumerate(parts):
            layers, positions = by_group.setdefault((tensor, stat), ([], []))
            layers.append(layer)
            positions.append(index)
        self.groups = [
            (tensor, stat, tuple(layers), _picker(positions))
            for (tensor, stat), (layers, positions) in by_group.items()
        ]

    def summary(self, values: Sequence[float]) -> Any:
        return _filled_summary(self.template, self.holes, values)


def _wire_template(tags: Sequence[str], prefixes: Dict[str, bytes]) -> Tuple[np.ndarray, np.ndarray]:
    """The wire bytes of ``Summary(value=[Summary.Value(tag=t, simple_value=...) for t in tags])`` with 4 zero bytes
    where each float goes (each tag's prefix, `_value_prefix`, cached in `prefixes`), and the byte positions of
    those holes, 4 per value, in value order."""
    pieces: List[bytes] = []
    holes: List[int] = []
    offset = 0
    for tag in tags:
        prefix = prefixes.get(tag)
        if prefix is None:
            prefix = prefixes[tag] = _value_prefix(tag)
        pieces.append(prefix)
        pieces.append(b"\0\0\0\0")
        offset += len(prefix)
        holes.append(offset)
        offset += 4
    template = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    return template, (np.asarray(holes, dtype=np.int64)[:, None] + np.arange(4)).reshape(-1)


def _filled_summary(template: np.ndarray, holes: np.ndarray, values: Sequence[float]) -> Any:
    """The ``Summary`` of a `_wire_template` with `values` in its holes: each the little-endian float32 of the
    double (numpy's rounding, as the protobuf setter's; overflow gives inf)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    with np.errstate(over="ignore"):
        raw = np.asarray(values, dtype=np.float64).astype("<f4")
    wire = template.copy()
    wire[holes] = raw.view(np.uint8)
    return Summary.FromString(wire.tobytes())


def _picker(positions: List[int]) -> Any:
    """A function taking the values at `positions` from a sequence, as a tuple."""
    if len(positions) == 1:
        only = positions[0]
        return lambda values: (values[only],)
    return operator.itemgetter(*positions)


class TensorBoardSink(Sink):
    """Writes each statistic with `SummaryWriter.add_scalar`; see the module docstring for tags and layout."""

    def __init__(
        self,
        writer: Any = None,
        log_dir: Optional[str] = None,
        *,
        tag_style: str = "hierarchical",
        summaries: Optional[bool] = None,
    ):
        if tag_style not in TAG_STYLES:
            raise ValueError(f"TensorBoardSink: tag_style must be one of {TAG_STYLES}, got {tag_style!r}")
        if (writer is None) == (log_dir is None):
            raise ValueError("TensorBoardSink: give exactly one of `writer` (a SummaryWriter) or `log_dir`")
        use_fast_crc()
        #: a sink given `log_dir` owns its writer: a torch-free event writer (`tedebug.sinks.tb_events`), which the
        #: statistics writer process can own too
        self.writer: Any = writer if writer is not None else EventWriter(log_dir)  # type: ignore[arg-type]
        self._owns_writer = log_dir is not None
        self._batched = self._owns_writer or torch_summary_writer(writer)
        self.thread_safe = self._batched
        self.tag_style = tag_style
        self._charts: Dict[str, Dict[str, List[str]]] = {}  # tensor -> stat -> layers, in first-seen order
        self._user_tags: List[str] = []
        self._layout_dirty = False
        self._layout_lock = threading.Lock()
        self.summaries = tag_style == "hierarchical" if summaries is None else bool(summaries)
        self._step_values: Dict[tuple, Tuple[List[str], List[float]]] = {}  # (iteration, tensor, stat) -> layers
        self._value_prefixes: Dict[str, bytes] = {}  # tag -> wire bytes of a Summary.Value up to its float
        #: the `_BatchWire` of the last `ScalarBatch` layout (None: that layout has a name that is not a str)
        self._wire: Optional[_BatchWire] = None
        self._wire_layout: Optional[tuple] = None
        #: True once the writer process writes this sink's twin: `log_user_scalar` then queues its scalars for it
        #: (`writer_process_notes`) and this object writes nothing itself
        self._twin_elsewhere = False
        self._user_scalars: List[Tuple[str, float, int]] = []  # queued for the twin, in call order

    @property
    def path(self) -> Optional[str]:
        """The directory the event file is written to (named in error reports), when known."""
        log_dir = getattr(self.writer, "log_dir", None)
        return log_dir if isinstance(log_dir, str) else None

    def writer_process_spec(self) -> Optional[Tuple[str, str, dict]]:
        """A sink that owns its writer is written by the writer process (the same directory, the twin's own event
        file); one wrapping a given writer (``tb_writer``, a user's ``SummaryWriter``) stays in this process: that
        writer is the training script's, and two event files of one run being written at once is what
        TensorBoard's live reload follows least well."""
        if type(self) is not TensorBoardSink or not self._owns_writer:
            return None
        kwargs = {"log_dir": self.writer.log_dir, "tag_style": self.tag_style, "summaries": self.summaries}
        return (__name__, "TensorBoardSink", kwargs)

    def handed_to_writer_process(self) -> None:
        self._twin_elsewhere = True

    def writer_process_notes(self) -> List[Tuple[str, float, int]]:
        """The user scalars logged since the last call, for the twin (`apply_writer_process_notes`)."""
        queued, self._user_scalars = self._user_scalars, []
        return queued

    def apply_writer_process_notes(self, notes: Sequence[Tuple[str, float, int]]) -> None:
        for tag, value, iteration in notes:
            self.log_user_scalar(tag, value, iteration)

    def tag_for(self, name: str, *, layer: Optional[str], tensor: Optional[str], stat: Optional[str]) -> str:
        """The TensorBoard tag of one scalar."""
        if self.tag_style == "flat" or layer is None or tensor is None or stat is None:
            return name
        return hierarchical_tag(layer, tensor, stat)

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
        tag = self.tag_for(name, layer=layer, tensor=tensor, stat=stat)
        self.writer.add_scalar(tag, float(value), iteration)
        if tag != name:
            self._note_chart(tensor, stat, layer)  # type: ignore[arg-type]  # a tag of its own: all three are set
        if self.summaries and layer is not None and tensor is not None and stat is not None:
            self._note_values(iteration, tensor, stat, (layer,), (float(value),))

    def log_user_scalar(self, tag: str, value: Any, iteration: int) -> None:
        """A scalar of the training script (e.g. ``"train/loss"``) under `tag`, charted in the layout's "user"
        category; see the module docstring."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"TensorBoardSink.log_user_scalar: tag must be a non-empty str, got {tag!r}")
        if self._twin_elsewhere:  # written by the twin in the writer process, with the next step's statistics
            self._user_scalars.append((tag, float(value), int(iteration)))
            return
        self.writer.add_scalar(tag, float(value), int(iteration))
        with self._layout_lock:
            if tag not in self._user_tags:
                self._user_tags.append(tag)
                self._layout_dirty = True

    def log_scalars(self, records: Sequence[Record]) -> None:
        """One event per run of records with the same iteration (torch ``SummaryWriter``; see the module docstring),
        else one ``add_scalar`` per record."""
        if not self._batched:
            super().log_scalars(records)
            return
        if type(records) is ScalarBatch and records.iteration is not None:
            wire = self._wire_for(records)
            if wire is not None:  # one step of tedebug's statistics: no Python work per record
                step_values = records.values
                self._file_writer().add_summary(wire.summary(step_values), records.iteration)
                if self.summaries:
                    for group_tensor, group_stat, layers, pick in wire.groups:
                        self._note_values(records.iteration, group_tensor, group_stat, layers, pick(step_values))
                return
        file_writer = self._file_writer()
        summaries = self.summaries
        tags: List[str] = []
        values: List[float] = []
        run_iteration = None
        for name, value, iteration, layer, tensor, stat in records:
            if iteration != run_iteration and tags:
                file_writer.add_summary(self._summary(tags, values), run_iteration)
                tags, values = [], []
            run_iteration = iteration
            tag = self.tag_for(name, layer=layer, tensor=tensor, stat=stat)
            tags.append(tag)
            values.append(float(value))
            if tag != name:
                self._note_chart(tensor, stat, layer)  # type: ignore[arg-type]  # a tag of its own: all three are set
            if summaries and layer is not None and tensor is not None and stat is not None:
                self._note_values(iteration, tensor, stat, (layer,), values[-1:])
        if tags:
            file_writer.add_summary(self._summary(tags, values), run_iteration)

    def _wire_for(self, batch: ScalarBatch) -> Optional["_BatchWire"]:
        """The `_BatchWire` of `batch`'s layout (made again when the layout changed: its charts are noted then);
        None when a record's name, layer, tensor or statistic is not a plain str."""
        if not batch.same_layout(self._wire_layout):
            parts = batch.name_parts()
            self._wire = None
            self._wire_layout = batch.layout
            if all(type(part) is str for record in parts for part in record):
                tags = [
                    self.tag_for(name, layer=layer, tensor=tensor, stat=stat) for name, layer, tensor, stat in parts
                ]
                for tag, (name, layer, tensor, stat) in zip(tags, parts):
                    if tag != name:
                        self._note_chart(tensor, stat, layer)
                self._wire = _BatchWire(tags, parts, self._value_prefixes)
        return self._wire

    def _note_values(self, iteration: int, tensor: str, stat: str, layers: Sequence[str], values: Sequence[float]):
        """Keep `values` (floats) of `layers` for the cross-layer summaries of (iteration, tensor, stat)."""
        noted_layers, noted_values = self._step_values.setdefault((iteration, tensor, stat), ([], []))
        noted_layers.extend(layers)
        noted_values.extend(values)

    def _file_writer(self) -> Any:
        """What `add_summary` is called on: the own writer, or what a ``SummaryWriter``'s add_scalar writes through
        (reopened after a close)."""
        return self.writer if self._owns_writer else self.writer._get_file_writer()

    def _summary(self, tags: List[str], values: List[float]) -> Any:
        """``Summary(value=[Summary.Value(tag=t, simple_value=v), ...])``, parsed from its wire bytes (`_wire_template`
        filled by `_filled_summary`), which costs a fraction of building one message object per value."""
        return _filled_summary(*_wire_template(tags, self._value_prefixes), values)

    def _note_chart(self, tensor: str, stat: str, layer: str) -> None:
        layers = self._charts.setdefault(tensor, {}).setdefault(stat, [])
        if layer not in layers:
            with self._layout_lock:
                layers.append(layer)
                self._layout_dirty = True

    def layout(self) -> Dict[str, Dict[str, list]]:
        """The custom-scalars layout: a "user" category with one chart per user scalar (when any), then per tensor
        {"<tensor>/<stat> summary": [...], "<tensor>/<stat> <group>": ["Multiline", [regex]], ...}: the summary
        chart (with summaries on) and one chart per `chart_groups` group of at most 16 layers."""
        with self._layout_lock:
            user = list(self._user_tags)
            charts = {
                tensor: {stat: list(layers) for stat, layers in stats.items()} for tensor, stats in self._charts.items()
            }
        layout: Dict[str, Dict[str, list]] = {}
        if user:
            layout[USER_CATEGORY] = {tag: ["Multiline", [f"^{re.escape(tag)}$"]] for tag in user}
        for tensor, stats in charts.items():
            category: Dict[str, list] = {}
            for stat, layers in stats.items():
                if self.summaries:
                    category[f"{tensor}/{stat} summary (max, p{SUMMARY_PERCENTILE}, median over layers)"] = [
                        "Multiline",
                        [summary_regex(tensor, stat)],
                    ]
                groups = chart_groups(layers)
                if len(groups) == 1:  # every layer on one chart: the regex of any layer
                    category[f"{tensor}/{stat}"] = ["Multiline", [stat_regex(tensor, stat)]]
                    continue
                for label, members in groups:
                    category[f"{tensor}/{stat} {label}"] = ["Multiline", [stat_regex(tensor, stat, members)]]
            layout[tensor] = category
        return layout

    def _write_layout(self) -> None:
        if self._layout_dirty:
            self._layout_dirty = False
            self.writer.add_custom_scalars(self.layout())

    def _write_summaries(self) -> None:
        """The cross-layer summary scalars and argmax texts of the values noted since the last flush."""
        if not self._step_values:
            return
        pending, self._step_values = self._step_values, {}
        by_iteration: Dict[int, Tuple[List[str], List[float]]] = {}
        add_text = getattr(self.writer, "add_text", None)
        for (iteration, tensor, stat), (layers, values) in pending.items():
            high, p_high, median, worst, worst_value = cross_layer_summary(layers, values)
            base = f"{SUMMARY_PREFIX}/{tensor}/{stat}"
            tags, numbers = by_iteration.setdefault(iteration, ([], []))
            tags.extend((f"{base}/max", f"{base}/p{SUMMARY_PERCENTILE}", f"{base}/median"))
            numbers.extend((high, p_high, median))
            if callable(add_text):
                add_text(f"{base}/argmax", f"{worst} ({worst_value:.6g})", iteration)
        for iteration, (tags, numbers) in by_iteration.items():
            if self._batched:
                self._file_writer().add_summary(self._summary(tags, numbers), iteration)
            else:
                for tag, number in zip(tags, numbers):
                    self.writer.add_scalar(tag, number, iteration)

    def flush(self) -> None:
        if self._twin_elsewhere:
            return
        self._write_summaries()
        self._write_layout()
        self.writer.flush()

    def close(self) -> None:
        if self._twin_elsewhere:
            self._twin_elsewhere = False  # (a later session that is given this sink decides anew)
            self.writer.close()  # (written before the hand-over, if anything was)
            return
        self._write_summaries()
        self._write_layout()
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()
