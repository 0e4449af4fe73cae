"""tedebug.nn layers in real training set-ups: GroupedLinear flattens leading dims, delayed-scaling state in
state_dict (resume equals the uninterrupted run; loading works with and without it), and DelayedScaling's amax
reduction across 2 gloo ranks (per-rank scales equal the one-big-batch scales), statistics written by rank 0 only."""

import datetime
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tedebug
from tedebug.nn import GroupedLinear, Linear
from tedebug.nn.state import STATE_KEY
from tedebug.recipe import DelayedScaling, Float8CurrentScaling


def test_grouped_linear_flattens_leading_dims():
    torch.manual_seed(0)
    layer = GroupedLinear(2, 16, 8)
    x = torch.randn(2, 3, 16)
    out = layer(x, [4, 2])
    flat = x.reshape(-1, 16)
    ref = torch.cat(
        [
            torch.nn.functional.linear(flat[:4], layer.weight0, layer.bias0),
            torch.nn.functional.linear(flat[4:], layer.weight1, layer.bias1),
        ]
    ).reshape(2, 3, 8)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match=r"do not sum to 6 rows \(input \(2, 3, 16\) flattened"):
        layer(x, [4, 3])


def make(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(Linear(32, 32, name="a"), torch.nn.GELU(), Linear(32, 32, name="b"))


def steps(model, opt, recipe, n, start=0):
    losses = []
    for i in range(start, start + n):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + i)) * (1 + i)
        with tedebug.autocast(recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_delayed_scaling_state_round_trips_through_state_dict():
    recipe = DelayedScaling(amax_history_len=4)
    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    ref_losses = steps(ref, ref_opt, recipe, 6)

    first = make()
    opt = torch.optim.SGD(first.parameters(), lr=0.01)
    losses = steps(first, opt, recipe, 3)
    saved = first.state_dict()
    states = [
        f"{layer}.{STATE_KEY}.gemm_state.{role}.0" for layer in "02" for role in ("input", "weight", "grad_output")
    ]
    fields = {f"{state}.{field}" for state in states for field in ("scale", "amax_history", "used")}
    assert set(saved) == {"0.weight", "0.bias", "2.weight", "2.bias"} | fields
    assert all(isinstance(value, torch.Tensor) for value in saved.values())  # (safetensors, DCP)
    assert saved[f"0.{STATE_KEY}.gemm_state.input.0.used"].item() is True
    assert saved[f"0.{STATE_KEY}.gemm_state.input.0.amax_history"].shape == (4,)
    resumed = make(seed=1)  # other weights: everything comes from the checkpoint
    resumed.load_state_dict(saved)  # applied at the first forward (quantizers are built lazily)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    losses += steps(resumed, opt2, recipe, 3, start=3)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))


def test_state_dict_keys_unchanged_without_delayed_scaling_and_old_checkpoints_load():
    model = make()
    plain_keys = set(model.state_dict())
    steps(model, torch.optim.SGD(model.parameters(), lr=0.01), Float8CurrentScaling(), 1)
    assert set(model.state_dict()) == plain_keys
    delayed = make()
    steps(delayed, torch.optim.SGD(delayed.parameters(), lr=0.01), DelayedScaling(amax_history_len=4), 1)
    state = delayed.state_dict()
    plain = {k: v for k, v in state.items() if STATE_KEY not in k}
    delayed.load_state_dict(plain)  # strict load of a checkpoint without the state works
    torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)).load_state_dict(plain)
    with pytest.warns(UserWarning, match="amax history of length 4 does not fit the layer's history length 8"):
        other = make()
        other.load_state_dict(state)
        steps(other, torch.optim.SGD(other.parameters(), lr=0.01), DelayedScaling(amax_history_len=8), 1)


