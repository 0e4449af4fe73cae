"""`EventWriter`: a TensorBoard event file written without torch, for the TensorBoard sinks that own their writer.

Why: a `TensorBoardSink(log_dir=...)` is written by tedebug's statistics writer process
(`tedebug.sinks.process_writer`), which imports the sinks and numpy but never torch (a second torch import would
cost the process about a second and several hundred MB).  So the sink's own writer is this one, built on the
tensorboard package's event file writer, the same one ``torch.utils.tensorboard.SummaryWriter`` writes through.

What it writes is what a ``SummaryWriter`` writes for the same calls, event by event (the wall times aside):

- `add_scalar(tag, value, step)`: one event whose summary holds ``Summary.Value(tag, simple_value)`` (float32);
- `add_text(tag, text, step)`: the text plugin's summary under ``<tag>/text_summary`` (a 1-element string tensor
  with the plugin's metadata), as ``SummaryWriter.add_text`` names it;
- `add_custom_scalars(layout)`: the custom-scalars plugin's layout (``custom_scalars__config__``, no step), from the
  same ``{category: {chart: ["Multiline" | "Margin", tags]}}`` dict;
- `add_summary(summary, step)`: any prepared ``Summary`` (the sink's batched scalars).

The directory is made at construction (an error there is the training script's, at set-up, as with a
``SummaryWriter``); the file at the first write (``events.out.tfevents.<time>.<host>.<pid>.<n>``, as the tensorboard
package names it), so a sink whose statistics another process writes opens no file in this one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, Optional

#: the custom-scalars plugin's tag for its layout (what TensorBoard reads the layout from)
LAYOUT_TAG = "custom_scalars__config__"
#: the suffix ``SummaryWriter.add_text`` appends to a text's tag
TEXT_SUFFIX = "/text_summary"


def scalar_summary(tag: str, value: float) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])


def text_summary(tag: str, text: str) -> Any:
    """The text plugin's summary of `text` under ``tag + TEXT_SUFFIX``."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()
        )
    )
    tensor = TensorProto(
        dtype="DT_STRING",
        string_val=[text.encode("utf_8")],
        tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
    )
    return Summary(value=[Summary.Value(tag=tag + TEXT_SUFFIX, metadata=metadata, tensor=tensor)])


def layout_summary(layout: Dict[str, Dict[str, list]]) -> Any:
    """The custom-scalars plugin's summary of `layout` (``{category: {chart: [kind, tags]}}``; kind "Margin" takes
    three tags: value, lower, upper; any other kind is a multi-line chart)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import layout_pb2

    categories = []
    for title, charts in layout.items():
        built = []
        for name, (kind, tags) in charts.items():
            if kind == "Margin":
                if len(tags) != 3:
                    raise ValueError(f"custom scalars chart {name!r}: a Margin chart takes 3 tags, got {len(tags)}")
                series = layout_pb2.MarginChartContent.Series(value=tags[0], lower=tags[1], upper=tags[2])
                built.append(layout_pb2.Chart(title=name, margin=layout_pb2.MarginChartContent(series=[series])))
            else:
                built.append(layout_pb2.Chart(title=name, multiline=layout_pb2.MultilineChartContent(tag=tags)))
        categories.append(layout_pb2.Category(title=title, chart=built))
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    tensor = TensorProto(
        dtype="DT_STRING",
        string_val=[layout_pb2.Layout(category=categories).SerializeToString()],
        tensor_shape=TensorShapeProto(),
    )
    return Summary(value=[Summary.Value(tag=LAYOUT_TAG, tensor=tensor, metadata=metadata)])


class EventWriter:
    """One event file in `log_dir` (see the module docstring); `max_queue` and `flush_secs` as ``SummaryWriter``'s."""

    def __init__(self, log_dir: str, *, max_queue: int = 10, flush_secs: int = 120) -> None:
        self.log_dir = os.fspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)  # a directory that cannot be made is an error here, at set-up
        self.max_queue = max_queue
        self.flush_secs = flush_secs
        self._file: Optional[Any] = None  # the tensorboard package's EventFileWriter, from the first write on
        self._opening = threading.Lock()  # two threads' first writes (user scalars, statistics) open one file

    def get_logdir(self) -> str:
        return self.log_dir

    def add_summary(self, summary: Any, step: Optional[int] = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        event = Event(summary=summary, wall_time=time.time())
        if step is not None:
            event.step = int(step)
        self._events().add_event(event)

    def add_scalar(self, tag: str, value: float, step: Optional[int] = None) -> None:
        self.add_summary(scalar_summary(tag, value), step)

    def add_text(self, tag: str, text: str, step: Optional[int] = None) -> None:
        self.add_summary(text_summary(tag, text), step)

    def add_custom_scalars(self, layout: Dict[str, Dict[str, list]]) -> None:
        self.add_summary(layout_summary(layout))

    def flush(self) -> None:
        file = self._file
        if file is not None:
            file.flush()

    def close(self) -> None:
        """Flush and close the file; a later write opens a new one (as a closed ``SummaryWriter`` does)."""
        with self._opening:
            file, self._file = self._file, None
        if file is not None:
            file.close()

    def _events(self) -> Any:
        file = self._file
        if file is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            with self._opening:
                if self._file is None:
                    self._file = EventFileWriter(self.log_dir, self.max_queue, self.flush_secs)
                file = self._file
        return file


__all__ = ["EventWriter", "LAYOUT_TAG", "TEXT_SUFFIX", "layout_summary", "scalar_summary", "text_summary"]
