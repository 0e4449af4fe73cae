"""`TensorBoardSink`: statistics as TensorBoard scalars, grouped per layer, with a cross-layer chart layout.

Tag styles:

* ``"hierarchical"`` (default): tag ``<layer>/<tensor>/<stat>``, so TensorBoard groups one layer's charts
  together; in addition a custom-scalars layout (the "Custom Scalars" tab) has one category per tensor and one
  multi-line chart per (tensor, stat) whose regex matches that statistic across all layers.  Use it for
  interactive exploration.
* ``"flat"``: TransformerEngine's tag ``<layer>_<tensor>_<stat>`` (the same string as the text stats file).  Use
  it when dashboards or scripts already parse TransformerEngine's tags.

A scalar logged without the structured keywords (layer / tensor / stat None) is written under its flat name.  The
layout is rewritten (whole) at `flush()` when new (tensor, stat) pairs appeared since the last write — at most
once per step, as `debug_api.step()` flushes once — and at `close()`.  NaN and Inf values are written as they are
(TensorBoard displays them).

Batches (`log_scalars`, one step's statistics): with a torch ``SummaryWriter`` the scalars of one iteration are
written as *one* event whose summary holds one value per scalar (``simple_value``, float32, exactly what
``add_scalar`` stores), instead of one event per scalar: readers (TensorBoard, ``EventAccumulator``) decode the same
(tag, step, value) series, and the writer's bounded event queue no longer makes the caller wait for its thread
once per scalar (about 40 µs each on CPU).  Other writer objects receive one ``add_scalar`` call per scalar.

Checksums: the sink makes TensorBoard's record writer use a C CRC-32C (`tedebug.sinks.tb_crc`; the pure-Python one
costs about 25 ms per step of statistics); the event files are byte-identical.

Thread safety (`thread_safe`, for the background writer of `tedebug.sinks.base.MetricLogger`): True when the sink
owns its writer or the writer is a torch ``SummaryWriter`` (whose event queue is locked); a user-supplied writer of
any other type is called in the caller's thread.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from tedebug.sinks.base import Record, Sink
from tedebug.sinks.tb_crc import use_fast_crc

TAG_STYLES = ("hierarchical", "flat")


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


def stat_regex(tensor: str, stat: str) -> str:
    """A regex matching the hierarchical tag of (`tensor`, `stat`) for every layer."""
    return f".*/{re.escape(tensor)}/{re.escape(stat)}$"


class TensorBoardSink(Sink):
    """Writes each statistic with `SummaryWriter.add_scalar`; see the module docstring for tags and layout."""

    def __init__(self, writer: Any = None, log_dir: Optional[str] = None, *, tag_style: str = "hierarchical"):
        if tag_style not in TAG_STYLES:
            raise ValueError(f"TensorBoardSink: tag_style must be one of {TAG_STYLES}, got {tag_style!r}")
        if (writer is None) == (log_dir is None):
            raise ValueError("TensorBoardSink: give exactly one of `writer` (a SummaryWriter) or `log_dir`")
        use_fast_crc()
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer
        self._owns_writer = log_dir is not None
        self._batched = torch_summary_writer(writer)  # an owned writer is one too
        self.thread_safe = self._batched
        self.tag_style = tag_style
        self._charts: Dict[str, List[str]] = {}  # tensor -> stats, in first-seen order
        self._layout_dirty = False
        self._value_prefixes: Dict[str, bytes] = {}  # tag -> wire bytes of a Summary.Value up to its float

    def tag_for(self, name: str, *, layer: Optional[str], tensor: Optional[str], stat: Optional[str]) -> str:
        """The TensorBoard tag of one scalar."""
        if self.tag_style == "flat" or layer is None or tensor is None or stat is None:
            return name
        return hierarchical_tag(layer, tensor, stat)

    def log_scalar(self, name: str, value: Any, iteration: int, *, layer: Optional[str] = None,
                   tensor: Optional[str] = None, stat: Optional[str] = None) -> None:
        tag = self.tag_for(name, layer=layer, tensor=tensor, stat=stat)
        self.writer.add_scalar(tag, float(value), iteration)
        if tag != name:
            self._note_chart(tensor, stat)

    def log_scalars(self, records: Sequence[Record]) -> None:
        """One event per run of records with the same iteration (torch ``SummaryWriter``; see the module docstring),
        else one ``add_scalar`` per record."""
        if not self._batched:
            super().log_scalars(records)
            return
        file_writer = self.writer._get_file_writer()  # what add_scalar writes through (reopened after close)
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
                self._note_chart(tensor, stat)
        if tags:
            file_writer.add_summary(self._summary(tags, values), run_iteration)

    def _summary(self, tags: List[str], values: List[float]) -> Any:
        """``Summary(value=[Summary.Value(tag=t, simple_value=v), ...])``, parsed from its wire bytes: each value is
        its tag's cached prefix plus the little-endian float32 (numpy's rounding of the double, as the protobuf
        setter's; overflow gives inf), which costs a fraction of building one message object per value."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        with np.errstate(over="ignore"):
            raw = np.asarray(values, dtype=np.float64).astype("<f4").tobytes()
        prefixes = self._value_prefixes
        parts: List[bytes] = []
        for i, tag in enumerate(tags):
            prefix = prefixes.get(tag)
            if prefix is None:
                prefix = prefixes[tag] = _value_prefix(tag)
            parts.append(prefix)
            parts.append(raw[4 * i: 4 * i + 4])
        return Summary.FromString(b"".join(parts))

    def _note_chart(self, tensor: str, stat: str) -> None:
        stats = self._charts.setdefault(tensor, [])
        if stat not in stats:
            stats.append(stat)
            self._layout_dirty = True

    def layout(self) -> Dict[str, Dict[str, list]]:
        """The custom-scalars layout: {tensor: {"<tensor>/<stat>": ["Multiline", [regex]]}}."""
        return {
            tensor: {f"{tensor}/{stat}": ["Multiline", [stat_regex(tensor, stat)]] for stat in stats}
            for tensor, stats in self._charts.items()
        }

    def _write_layout(self) -> None:
        if self._layout_dirty:
            self.writer.add_custom_scalars(self.layout())
            self._layout_dirty = False

    def flush(self) -> None:
        self._write_layout()
        self.writer.flush()

    def close(self) -> None:
        self._write_layout()
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()
