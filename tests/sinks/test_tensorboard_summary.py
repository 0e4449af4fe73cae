"""TensorBoardSink: cross-layer summaries (max, p90, median, argmax layer), charts of at most 16 layers, user
scalars next to the statistics."""

import math
import re

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from tedebug.sinks.tensorboard import TensorBoardSink, chart_groups, cross_layer_summary, layer_type
from support.tensorboard_events import layouts, load, scalars

# 40 blocks: qkv, proj, fc1, fc2 each -> 160 layers
LAYERS = [f"blocks.{b}.{kind}" for b in range(40) for kind in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


def decoded_texts(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


@pytest.mark.parametrize("batched", [True, False])
def test_summary_scalars_and_argmax_text(tmp_path, batched):
    sink = TensorBoardSink(SummaryWriter(str(tmp_path)))
    values = {layer: float(i % 37) for i, layer in enumerate(LAYERS)}  # max 36 first at index 36 (blocks.9.mlp.fc2)
    values["blocks.20.mlp.fc1"] = 36.5
    records = [(f"{layer}_gradient_underflows%", v, 7, layer, "gradient", "underflows%") for layer, v in values.items()]
    records.append(("blocks.0.attn.qkv_activation_max", 3.0, 7, "blocks.0.attn.qkv", "activation", "max"))
    records.append(("blocks.1.attn.qkv_activation_max", math.inf, 7, "blocks.1.attn.qkv", "activation", "max"))
    if batched:
        sink.log_scalars(records)
    else:
        for name, value, it, layer, tensor, stat in records:
            sink.log_scalar(name, value, it, layer=layer, tensor=tensor, stat=stat)
    sink.flush()
    sink.writer.close()
    acc = load(str(tmp_path))
    got = scalars(acc)
    column = np.array(list(values.values()))
    assert got["summary/gradient/underflows%/max"] == [(7, 36.5)]
    assert got["summary/gradient/underflows%/p90"] == [(7, pytest.approx(float(np.percentile(column, 90))))]
    assert got["summary/gradient/underflows%/median"] == [(7, float(np.median(column)))]
    assert decoded_texts(acc, "summary/gradient/underflows%/argmax/text_summary") == [(7, "blocks.20.mlp.fc1 (36.5)")]
    assert got["summary/activation/max/max"] == [(7, math.inf)]  # a non-finite value is the max, and named
    assert got["summary/activation/max/median"] == [(7, 3.0)]  # over the finite values
    assert decoded_texts(acc, "summary/activation/max/argmax/text_summary") == [(7, "blocks.1.attn.qkv (inf)")]


def test_cross_layer_summary_values():
    assert cross_layer_summary(["a", "b", "c", "d"], [4.0, 1.0, 3.0, 2.0]) == (4.0, 3.7, 2.5, "a", 4.0)
    high, p90, median, layer, value = cross_layer_summary(["a", "b"], [math.nan, 1.0])
    assert math.isnan(high) and (p90, median, layer) == (1.0, 1.0, "a") and math.isnan(value)


def test_layer_types_and_chart_groups():
    assert [
        layer_type(n) for n in ("blocks.3.mlp.fc1", "model.layers.7.self_attn.q_proj", "Layer_12", "h.0.mlp.0", "fc")
    ] == ["fc1", "q_proj", "Layer", "mlp.0", "fc"]
    groups = chart_groups(LAYERS)
    assert [label for label, _ in groups][:3] == [
        "qkv blocks.0.attn.qkv..blocks.15.attn.qkv",
        "qkv blocks.16.attn.qkv..blocks.31.attn.qkv",
        "qkv blocks.32.attn.qkv..blocks.39.attn.qkv",
    ]
    assert [len(members) for _, members in groups] == [16, 16, 8] * 4
    assert sorted(m for _, members in groups for m in members) == sorted(LAYERS)
    assert chart_groups(["a.fc1", "b.fc1", "a.fc2"]) == [("fc1", ["a.fc1", "b.fc1"]), ("fc2", ["a.fc2"])]


def test_layout_splits_charts_and_charts_user_scalars(tmp_path):
    sink = TensorBoardSink(log_dir=str(tmp_path))
    sink.log_scalars([(f"{layer}_activation_mse", 1.0, 0, layer, "activation", "mse") for layer in LAYERS])
    sink.log_user_scalar("train/loss", 2.5, 0)
    sink.close()
    acc = load(str(tmp_path))
    got = scalars(acc)
    assert got["train/loss"] == [(0, 2.5)]
    [final] = layouts(acc)[-1:]
    charts = {cat.title: {c.title: list(c.multiline.tag) for c in cat.chart} for cat in final.category}
    assert list(charts) == ["user", "activation"]
    assert charts["user"] == {"train/loss": ["^train/loss$"]}
    titles = list(charts["activation"])
    assert titles[0] == "activation/mse summary (max, p90, median over layers)"
    assert len(titles) == 1 + 12
    tags = [t for t in got if t.endswith("/activation/mse") and not t.startswith("summary/")]
    assert len(tags) == 160
    covered = []
    for title in titles:
        [regex] = charts["activation"][title]
        matched = [t for t in got if re.match(regex, t)]
        assert 1 <= len(matched) <= 16, title
        if title != titles[0]:
            covered += matched
    assert sorted(covered) == sorted(tags)  # every layer on exactly one chart
    assert sorted(t for t in got if re.match(charts["activation"][titles[0]][0], t)) == [
        "summary/activation/mse/max",
        "summary/activation/mse/median",
        "summary/activation/mse/p90",
    ]
    with pytest.raises(ValueError, match="non-empty str"):
        sink.log_user_scalar("", 1.0, 0)


def test_flat_style_writes_no_summaries_unless_asked(tmp_path):
    for summaries, expected in (
        (None, {"L_activation_max"}),
        (
            True,
            {
                "L_activation_max",
                "summary/activation/max/max",
                "summary/activation/max/p90",
                "summary/activation/max/median",
            },
        ),
    ):
        writer = SummaryWriter(str(tmp_path / str(summaries)))
        sink = TensorBoardSink(writer, tag_style="flat", summaries=summaries)
        sink.log_scalars([("L_activation_max", 1.0, 0, "L", "activation", "max")])
        sink.close()
        writer.close()
        assert set(scalars(load(str(tmp_path / str(summaries))))) == expected
