"""`convert_model`: swap the GEMM layers of any model for tedebug layers, in place.

Converted (each named after its module path, e.g. ``"blocks.0.attn.proj"``):

- `torch.nn.Linear` -> `tedebug.nn.Linear`;
- transformers' ``Conv1D`` (GPT-2) -> `tedebug.nn.hf.Conv1DLinear` (weight kept ``[in, out]``, state_dict unchanged);
- transformers' grouped experts modules (3-D expert weights: Mixtral, Qwen3-MoE, ...) -> tedebug grouped experts
  whose expert GEMMs are logged as ``<module>.<parameter>.gemm_<e>`` (`tedebug.nn.hf`).

The new layers share the original weight and bias `Parameter` objects (optimizers built before the swap keep
working) and keep the train/eval mode.  `recipe`, when given, becomes the converted layers' ``default_recipe``:
inside ``tedebug.autocast()`` blocks that name no recipe they use it; an ``autocast(recipe=...)`` still wins;
outside autocast they run in high precision.

Kept in high precision by default: a Linear named ``lm_head`` and any Linear whose weight is tied to an
`nn.Embedding` (tied decoders); ``convert_lm_head=True`` converts them too.  Not converted: modules whose forward
never runs (``nn.MultiheadAttention.out_proj``, a ``NonDynamicallyQuantizableLinear`` whose weight is read
directly), layers that already are tedebug layers, and subclasses of torch.nn.Linear that compute more than
x·Wᵀ + b (a forward of their own, such as a LoRA or a quantized kernel, or parameters, buffers or submodules of their
own): converting them would drop what they add, so they are reported (torch.nn.Linear layers inside them are
converted).  Modules that hold weights but cannot be converted
(``nn.MultiheadAttention``, convolutions, MoE routers, unknown expert layouts, ...) are listed in one
`UserWarning` (module types, counts and parameter counts), so nothing stays out silently.  A Linear's
parametrizations (``torch.nn.utils.parametrize``: weight_norm, orthogonal, a LoRA written as one) are carried over,
parameters and state_dict keys unchanged.  Forward/backward hooks registered on an original module are not carried
over.  `torch.nn.TransformerEncoderLayer`'s inference fast path (eval mode, no gradients) computes its feed-forward
without calling linear1 and linear2: a second `UserWarning` says so and names PyTorch's switch for it.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Set

import torch
from torch.nn.utils import parametrize

from tedebug.nn.base import BaseLayer
from tedebug.nn.hf import Conv1DLinear, convert_experts, is_grouped_experts, is_hf_conv1d
from tedebug.nn.linear import Linear

__all__ = ["convert_model", "prefix_layer_names", "LM_HEAD_NAME"]

FilterFn = Callable[[str, torch.nn.Module], bool]
#: the last path component of output projections kept in high precision by default
LM_HEAD_NAME = "lm_head"


def _is_linear(module: torch.nn.Module) -> bool:
    if isinstance(module, BaseLayer) or not isinstance(module, torch.nn.Linear):
        return False
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return False
    return not _adds_to_linear(module)


def _adds_to_linear(module: torch.nn.Linear) -> bool:
    """Whether a torch.nn.Linear (subclass) computes more than x·Wᵀ + b: a forward of its own (a LoRA, a cast, a
    quantized kernel) or parameters, buffers or submodules beyond the weight, the bias and their parametrizations.
    Converting it would drop what it adds, so it is left as it is (and reported)."""
    if type(module).forward is not torch.nn.Linear.forward:
        return True
    if any(name != "parametrizations" for name, _ in module.named_children()):
        return True
    if any(name not in ("weight", "bias") for name, _ in module.named_parameters(recurse=False)):
        return True
    return any(True for _ in module.named_buffers(recurse=False))


def _convertible(module: torch.nn.Module) -> bool:
    if isinstance(module, BaseLayer):
        return False
    return _is_linear(module) or is_hf_conv1d(module) or is_grouped_experts(module)


class _Carried(torch.nn.Module):
    """Holds a parametrized tensor's place while the new layer is made parametrized (`_swap_linear`), and is replaced
    at once by the original layer's parametrizations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _uninitialised_lazy(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params()


