"""Tensor- and sequence-parallel layers on 2 ranks equal the TP=1 layer (torch.distributed; gloo on CPU unless
TEDEBUG_TEST_DIST_BACKEND=nccl).

Every rank builds the TP=1 layer with the full parameters and the TP=2 layer with its shards (`tedebug.nn.parallel`
conventions), runs forward and backward on its part of the input / output gradient and compares with the matching
part of the TP=1 results.  Linear and GroupedLinear use small integers, so every product and sum is exact whatever
the summation order: outputs and gradients must be bit-identical, in high precision and under FP8 current scaling
(the values are FP8-exact and each full tensor's amax is 7, held by one shard only: equal results need the amax
reduced over the TP group, without it the other shard's scale is 448/6).  Layers with a normalization or a GELU
compare to a tight tolerance (their transcendental results depend on the vector width of the shard).
Parameters marked ``sequence_parallel`` get their gradients all-reduced over the group first, as the contract says.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import dist_harness

WORLD = 2
S, B, IN, OUT, FFN = 4, 2, 16, 8, 8


def ints(shape, seed, amax_in_first_half_of_dim=None):
    """Integers in [-6, 6] with one element of value 7 (the amax) in the first half of dimension `dim`."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-6, 7, shape, generator=g).float()
    if amax_in_first_half_of_dim is not None:
        index = [0] * len(shape)
        t[tuple(index)] = 7.0  # index 0 of every dimension: in the first half of any dimension
    return t


def _part(t, dim, rank):
    return t.chunk(WORLD, dim=dim)[rank]


def _run(layer, x, dy, recipe, **kw):
    import tedebug

    x = x.detach().clone().requires_grad_(True)
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x, **kw)
    y.backward(dy)
    return y.detach(), x.grad.detach()


def _grads(layer, group):
    out = {}
    for name, p in layer.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=group)
        out[name] = g
    return out


def _compare(results, case, pairs, exact):
    report = {}
    for what, (actual, expected) in pairs.items():
        actual, expected = actual.cpu(), expected.cpu()
        if actual.shape != expected.shape:
            report[what] = f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        elif exact:
            report[what] = "ok" if torch.equal(actual, expected) else f"max diff {(actual - expected).abs().max()}"
        else:
            ok = torch.allclose(actual, expected, rtol=1e-5, atol=1e-5)
            report[what] = "ok" if ok else f"max diff {(actual - expected).abs().max()}"
    results[case] = report


