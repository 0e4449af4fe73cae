"""tedebug.sinks: where statistics go. `MetricLogger` fans each scalar out to the session's sinks.

Sinks: `text.TextStatsSink` (nvdlfw-compatible stats file), `tensorboard.TensorBoardSink`, `jsonl.JsonlSink`, or any
object with ``log_scalar(name, value, iteration)``.
`background.BackgroundWriter` writes thread-safe sinks off the caller's thread (`MetricLogger(background=True)`).
"""

from tedebug.sinks.base import BackgroundSinkError, MetricLogger, Sink, check_sink

__all__ = ["BackgroundSinkError", "MetricLogger", "Sink", "check_sink"]
