"""`tedebug.sinks.tb_events.EventWriter` against torch's ``SummaryWriter``: the same calls give the same events."""

from __future__ import annotations

import glob
import os

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch.utils.tensorboard import SummaryWriter

from tedebug.sinks.tb_events import EventWriter

LAYOUT = {
    "user": {"train/loss": ["Multiline", ["^train/loss$"]]},
    "activation": {"activation/max": ["Multiline", [".*/activation/max$"]], "band": ["Margin", ["v", "lo", "hi"]]},
}


def _write(writer):
    writer.add_scalar("a/b", 0.1, 3)  # (not exact in float32: both round it the same way)
    writer.add_scalar("a/b", float("inf"), 4)
    writer.add_text("summary/x/argmax", "layer_7 (1.5)", 4)
    writer.add_custom_scalars(LAYOUT)
    writer.close()


def _events(directory):
    (path,) = glob.glob(os.path.join(directory, "*tfevents*"))
    events = []
    for event in EventFileLoader(path).Load():
        event.wall_time = 0.0  # the one field that differs
        events.append(event.SerializeToString(deterministic=True))
    return events


def test_the_events_are_summary_writers(tmp_path):
    _write(SummaryWriter(str(tmp_path / "torch")))
    _write(EventWriter(str(tmp_path / "own")))
    ours = _events(str(tmp_path / "own"))
    assert len(ours) == 5  # the file version, two scalars, the text, the layout
    assert ours == _events(str(tmp_path / "torch"))


def test_the_directory_is_made_at_once_the_file_at_the_first_write(tmp_path):
    writer = EventWriter(str(tmp_path / "tb"))
    writer.flush()
    writer.close()
    assert (tmp_path / "tb").is_dir() and not list((tmp_path / "tb").iterdir())
    writer.add_scalar("x", 1.0, 0)
    writer.close()
    assert len(glob.glob(str(tmp_path / "tb" / "*tfevents*"))) == 1


def test_a_margin_chart_takes_three_tags(tmp_path):
    with pytest.raises(ValueError, match="Margin chart takes 3 tags"):
        EventWriter(str(tmp_path)).add_custom_scalars({"c": {"m": ["Margin", ["a", "b"]]}})


@pytest.mark.parametrize("tag_style", ["hierarchical", "flat"])
def test_a_step_batch_writes_what_its_records_write(tmp_path, tag_style):
    """`TensorBoardSink.log_scalars` of a one-iteration `ScalarBatch` (the batch path, no work per record) writes the
    same events as the same records given as a list (the per-record path): scalars, cross-layer summaries and
    argmax texts, layout; over two steps of one layout, so the second step reuses the first one's work."""
    from tedebug.sinks.batch import Emitters, ScalarBatch
    from tedebug.sinks.tensorboard import TensorBoardSink

    def step(iteration):
        rows = []
        for i, layer in enumerate(["blocks.0.fc1", "blocks.1.fc1", "blocks.0.fc2"]):
            for tensor in ("activation", "weight"):
                names = tuple((f"{layer}_{tensor}_{stat}", stat) for stat in ("max", "underflows%"))
                values = [0.1 * i + iteration, float("nan") if (i, tensor, iteration) == (1, "weight", 1) else 2.0**130]
                rows.append((Emitters(names, lambda row: list(row)), values, iteration, layer, tensor))
        return ScalarBatch(rows)

    summaries = tag_style == "hierarchical"
    batched = TensorBoardSink(log_dir=str(tmp_path / "batched"), tag_style=tag_style, summaries=summaries)
    records = TensorBoardSink(log_dir=str(tmp_path / "records"), tag_style=tag_style, summaries=summaries)
    for iteration in (0, 1):
        batched.log_scalars(step(iteration))
        records.log_scalars(list(step(iteration)))
        batched.flush()
        records.flush()
    batched.close()
    records.close()
    assert batched._wire is not None and records._wire is None  # each took its path
    events = _events(str(tmp_path / "batched"))
    # the file version; per step its scalars, and with summaries the summary scalars and 4 argmax texts; the layout
    assert len(events) == (1 + 2 * (1 + 1 + 4) + 1 if summaries else 1 + 2)
    assert events == _events(str(tmp_path / "records"))