def _swap_linear(linear: torch.nn.Linear, name: str, recipe) -> Linear:
    layer = Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        name=name,
        params_dtype=linear.weight.dtype,
        device="meta",
    )
    carried = linear.parametrizations if parametrize.is_parametrized(linear) else {}
    for tensor_name in ("weight", "bias"):
        if tensor_name in carried:
            # torch.nn.utils.parametrize (weight_norm, orthogonal, a LoRA as a parametrization, ...): the new layer
            # computes the tensor through the very same parametrizations and `original` parameters, which keep
            # their state_dict keys and the optimizer's references
            parametrize.register_parametrization(layer, tensor_name, _Carried(), unsafe=True)
            layer.parametrizations[tensor_name] = carried[tensor_name]
        else:
            setattr(layer, tensor_name, getattr(linear, tensor_name))
    layer.default_recipe = recipe
    layer.train(linear.training)
    return layer


def _convert(module: torch.nn.Module, name: str, recipe) -> torch.nn.Module:
    if _is_linear(module):
        return _swap_linear(module, name, recipe)
    if is_hf_conv1d(module):
        return Conv1DLinear.from_conv1d(module, name, recipe)
    return convert_experts(module, name, recipe)


def _embedding_weights(model: torch.nn.Module) -> Set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}


def _is_output_head(fqn: str, module: torch.nn.Module, tied: Set[int]) -> bool:
    """`lm_head` by name, or a layer whose weight is an embedding's (tied decoder)."""
    return fqn.rpartition(".")[2] == LM_HEAD_NAME or id(getattr(module, "weight", None)) in tied


