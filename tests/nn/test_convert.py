"""tedebug.convert_model: names from module paths, shared Parameters, filter_fn, default recipe, training."""

import pytest
import torch
import torch.nn.functional as F

import tedebug
from tedebug import recipe as R
from tedebug.nn import Linear


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=128, dim=128, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


LINEAR_PATHS = [
    "blocks.0.qkv",
    "blocks.0.proj",
    "blocks.0.mlp.0",
    "blocks.0.mlp.2",
    "blocks.1.qkv",
    "blocks.1.proj",
    "blocks.1.mlp.0",
    "blocks.1.mlp.2",
    "head",
]


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT()


def test_names_from_paths_and_shared_parameters():
    model = _model()
    before = {name: (m.weight, m.bias) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    idx = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = model(idx)
    assert tedebug.convert_model(model) is model
    converted = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert sorted(converted) == sorted(LINEAR_PATHS)
    for path, layer in converted.items():
        assert layer.name == path
        assert layer.weight is before[path][0] and layer.bias is before[path][1]
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model(idx), ref)  # outside autocast: high precision, the same function


def test_filter_fn_and_already_converted_layers():
    model = _model()
    seen = []

    def only_mlp(fqn, module):
        seen.append((fqn, type(module)))
        return ".mlp." in fqn

    tedebug.convert_model(model, filter_fn=only_mlp)
    assert sorted(fqn for fqn, _ in seen) == sorted(LINEAR_PATHS)
    assert all(t is torch.nn.Linear for _, t in seen)
    assert isinstance(model.blocks[0].mlp[0], Linear) and isinstance(model.blocks[1].mlp[2], Linear)
    assert type(model.blocks[0].qkv) is torch.nn.Linear and type(model.head) is torch.nn.Linear
    first = model.blocks[0].mlp[0]
    tedebug.convert_model(model)  # converts the rest, keeps the converted ones
    assert model.blocks[0].mlp[0] is first
    assert isinstance(model.head, Linear) and model.head.name == "head"


def test_shared_module_converted_once_and_mha_out_proj_kept():
    shared = torch.nn.Linear(8, 8)
    model = torch.nn.ModuleDict(
        {"a": shared, "b": torch.nn.Sequential(shared), "mha": torch.nn.MultiheadAttention(8, 2)}
    )
    tedebug.convert_model(model)
    assert model["a"] is model["b"][0] and model["a"].name == "a"
    assert type(model["mha"].out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear


def test_errors():
    with pytest.raises(TypeError, match="wrap it"):
        tedebug.convert_model(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="recipe"):
        tedebug.convert_model(_model(), recipe="mxfp8")


def test_default_recipe_precedence():
    model = tedebug.convert_model(_model(), recipe=R.MXFP8BlockScaling())
    head = model.head
    assert isinstance(head.default_recipe, R.MXFP8BlockScaling)
    with tedebug.autocast():
        assert head.active_recipe() is head.default_recipe
    with tedebug.autocast(recipe=R.Float8CurrentScaling()):
        assert isinstance(head.active_recipe(), R.Float8CurrentScaling)
    assert head.active_recipe() is None


RECIPES = [
    R.DelayedScaling(),
    R.Float8CurrentScaling(),
    R.MXFP8BlockScaling(),
    R.NVFP4BlockScaling(seed=7),
    R.Float8BlockScaling(),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_converted_model_trains(recipe):
    torch.manual_seed(3)
    model = tedebug.convert_model(TinyGPT(layers=1), recipe=recipe)
    idx = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(4))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for _ in range(6):
        with tedebug.autocast():
            logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05, losses
    # the GEMMs ran quantized: the layers built quantizers of the recipe
    assert model.head.gemm_state.recipe is recipe


class _LowRank(torch.nn.Module):
    """A LoRA written as a parametrization: W + B·A."""

    def __init__(self, out_features, in_features):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4, in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(out_features, 4) * 0.1)

    def forward(self, weight):
        return weight + self.b @ self.a


def _parametrized(kind: str) -> torch.nn.Linear:
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import orthogonal, weight_norm

    layer = torch.nn.Linear(32, 32)
    if kind == "weight_norm":
        return weight_norm(layer)
    if kind == "orthogonal":
        return orthogonal(layer)
    if kind == "low_rank":
        parametrize.register_parametrization(layer, "weight", _LowRank(32, 32))
        return layer
    parametrize.register_parametrization(layer, "bias", torch.nn.Tanh())  # "bias"
    return layer