@pytest.mark.parametrize("how", ["default recipe", "init_recipe_state"])
def test_delayed_scaling_state_round_trips_through_a_distributed_checkpoint(tmp_path, how):
    """torch.distributed.checkpoint loads only the keys of the state dict it loads into: a fresh model has the
    delayed-scaling entries when its default recipe is delayed, or after `init_recipe_state`, so the resumed run
    equals the uninterrupted one (before, the fresh model had no entry: the state was dropped without a word)."""
    import torch.distributed.checkpoint as dcp

    from tedebug.nn import init_recipe_state

    recipe = DelayedScaling(amax_history_len=4)

    def fresh(seed=0):
        model = make(seed)
        if how == "default recipe":
            for layer in (model[0], model[2]):
                layer.default_recipe = recipe
        return model

    ref = fresh()
    ref_losses = steps(ref, torch.optim.SGD(ref.parameters(), lr=0.01), recipe, 6)
    first = fresh()
    losses = steps(first, torch.optim.SGD(first.parameters(), lr=0.01), recipe, 3)
    dcp.save(first.state_dict(), checkpoint_id=str(tmp_path / "checkpoint"))
    resumed = fresh(seed=1)  # other weights and a fresh state: everything comes from the checkpoint
    if how == "init_recipe_state":
        assert STATE_KEY not in "".join(resumed.state_dict())
        assert init_recipe_state(resumed, recipe) == 2
    state = resumed.state_dict()
    assert {f"0.{STATE_KEY}.gemm_state.weight.0.scale", f"2.{STATE_KEY}.gemm_state.input.0.amax_history"} <= set(state)
    dcp.load(state, checkpoint_id=str(tmp_path / "checkpoint"))
    resumed.load_state_dict(state)
    losses += steps(resumed, torch.optim.SGD(resumed.parameters(), lr=0.01), recipe, 3, start=3)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))


def test_a_checkpoint_of_the_nested_format_before_still_loads():
    """Until the flat keys, the state was one dict per layer (``<prefix>tedebug_fp8_state``): it loads as before."""
    recipe = DelayedScaling(amax_history_len=4)
    ref = make()
    ref_losses = steps(ref, torch.optim.SGD(ref.parameters(), lr=0.01), recipe, 4)
    first = make()
    losses = steps(first, torch.optim.SGD(first.parameters(), lr=0.01), recipe, 2)
    nested = {}
    for key, value in first.state_dict().items():
        layer, marker, rest = key.partition(f".{STATE_KEY}.")
        if not marker:
            nested[key] = value
            continue
        name, _, field = rest.rpartition(".")
        entry = nested.setdefault(f"{layer}.{STATE_KEY}", {}).setdefault(name, {})
        entry[field] = value.item() if field == "used" else value
    resumed = make(seed=1)
    resumed.load_state_dict(nested)
    losses += steps(resumed, torch.optim.SGD(resumed.parameters(), lr=0.01), recipe, 2, start=2)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))


def test_a_state_dict_key_that_is_no_delayed_scaling_state_is_an_error():
    model = make()
    steps(model, torch.optim.SGD(model.parameters(), lr=0.01), DelayedScaling(amax_history_len=4), 1)
    state = model.state_dict()
    state[f"0.{STATE_KEY}.gemm_state.input.0.colour"] = torch.tensor(1.0)
    state[f"2.{STATE_KEY}.fc9.input.0.scale"] = torch.tensor(1.0)
    with pytest.raises(RuntimeError) as raised:
        make().load_state_dict(state)
    assert f"0.{STATE_KEY}.gemm_state.input.0.colour: not a delayed-scaling state" in str(raised.value)
    assert f"2.{STATE_KEY}.fc9.input.0: the saved state has no amax_history" in str(raised.value)


def test_init_recipe_state_keeps_built_quantizers_and_refuses_what_it_cannot_use():
    from tedebug.nn import init_recipe_state

    model = make()
    steps(model, torch.optim.SGD(model.parameters(), lr=0.01), DelayedScaling(amax_history_len=4), 1)
    before = model.state_dict()
    assert init_recipe_state(model, DelayedScaling(amax_history_len=8)) == 0  # built already: kept
    assert str(model.state_dict()) == str(before)
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        init_recipe_state([model], DelayedScaling())
    with pytest.raises(TypeError, match="expects a tedebug.recipe recipe"):
        init_recipe_state(model, "DelayedScaling")


# ------------------------------------------------------------------------------------------------ amax reduction
WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(i):
    g = torch.Generator().manual_seed(7 + i)
    return torch.randn(2 * WORLD, 32, generator=g) * torch.linspace(0.1, 20.0, 32)


def _scales(model):
    return [
        q.scale.item()
        for layer in (model[0], model[2])
        for role, q in layer.gemm_state.quantizers.items()
        if q is not None and role != "grad_output"
    ]