def _linear_cases(rank, group, dev, results):
    from tedebug import recipe as R
    from tedebug.nn import Linear

    x_full = ints((S, B, IN), 1, 0).to(dev)
    w_full = ints((OUT, IN), 2, 0).to(dev)
    b_full = ints((OUT,), 3).to(dev)
    dy_full = ints((S, B, OUT), 4, 0).to(dev)
    for recipe_name, recipe in (("hp", None), ("fp8cs", R.Float8CurrentScaling())):
        ref = Linear(IN, OUT, device=dev)
        with torch.no_grad():
            ref.weight.copy_(w_full)
            ref.bias.copy_(b_full)
        y_ref, dx_ref = _run(ref, x_full, dy_full, recipe)
        for mode in ("column", "row"):
            for sp in (False, True):
                tp = Linear(IN, OUT, device=dev, tp_group=group, parallel_mode=mode, sequence_parallel=sp)
                with torch.no_grad():
                    if mode == "column":
                        tp.weight.copy_(_part(w_full, 0, rank))
                        tp.bias.copy_(_part(b_full, 0, rank))
                    else:
                        tp.weight.copy_(_part(w_full, 1, rank))
                        tp.bias.copy_(b_full)
                if mode == "column":
                    x = _part(x_full, 0, rank) if sp else x_full
                    dy = _part(dy_full, 2, rank)
                    y_exp, dx_exp = _part(y_ref, 2, rank), (_part(dx_ref, 0, rank) if sp else dx_ref)
                    dw_exp, db_exp = _part(ref.weight.grad, 0, rank), _part(ref.bias.grad, 0, rank)
                else:
                    x = _part(x_full, 2, rank)
                    dy = _part(dy_full, 0, rank) if sp else dy_full
                    y_exp, dx_exp = (_part(y_ref, 0, rank) if sp else y_ref), _part(dx_ref, 2, rank)
                    dw_exp, db_exp = _part(ref.weight.grad, 1, rank), ref.bias.grad
                y, dx = _run(tp, x, dy, recipe)
                grads = _grads(tp, group)
                _compare(
                    results,
                    f"Linear-{mode}-sp{int(sp)}-{recipe_name}",
                    {
                        "y": (y, y_exp),
                        "dx": (dx, dx_exp),
                        "dw": (grads["weight"], dw_exp),
                        "db": (grads["bias"], db_exp),
                    },
                    exact=True,
                )
                if not sp:  # a copy (an EMA model) shares the group and computes the same
                    try:
                        twin = copy.deepcopy(tp)
                    except Exception as err:  # (reported by the test, not by every test of the module)
                        results[f"Linear-{mode}-{recipe_name}-copy"] = repr(err)
                    else:
                        twin_y, twin_dx = _run(twin, x, dy, recipe)
                        results[f"Linear-{mode}-{recipe_name}-copy"] = (
                            twin.gemm_state.tp_group is tp.gemm_state.tp_group is group,
                            torch.equal(twin_y, y) and torch.equal(twin_dx, dx),
                        )
                if recipe is not None and not sp:  # without the TP amax reduction the FP8 results differ
                    from tedebug.nn.parallel import TPCurrentScalingQuantizer

                    results[f"Linear-{mode}-{recipe_name}-tp-quantizers"] = sorted(
                        role for role, q in tp.gemm_state.quantizers.items() if isinstance(q, TPCurrentScalingQuantizer)
                    )


def _grouped_cases(rank, group, dev, results):
    from tedebug import recipe as R
    from tedebug.nn import GroupedLinear

    splits = [3, 0, 5]
    x_full = ints((8, IN), 11, 0).to(dev)
    ws = [ints((OUT, IN), 12 + i, 0).to(dev) for i in range(3)]
    bs = [ints((OUT,), 20 + i).to(dev) for i in range(3)]
    dy_full = ints((8, OUT), 30, 0).to(dev)
    for t in (x_full, dy_full):
        t[3, 0] = 7.0  # each expert's rows have their amax 7 in the first shard (current scaling per expert)
    for recipe_name, recipe in (("hp", None), ("fp8cs", R.Float8CurrentScaling())):
        ref = GroupedLinear(3, IN, OUT, device=dev)
        with torch.no_grad():
            for i in range(3):
                getattr(ref, f"weight{i}").copy_(ws[i])
                getattr(ref, f"bias{i}").copy_(bs[i])
        y_ref, dx_ref = _run(ref, x_full, dy_full, recipe, m_splits=splits)
        for mode in ("column", "row"):
            tp = GroupedLinear(3, IN, OUT, device=dev, tp_group=group, parallel_mode=mode)
            col = mode == "column"
            with torch.no_grad():
                for i in range(3):
                    getattr(tp, f"weight{i}").copy_(_part(ws[i], 0 if col else 1, rank))
                    getattr(tp, f"bias{i}").copy_(_part(bs[i], 0, rank) if col else bs[i])
            x = x_full if col else _part(x_full, 1, rank)
            dy = _part(dy_full, 1, rank) if col else dy_full
            y, dx = _run(tp, x, dy, recipe, m_splits=splits)
            grads = _grads(tp, group)
            pairs = {
                "y": (y, _part(y_ref, 1, rank) if col else y_ref),
                "dx": (dx, dx_ref if col else _part(dx_ref, 1, rank)),
            }
            for i in (0, 2):
                pairs[f"dw{i}"] = (grads[f"weight{i}"], _part(getattr(ref, f"weight{i}").grad, 0 if col else 1, rank))
                rb = getattr(ref, f"bias{i}").grad
                pairs[f"db{i}"] = (grads[f"bias{i}"], _part(rb, 0, rank) if col else rb)
            _compare(results, f"GroupedLinear-{mode}-{recipe_name}", pairs, exact=True)