@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "low_rank", "bias"])
def test_a_parametrized_linear_keeps_its_parametrizations(kind, tmp_path, no_debug_session):
    """torch.nn.utils.parametrize layers: the converted layer computes its weight (bias) through the same
    parametrizations and `original` parameters, so outputs, gradients, parameters and state_dict keys are the
    original model's, and the statistics are the effective weight's.  Before, convert_model raised TypeError
    (the computed weight is no Parameter)."""
    import copy

    from tedebug import debug_api
    from support.features import RecordingSink, debug_session, section

    torch.manual_seed(0)
    model = torch.nn.Sequential(_parametrized(kind), torch.nn.GELU(), torch.nn.Linear(32, 32))
    plain = copy.deepcopy(model)
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    tedebug.convert_model(model)
    assert isinstance(model[0], Linear) and dict(model.named_parameters()) == parameters
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 8, 32)
    y = model(x)
    y.pow(2).sum().backward()
    expected = plain(x)
    expected.pow(2).sum().backward()
    assert torch.equal(y, expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["weight"], "freq": 1}})
    sink = RecordingSink()
    with debug_session(config, tmp_path, sink=sink):
        with tedebug.autocast(enabled=True, recipe=R.Float8CurrentScaling()):
            model(x).sum().backward()
        debug_api.step()
    assert sink.rows == [
        ("0_weight_max", model[0].weight.max().item(), 0),
        ("2_weight_max", model[2].weight.max().item(), 0),
    ]


def test_an_uninitialised_lazy_linear_is_an_error_and_an_initialised_one_converts():
    """Converted before its first forward, a LazyLinear became a layer of 0 input features that failed at the
    first call; convert_model says what to do instead, and converts nothing until then."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"'0' is a lazy module .* run one forward, then convert"):
        tedebug.convert_model(model)
    assert type(model[2]) is torch.nn.Linear  # nothing converted
    x = torch.randn(3, 8)
    expected = model(x)
    tedebug.convert_model(model)
    assert isinstance(model[0], Linear) and torch.equal(model(x), expected)


class _LowRankLinear(torch.nn.Linear):
    """A LoRA as a torch.nn.Linear subclass: its own forward and its own submodules."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.lora_a = torch.nn.Linear(in_features, 4, bias=False)
        self.lora_b = torch.nn.Linear(4, out_features, bias=False)
        torch.nn.init.normal_(self.lora_b.weight)

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(x))


class _CastLinear(torch.nn.Linear):
    """Only a forward of its own (a cast, as in some training scripts)."""

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class _ScaledLinear(torch.nn.Linear):
    """Torch's forward, and a buffer of its own."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.register_buffer("scale", torch.ones(()))


def test_a_linear_subclass_that_adds_to_linear_is_left_as_it_is_and_reported():
    """Before, a torch.nn.Linear subclass was converted like torch.nn.Linear, which dropped its own forward (a LoRA
    path, a cast) without a word: the model computed something else.  Now it is left as it is, named in the
    warning, and the plain Linear layers inside it are converted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_LowRankLinear(8, 8), _CastLinear(8, 8), _ScaledLinear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    expected = model(x)
    with pytest.warns(UserWarning, match="these modules hold weights but are not converted") as caught:
        tedebug.convert_model(model)
    message = str(caught[0].message)
    assert "_CastLinear, _LowRankLinear, _ScaledLinear: torch.nn.Linear layers with a forward or parts" in message
    assert [type(m).__name__ for m in model] == ["_LowRankLinear", "_CastLinear", "_ScaledLinear", "Linear"]
    assert isinstance(model[3], Linear) and isinstance(model[0].lora_a, Linear) and isinstance(model[0].lora_b, Linear)
    assert torch.equal(model(x), expected)


def test_a_pruned_linear_is_left_as_it_is_and_reported():
    """torch.nn.utils.prune recomputes the weight from weight_orig and a mask before each forward: the layer is left
    as it is, and named (before, its weight_orig was no weight by name, so nothing was said)."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    x = torch.randn(2, 8)
    expected = model(x)
    with pytest.warns(UserWarning, match=r"Linear x1 \(64 weight parameters\)\. Linear: torch.nn.Linear layers"):
        tedebug.convert_model(model)
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], Linear)
    assert torch.equal(model(x), expected)


def test_transformer_encoder_layers_fast_path_is_named():
    """torch.nn.TransformerEncoderLayer in eval mode without gradients computes its feed-forward in one fused op
    that reads linear1's and linear2's weights itself: the converted layers are then not called (an FP8 evaluation
    gives the high-precision output).  convert_model says so once, with PyTorch's switch; with the switch off, they
    run."""
    from tedebug.recipe import Float8CurrentScaling

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True, dropout=0.0),
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True, dropout=0.0),
    )
    with pytest.warns(UserWarning) as caught:
        tedebug.convert_model(model)
    messages = [str(w.message) for w in caught if "fast path" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("tedebug.convert_model: 2 torch.nn.TransformerEncoderLayer")
    assert "torch.backends.mha.set_fastpath_enabled(False)" in messages[0]
    model.eval()
    x = torch.randn(2, 8, 32)
    enabled = torch.backends.mha.get_fastpath_enabled()
    try:
        with torch.no_grad():
            high_precision = model(x)
            with tedebug.autocast(recipe=Float8CurrentScaling()):
                fast = model(x)
            torch.backends.mha.set_fastpath_enabled(False)
            with tedebug.autocast(recipe=Float8CurrentScaling()):
                slow = model(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    assert torch.equal(fast, high_precision) and not torch.equal(slow, high_precision)
