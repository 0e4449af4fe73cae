"""tedebug.sinks: where statistics go. `MetricLogger` fans each scalar out to the session's sinks.

Sinks: `text.TextStatsSink` (nvdlfw-compatible stats file), `tensorboard.TensorBoardSink`, `jsonl.JsonlSink`, or any
object with ``log_scalar(name, value, iteration)``.
"""

from tedebug.sinks.base import MetricLogger, Sink, check_sink

__all__ = ["MetricLogger", "Sink", "check_sink"]