GROUPED_ROWS = {0: ([0, 1], [2, 0]), 1: ([2, 3], [1, 1])}  # rank -> (rows of _batch, m_splits)


def _grouped_scales(rank=None):
    """Scales of every role of both GEMMs of a GroupedLinear after 3 delayed-scaling steps: on this rank's rows
    (rank given) or on all rows, sorted by expert (rank None)."""
    torch.manual_seed(3)
    layer = GroupedLinear(2, 32, 16)
    for i in range(3):
        x = _batch(i)
        if rank is None:
            rows, splits = [0, 1, 2, 3], [3, 1]
        else:
            rows, splits = GROUPED_ROWS[rank]
        with tedebug.autocast(recipe=DelayedScaling(amax_history_len=4)):
            layer(x[rows], splits).square().sum().backward()
    return [
        [q.scale.item() for q in (state.quantizers[r] for r in ("input", "weight", "grad_output"))]
        for state in layer.gemm_states
    ]


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        for reduce_amax in (True, False):
            model = make()
            recipe = DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
            for i in range(3):
                x = _batch(i)[rank * 2 : (rank + 1) * 2]  # this rank's half of the batch
                with tedebug.autocast(recipe=recipe):
                    model(x).sum().backward()
            torch.save(_scales(model), os.path.join(out_dir, f"{reduce_amax}-{rank}.pt"))
        # GroupedLinear: expert 1 gets no rows on rank 0, yet both ranks run the same collectives and keep the
        # same delayed-scaling state as one process running the whole batch
        torch.save(_grouped_scales(rank), os.path.join(out_dir, f"grouped-{rank}.pt"))
        # statistics_rank0_only: the reduced statistics are written once, by rank 0
        from tedebug import debug_api

        config = {
            "s": {
                "enabled": True,
                "layers": {"layer_name_regex_pattern": "a"},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}
                },
            }
        }
        debug_api.initialize(config, log_dir=os.path.join(out_dir, "logs"), statistics_rank0_only=True)
        try:
            model(_batch(0)[rank * 2 : (rank + 1) * 2])
            debug_api.step()
        finally:
            debug_api.end_debug()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_reduce_amax_gives_every_rank_the_one_big_batch_scales(tmp_path):
    ref = make()
    for i in range(3):
        with tedebug.autocast(recipe=DelayedScaling(amax_history_len=4)):
            ref(_batch(i)).sum().backward()
    want = _scales(ref)
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    got = {(r, k): torch.load(tmp_path / f"{r}-{k}.pt") for r in (True, False) for k in range(WORLD)}
    # [a.input, a.weight, b.input, b.weight]: a's input and both weights are bit-equal; b's input comes from a GEMM
    # over 2 rows instead of 4 (the last bit may differ)
    for rank in range(WORLD):
        assert got[(True, rank)][:2] == want[:2] and got[(True, rank)][3] == want[3]
        assert got[(True, rank)][2] == pytest.approx(want[2], rel=1e-6)
    # without reduction each rank derives its scales from its own half of the batch
    assert got[(False, 0)][0] != want[0] or got[(False, 1)][0] != want[0]
    assert min(got[(False, 0)][0], got[(False, 1)][0]) == pytest.approx(want[0], rel=1e-6)
    assert max(got[(False, 0)][0], got[(False, 1)][0]) > want[0] * 1.01
    grouped = _grouped_scales()
    for rank in range(WORLD):
        got_grouped = torch.load(tmp_path / f"grouped-{rank}.pt")
        assert got_grouped[0][1:] == grouped[0][1:] and got_grouped[1] == grouped[1]
        assert got_grouped[0][0] == pytest.approx(grouped[0][0], rel=1e-6)
    stats_dir = tmp_path / "logs" / "tedebug_statistics"
    assert sorted(os.listdir(stats_dir)) == ["metrics_globalrank-0.jsonl"]
    (record,) = [json.loads(line) for line in open(stats_dir / "metrics_globalrank-0.jsonl")]
    assert record["value"] == _batch(0).max().item()  # both ranks' halves
    assert sorted(os.listdir(tmp_path / "logs" / "nvdlfw_inspect_statistics_logs")) == [
        "nvdlfw_inspect_globalrank-0.log"
    ]
