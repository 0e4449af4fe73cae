"""Reading TensorBoard event files back in tests: tensorboard's EventAccumulator, scalars by tag, and the
custom-scalars layouts a run wrote."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

LAYOUT_TAG = "custom_scalars__config__"


def load(log_dir):
    """An EventAccumulator of `log_dir`, loaded."""
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return acc


def scalars(acc):
    """{tag: [(step, value), ...]} of every scalar tag."""
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def layouts(acc):
    """The custom-scalars layouts written to the run (none: [])."""
    if LAYOUT_TAG not in acc.Tags()["tensors"]:
        return []
    return [layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in acc.Tensors(LAYOUT_TAG)]