def _norm_cases(rank, group, dev, results):
    from tedebug.nn import LayerNormLinear, LayerNormMLP
    from tedebug.nn.parallel import TensorParallel, shard_fc1

    g = torch.Generator().manual_seed(5)
    x_full = torch.randn(S, B, IN, generator=g).to(dev)
    dy_lin = torch.randn(S, B, OUT, generator=g).to(dev)
    dy_mlp = torch.randn(S, B, IN, generator=g).to(dev)
    for mode in ("column", "row"):
        for sp in (False, True):
            torch.manual_seed(0)
            ref = LayerNormLinear(IN, OUT, device=dev)
            with torch.no_grad():
                ref.layer_norm_weight.copy_(torch.linspace(0.5, 1.5, IN))
                ref.layer_norm_bias.copy_(torch.linspace(-0.2, 0.2, IN))
            y_ref, dx_ref = _run(ref, x_full, dy_lin, None)
            tp = LayerNormLinear(IN, OUT, device=dev, tp_group=group, parallel_mode=mode, sequence_parallel=sp)
            col = mode == "column"
            with torch.no_grad():
                tp.layer_norm_weight.copy_(ref.layer_norm_weight)
                tp.layer_norm_bias.copy_(ref.layer_norm_bias)
                tp.weight.copy_(_part(ref.weight, 0 if col else 1, rank))
                tp.bias.copy_(_part(ref.bias, 0, rank) if col else ref.bias)
            x = _part(x_full, 0, rank) if sp else x_full
            if col:
                dy, y_exp = _part(dy_lin, 2, rank), _part(y_ref, 2, rank)
            else:
                dy, y_exp = (_part(dy_lin, 0, rank), _part(y_ref, 0, rank)) if sp else (dy_lin, y_ref)
            y, dx = _run(tp, x, dy, None)
            grads = _grads(tp, group)
            rg = {n: p.grad for n, p in ref.named_parameters()}
            _compare(
                results,
                f"LayerNormLinear-{mode}-sp{int(sp)}",
                {
                    "y": (y, y_exp),
                    "dx": (dx, _part(dx_ref, 0, rank) if sp else dx_ref),
                    "dln_w": (grads["layer_norm_weight"], rg["layer_norm_weight"]),
                    "dln_b": (grads["layer_norm_bias"], rg["layer_norm_bias"]),
                    "dw": (grads["weight"], _part(rg["weight"], 0 if col else 1, rank)),
                    "db": (grads["bias"], _part(rg["bias"], 0, rank) if col else rg["bias"]),
                },
                exact=False,
            )
    tpl = TensorParallel.resolve("test", tp_group=group, parallel_mode="column")
    for activation, sp in (("gelu", False), ("swiglu", True)):
        torch.manual_seed(0)
        ref = LayerNormMLP(IN, FFN, activation=activation, device=dev)
        y_ref, dx_ref = _run(ref, x_full, dy_mlp, None)
        tp = LayerNormMLP(
            IN, FFN, activation=activation, device=dev, tp_group=group, set_parallel_mode=True, sequence_parallel=sp
        )
        gated = activation == "swiglu"
        with torch.no_grad():
            tp.fc1_weight.copy_(shard_fc1(ref.fc1_weight, tpl, gated))
            tp.fc1_bias.copy_(shard_fc1(ref.fc1_bias, tpl, gated))
            tp.fc2_weight.copy_(_part(ref.fc2_weight, 1, rank))
            tp.fc2_bias.copy_(ref.fc2_bias)
        x, dy = (_part(x_full, 0, rank), _part(dy_mlp, 0, rank)) if sp else (x_full, dy_mlp)
        y, dx = _run(tp, x, dy, None)
        grads = _grads(tp, group)
        rg = {n: p.grad for n, p in ref.named_parameters()}
        _compare(
            results,
            f"LayerNormMLP-{activation}-sp{int(sp)}",
            {
                "y": (y, _part(y_ref, 0, rank) if sp else y_ref),
                "dx": (dx, _part(dx_ref, 0, rank) if sp else dx_ref),
                "dln_w": (grads["layer_norm_weight"], rg["layer_norm_weight"]),
                "dfc1_w": (grads["fc1_weight"], shard_fc1(rg["fc1_weight"], tpl, gated)),
                "dfc1_b": (grads["fc1_bias"], shard_fc1(rg["fc1_bias"], tpl, gated)),
                "dfc2_w": (grads["fc2_weight"], _part(rg["fc2_weight"], 1, rank)),
                "dfc2_b": (grads["fc2_bias"], rg["fc2_bias"]),
            },
            exact=False,
        )


