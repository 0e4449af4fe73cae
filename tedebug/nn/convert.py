"""`convert_model`: swap the `torch.nn.Linear` layers of any model for `tedebug.nn.Linear`, in place.

The new layers share the original weight and bias `Parameter` objects (optimizers built before the swap keep
working), take their debug names from the module paths (``"blocks.0.attn.proj"``) and keep the train/eval mode.
`recipe`, when given, becomes the converted layers' ``default_recipe``: inside ``tedebug.autocast()`` blocks that
name no recipe they use it; an ``autocast(recipe=...)`` still wins; outside autocast they run in high precision.
Not converted: modules whose forward never runs (``nn.MultiheadAttention.out_proj``, a
``NonDynamicallyQuantizableLinear`` whose weight is read directly) and layers that already are tedebug layers.
Forward/backward hooks registered on an original Linear are not carried over.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from tedebug.nn.base import BaseLayer
from tedebug.nn.linear import Linear

__all__ = ["convert_model"]

FilterFn = Callable[[str, torch.nn.Module], bool]


def _convertible(module: torch.nn.Module) -> bool:
    if isinstance(module, BaseLayer) or not isinstance(module, torch.nn.Linear):
        return False
    return not isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)


def _swap(linear: torch.nn.Linear, name: str, recipe) -> Linear:
    layer = Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, name=name,
                   params_dtype=linear.weight.dtype, device="meta")
    layer.weight = linear.weight
    layer.bias = linear.bias
    layer.default_recipe = recipe
    layer.train(linear.training)
    return layer


def convert_model(model: torch.nn.Module, recipe=None, filter_fn: Optional[FilterFn] = None) -> torch.nn.Module:
    """Replace every (selected) `torch.nn.Linear` inside `model` by a `tedebug.nn.Linear`; returns `model`.

    `filter_fn(fqn, module) -> bool` chooses which Linear layers to convert (default: all).  A Linear reachable
    under several paths is converted once (named after its first path) and the one new layer is used everywhere.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_model expects a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not callable(getattr(recipe, "make_quantizer", None)):
        raise TypeError(f"convert_model(recipe=...) expects a tedebug.recipe recipe, got {type(recipe).__name__}")
    if _convertible(model):
        raise TypeError(
            "convert_model converts Linear layers in place inside a parent module; the model itself is a "
            "torch.nn.Linear - wrap it (e.g. torch.nn.Sequential(model)) or use tedebug.nn.Linear directly"
        )
    targets = [
        (fqn, module) for fqn, module in model.named_modules(remove_duplicate=False)
        if fqn and _convertible(module) and (filter_fn is None or filter_fn(fqn, module))
    ]
    replaced: Dict[int, Linear] = {}
    for fqn, module in targets:
        new = replaced.get(id(module))
        if new is None:
            new = replaced[id(module)] = _swap(module, fqn, recipe)
        parent_path, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, new)
    return model