def _is_embedding(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or type(module).__name__.endswith(
        ("Embedding", "Embeddings")
    )


def _weight_like(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() >= 2 and (name == "weight" or name.endswith(("_weight", "proj")))


def _unconverted_report(model: torch.nn.Module, intentional: Set[int]) -> Optional[str]:
    """One line per module type holding weights that stay in high precision without being asked to (None: none)."""
    by_type: Dict[str, List[int]] = {}
    subclasses: Set[str] = set()
    inside_tedebug: Set[int] = set()
    for module in model.modules():
        if isinstance(module, BaseLayer):
            inside_tedebug.update(id(m) for m in module.modules())
    for module in model.modules():
        if id(module) in inside_tedebug or id(module) in intentional or _is_embedding(module):
            continue
        if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
            continue  # part of an nn.MultiheadAttention, which is reported itself
        linear = isinstance(module, torch.nn.Linear)  # (one not converted: `_adds_to_linear`)
        params = [
            p for n, p in module.named_parameters(recurse=False) if _weight_like(n, p) or (linear and p.dim() > 1)
        ]
        if params:
            entry = by_type.setdefault(type(module).__name__, [0, 0])
            entry[0] += 1
            entry[1] += sum(p.numel() for p in params)
            if linear:
                subclasses.add(type(module).__name__)
    if not by_type:
        return None
    parts = [f"{name} x{count} ({numel:,} weight parameters)" for name, (count, numel) in sorted(by_type.items())]
    why = ""
    if subclasses:
        why = (
            f". {', '.join(sorted(subclasses))}: torch.nn.Linear layers with a forward or parts of their own (a "
            f"subclass's forward, a LoRA, pruning's weight_orig and mask), left as they are (converting them would "
            f"drop what they add; torch.nn.Linear layers inside them are converted)"
        )
    return (
        "tedebug.convert_model: these modules hold weights but are not converted, so their GEMMs run in high "
        "precision and are not debugged: " + "; ".join(parts) + why
    )


def convert_model(
    model: torch.nn.Module, recipe=None, filter_fn: Optional[FilterFn] = None, *, convert_lm_head: bool = False
) -> torch.nn.Module:
    """Replace every (selected) convertible layer inside `model` by a tedebug layer; returns `model`.

    `filter_fn(fqn, module) -> bool` chooses which layers to convert (default: all).  `lm_head` and layers tied to
    an embedding stay in high precision unless `convert_lm_head` is True.  A layer reachable under several paths
    is converted once (named after its first path) and the one new layer is used everywhere.  Modules with weights
    that cannot be converted are listed in one `UserWarning`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_model expects a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not callable(getattr(recipe, "make_quantizer", None)):
        raise TypeError(f"convert_model(recipe=...) expects a tedebug.recipe recipe, got {type(recipe).__name__}")
    if not isinstance(convert_lm_head, bool):
        raise TypeError(f"convert_model(convert_lm_head=...) expects a bool, got {convert_lm_head!r}")
    if _is_linear(model) or is_hf_conv1d(model):
        raise TypeError(
            "convert_model converts layers in place inside a parent module; the model itself is a single layer - "
            "wrap it (e.g. torch.nn.Sequential(model)) or use tedebug.nn.Linear directly"
        )
    tied = _embedding_weights(model)
    intentional: Set[int] = set()  # left in high precision on purpose (filter_fn, lm_head): not reported
    targets = []
    for fqn, module in model.named_modules(remove_duplicate=False):
        if not fqn or not _convertible(module):
            continue
        if (filter_fn is not None and not filter_fn(fqn, module)) or (
            not convert_lm_head and _is_output_head(fqn, module, tied)
        ):
            intentional.add(id(module))
            continue
        targets.append((fqn, module))
    lazy = [fqn for fqn, module in targets if _uninitialised_lazy(module)]
    if lazy:
        raise ValueError(
            f"convert_model: {', '.join(repr(f) for f in lazy[:8])}{' ...' if len(lazy) > 8 else ''} "
            f"{'is a lazy module' if len(lazy) == 1 else 'are lazy modules'} (torch.nn.LazyLinear) whose parameters "
            f"are not made yet: they take their input size at the first forward; run one forward, then convert"
        )
    replaced: Dict[int, torch.nn.Module] = {}
    for fqn, module in targets:
        new = replaced.get(id(module))
        if new is None:
            new = replaced[id(module)] = _convert(module, fqn, recipe)
        if new is module:
            continue  # converted in place (experts)
        parent_path, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, new)
    report = _unconverted_report(model, intentional | set(replaced))
    if report is not None:
        warnings.warn(report, UserWarning, stacklevel=2)
    bypassed = _fast_path_layers(model)
    if bypassed:
        warnings.warn(
            f"tedebug.convert_model: {bypassed} torch.nn.TransformerEncoderLayer module(s) hold converted linear1 / "
            f"linear2 layers, which PyTorch's inference fast path (eval mode without gradients) does not call: it "
            f"computes the feed-forward itself, so there they are neither quantized nor debugged. "
            f"torch.backends.mha.set_fastpath_enabled(False) turns that path off",
            UserWarning,
            stacklevel=2,
        )
    return model


def _fast_path_layers(model: torch.nn.Module) -> int:
    """How many `torch.nn.TransformerEncoderLayer` modules hold a tedebug linear1 or linear2: in eval mode without
    gradients their forward may take ``torch._transformer_encoder_layer_fwd``, which reads the weights directly."""
    return sum(
        isinstance(module, torch.nn.TransformerEncoderLayer)
        and any(isinstance(getattr(module, name, None), BaseLayer) for name in ("linear1", "linear2"))
        for module in model.modules()
    )


def prefix_layer_names(model: torch.nn.Module, prefix: str) -> List[str]:
    """Put `prefix` before the name of every tedebug layer inside `model` (itself included); returns the new names
    in module order.  A copy of a model keeps its layers' names (``copy.deepcopy``, as for an EMA model, or
    ``torch.load`` of a saved model); a copy that runs in the same debug session as the original needs names of its
    own, or the two modules' statistics are merged (the session warns).  Config sections select the copy's layers
    by these names."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prefix_layer_names expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"prefix_layer_names expects a non-empty str prefix, got {prefix!r}")
    names = []
    for module in model.modules():  # (a module reachable under several paths is renamed once)
        if isinstance(module, BaseLayer):
            module.name = prefix + module.name
            names.append(module.name)
    return names