def _layers_worker(rank, world):
    dev = dist_harness.device(rank)
    group = dist.new_group(list(range(world)))
    results = {}
    _linear_cases(rank, group, dev, results)
    _grouped_cases(rank, group, dev, results)
    _norm_cases(rank, group, dev, results)
    only_rank0 = dist.new_group([0])  # every rank takes part in creating it
    if rank == 1:
        from tedebug.nn import Linear

        try:
            Linear(4, 4, name="outsider", tp_group=only_rank0, parallel_mode="column")
        except ValueError as err:
            results["outsider"] = str(err)
    return results


@pytest.fixture(scope="module")
def layer_results():
    return dist_harness.spawn(_layers_worker, WORLD)


def _cases(prefix):
    return [f"{prefix}-{m}-sp{s}-{r}" for m in ("column", "row") for s in (0, 1) for r in ("hp", "fp8cs")]


@pytest.mark.distributed
@pytest.mark.parametrize("case", _cases("Linear"))
def test_linear_tp2_equals_tp1_bit_exact(layer_results, case):
    for rank, results in enumerate(layer_results):
        assert results[case] == {k: "ok" for k in ("y", "dx", "dw", "db")}, (rank, results[case])


@pytest.mark.distributed
def test_a_copy_of_a_tp_layer_shares_its_group_and_computes_the_same(layer_results):
    """copy.deepcopy of a split layer (an EMA model); before, it failed: torch cannot copy a process group."""
    for results in layer_results:
        for case in ("Linear-column-hp", "Linear-row-hp", "Linear-column-fp8cs", "Linear-row-fp8cs"):
            assert results[f"{case}-copy"] == (True, True), case


@pytest.mark.distributed
def test_fp8_current_scaling_amax_reduced_on_sharded_operands_only(layer_results):
    for results in layer_results:
        assert results["Linear-column-fp8cs-tp-quantizers"] == ["grad_output", "weight"]
        assert results["Linear-row-fp8cs-tp-quantizers"] == ["input", "weight"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [f"GroupedLinear-{m}-{r}" for m in ("column", "row") for r in ("hp", "fp8cs")])
def test_grouped_linear_tp2_equals_tp1_bit_exact(layer_results, case):
    for results in layer_results:
        assert set(results[case].values()) == {"ok"}, results[case]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case",
    [f"LayerNormLinear-{m}-sp{s}" for m in ("column", "row") for s in (0, 1)]
    + ["LayerNormMLP-gelu-sp0", "LayerNormMLP-swiglu-sp1"],
)
def test_norm_layers_tp2_equal_tp1(layer_results, case):
    for results in layer_results:
        assert set(results[case].values()) == {"ok"}, results[case]


@pytest.mark.distributed
def test_a_rank_outside_the_tp_group_is_an_error(layer_results):
    assert layer_results[1]["outsider"] == "Linear 'outsider': this process (global rank 1) is not in tp_group"


def test_constructor_errors_name_the_layer_and_the_fix():
    from tedebug.nn import GroupedLinear, Linear

    with pytest.raises(ValueError, match=r"Linear 'p1': parallel_mode .* got 'colum'; did you mean 'column'"):
        Linear(4, 4, name="p1", parallel_mode="colum")
    with pytest.raises(ValueError, match="tp_size=2 needs a tp_group"):
        Linear(4, 4, tp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel is not supported"):
        GroupedLinear(2, 4, 4, sequence_parallel=True)
    layer = Linear(4, 6, parallel_mode="column")  # no group: a TP=1 layer, whole sizes
    assert (layer.in_features, layer.out_features, layer.tp.active) == (4, 6, False)
