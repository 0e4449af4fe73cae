"""Delayed-scaling state of tedebug layers in `state_dict`, and its amax reduction across data-parallel ranks.

State dict: a layer whose GEMMs hold delayed-scaling quantizers (`tedebug.recipe.DelayedScaling`) adds three tensors per
quantizer, ``<prefix>tedebug_fp8_state.<gemm>.<role>.<leaf>.scale``, ``.amax_history`` and ``.used`` (copies of the
quantizer's state; ``used``, a bool, says whether the role was used, so that a resumed run rolls the history before its
next use exactly as the uninterrupted run would). Tensors only, so that every state dict consumer takes them:
safetensors (transformers' ``save_pretrained``), distributed checkpoints. The nested dict of the format before (one
``<prefix>tedebug_fp8_state`` entry) still loads. A layer without such state adds nothing, so models trained with other
recipes (or not at all) keep exactly their keys; but a layer whose default recipe (``convert_model(model, recipe=...)``)
is delayed scaling has them before its first forward too, its quantizers made for it. A distributed checkpoint
(``torch.distributed.checkpoint``) loads only the keys of the state dict it loads into, so the model it resumes must
have the entries: by that default recipe, or by `init_recipe_state(model, recipe)`. Loading takes the entries out of the
state dict before torch checks the keys, so a checkpoint without them loads (the state starts fresh) and one with them
loads into a layer whose quantizers are not built yet (the state is applied when they are, at the first forward under
delayed scaling). A history of another length is not applied: a warning says so and the state starts fresh.

Amax reduction (`reduce_amax`, TransformerEngine's ``reduce_amax``): at the start of each layer forward (not in an
activation recompute) the current amaxes (history row 0) of all the layer's delayed quantizers are all-reduced with MAX
over the default process group, in one collective, when torch.distributed runs more than one rank; the history rolls
(and the scale is derived) at the next use, so every data-parallel rank derives the same scales (as from one big batch).
Grouped layers (`GroupedLinear`, MoE experts) reduce all their experts' amaxes once per forward, and an expert that gets
no rows on a rank still advances its state (`GemmState.skip_use`), so the collectives and the histories stay the same on
every rank whatever the routing.
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterator, List, Tuple

import torch

__all__ = [
    "STATE_KEY",
    "init_recipe_state",
    "named_gemm_states",
    "register_state_hooks",
    "several_ranks",
    "all_reduce_max",
]

STATE_KEY = "tedebug_fp8_state"


def named_gemm_states(module: torch.nn.Module) -> Iterator[Tuple[str, object]]:
    """``(name, GemmState)`` of a tedebug layer: attributes holding a GemmState, a list of them or a dict of lists."""
    from tedebug.nn.base import GemmState

    for attr, value in vars(module).items():
        if isinstance(value, GemmState):
            yield attr, value
        elif isinstance(value, list) and value and all(isinstance(v, GemmState) for v in value):
            for i, state in enumerate(value):
                yield f"{attr}.{i}", state
        elif isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            for key, states in value.items():
                for i, state in enumerate(states):
                    if isinstance(state, GemmState):
                        yield f"{attr}.{key}.{i}", state


#: the tensors of one saved delayed-scaling state, each under ``<prefix>tedebug_fp8_state.<gemm>.<role>.<leaf>.<field>``
_FIELDS = ("scale", "amax_history", "used")


def _state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    recipe = getattr(module, "default_recipe", None)
    delayed_default = recipe is not None and getattr(recipe, "delayed", lambda: False)()
    for name, state in named_gemm_states(module):
        if delayed_default and state.recipe is None:  # (the module docstring: a layer with a delayed default recipe)
            state.plan(recipe)
        for key, entry in state.delayed_state().items():
            base = f"{prefix}{STATE_KEY}.{name}.{key}."
            state_dict[base + "scale"] = entry["scale"]
            state_dict[base + "amax_history"] = entry["amax_history"]
            state_dict[base + "used"] = torch.as_tensor(entry["used"], dtype=torch.bool)


def _saved_entries(state_dict, prefix: str, error_msgs: List[str]) -> Dict[str, dict]:
    """``"<gemm>.<role>.<leaf>" -> {field: value}`` taken out of `state_dict`: the flat keys, and the one nested
    dict of the format before them (``<prefix>tedebug_fp8_state``)."""
    entries: Dict[str, dict] = {}
    nested = state_dict.pop(prefix + STATE_KEY, None)
    if nested is not None:
        if isinstance(nested, dict):
            entries.update({key: dict(entry) for key, entry in nested.items()})
        else:
            error_msgs.append(
                f"{prefix}{STATE_KEY}: expected a dict of delayed-scaling states, got {type(nested).__name__}"
            )
    start = prefix + STATE_KEY + "."
    for full_key in [k for k in state_dict if k.startswith(start)]:
        key, _, field = full_key[len(start) :].rpartition(".")
        value = state_dict.pop(full_key)
        if field not in _FIELDS or not key:
            error_msgs.append(f"{full_key}: not a delayed-scaling state (expected <gemm>.<role>.<leaf>.{_FIELDS})")
            continue
        entries.setdefault(key, {})[field] = value
    return entries


def _load_pre_hook(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    entries = _saved_entries(state_dict, prefix, error_msgs)
    if not entries:
        return
    by_state = dict(named_gemm_states(module))
    for key, entry in entries.items():
        where = f"{prefix}{STATE_KEY}.{key}"
        missing = [field for field in ("scale", "amax_history") if field not in entry]
        if missing:
            error_msgs.append(f"{where}: the saved state has no {' and no '.join(missing)}")
            continue
        name, _, rest = key.rpartition(".")  # rest = leaf index; name = "<gemm>.<role>"
        gemm, _, role = name.rpartition(".")
        state = by_state.get(gemm)
        if state is None or not rest.isdigit():
            error_msgs.append(f"{where}: no GEMM {gemm!r} in {type(module).__name__} (GEMMs: {sorted(by_state)})")
            continue
        if "used" in entry:
            entry["used"] = bool(entry["used"])
        state.load_delayed_state(role, int(rest), entry, where=where)


def init_recipe_state(model: torch.nn.Module, recipe) -> int:
    """Make the quantizers of `recipe` in every GEMM of every tedebug layer inside `model` now, as a first forward
    under `recipe` would; a GEMM that already has quantizers keeps them.  Under `DelayedScaling` the layers'
    state_dict then holds their delayed-scaling entries, which a distributed checkpoint (torch.distributed.checkpoint)
    needs in the state dict it loads into: it loads only the keys that one has.  Returns the number of GEMMs made."""
    from tedebug.nn.base import BaseLayer

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"init_recipe_state expects a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(recipe, "make_quantizer", None)):
        raise TypeError(f"init_recipe_state expects a tedebug.recipe recipe, got {type(recipe).__name__}")
    made = 0
    for module in model.modules():
        if isinstance(module, BaseLayer):
            for _, state in named_gemm_states(module):
                if state.recipe is None:
                    state.plan(recipe)
                    made += 1
    return made


def register_state_hooks(module: torch.nn.Module) -> None:
    """Save / load the delayed-scaling state of `module`'s GEMMs with its state_dict (see the module docstring)."""
    if getattr(module, "_tedebug_state_hooks", False):
        return
    module.register_state_dict_post_hook(_state_dict_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)
    module._tedebug_state_hooks = True


def check_history(where: str, have: torch.Tensor, got: torch.Tensor) -> bool:
    if have.numel() != got.numel():
        warnings.warn(
            f"{where}: amax history of length {got.numel()} does not fit the layer's history length "
            f"{have.numel()}; the delayed-scaling state starts fresh",
            UserWarning,
            stacklevel=4,
        )
        return False
    return True


def several_ranks() -> bool:
    """True when torch.distributed is initialised with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_max(rows: List[torch.Tensor]) -> None:
    """MAX-reduce `rows` (1-element amax views) in place over the default process group, as one collective (no-op
    with one rank or without torch.distributed)."""
    import torch.distributed as dist

    if not rows or not several_ranks():
        return
    flat = torch.cat([r.reshape(1).float() for r in rows])
    if dist.get_backend() == "nccl" and flat.device.type != "cuda":
        flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    flat = flat.to(rows[0].device)
    for i, row in enumerate(rows):
        row.copy_(flat[i : i + 1].reshape(row.shape))
