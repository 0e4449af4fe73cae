"""Hugging Face `transformers` layers that `convert_model` turns into tedebug GEMMs (no import of transformers).

- `Conv1DLinear`: transformers' ``pytorch_utils.Conv1D`` (GPT-2, GPT: ``y = x·W + b`` with the weight stored
  ``[in, out]``) as a tedebug linear layer.  It keeps the original ``weight`` (``[in, out]``) and ``bias``
  Parameters under the same names, so ``state_dict`` keys and shapes do not change; the GEMM uses ``weightᵀ``.
- grouped experts: the expert modules of current transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  GPT-OSS, ...: classes decorated with ``use_experts_implementation``, 3-D parameters ``gate_up_proj`` or
  ``up_proj`` and ``down_proj`` of shape ``[experts, out, in]`` (``[experts, in, out]`` when ``is_transposed``),
  optional ``*_bias``).  `convert_experts` swaps the module's class for a subclass whose forward sorts the routed
  tokens by expert and runs each expert's projections as tedebug GEMMs, named ``<module>.<parameter>.gemm_<e>``
  (``model.layers.0.mlp.experts.gate_up_proj.gemm_3``), like `tedebug.nn.GroupedLinear`.  Parameters, their
  names and the module's other attributes (activation, gating, post-expert norm) stay as they are; the forward
  computes what transformers' ``batched_mm`` implementation computes, whatever ``experts_implementation`` the config
  names.  Splitting the tokens by expert needs the per-expert counts on the host (one device-to-host copy per
  experts module and forward, as every per-expert loop does).  Under delayed scaling the experts' amaxes are
  reduced once per forward and an expert without tokens still advances its state, as in `GroupedLinear`.  Older
  transformers versions keep experts as lists
  of ``nn.Linear``, which `convert_model` converts as plain Linear layers.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from tedebug.nn.base import BaseLayer, GemmState, linear_gemm, reduce_amaxes, resolve_dtype, skipped_uses
from tedebug.nn.state import register_state_hooks

__all__ = ["Conv1DLinear", "is_hf_conv1d", "is_grouped_experts", "convert_experts", "expert_projections"]


def is_hf_conv1d(module: torch.nn.Module) -> bool:
    """True for transformers' ``Conv1D`` (by class name, module and attributes; transformers is not imported)."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers")
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )


class Conv1DLinear(BaseLayer):
    """``y = x·W + b`` with ``W`` stored ``[in_features, out_features]`` (transformers' Conv1D layout); the GEMMs
    follow the active `tedebug.autocast` recipe like `tedebug.nn.Linear` (whose weight is ``Wᵀ``)."""

    def __init__(
        self, nf: int, nx: int, *, name: Optional[str] = None, params_dtype: Optional[torch.dtype] = None, device=None
    ) -> None:
        super().__init__(name)
        self.nf = int(nf)  # out features (transformers' name)
        self.nx = int(nx)  # in features
        kw = dict(dtype=resolve_dtype(params_dtype), device=device)
        self.weight = torch.nn.Parameter(torch.empty(self.nx, self.nf, **kw))
        self.bias = torch.nn.Parameter(torch.zeros(self.nf, **kw))
        if self.weight.device.type != "meta":
            torch.nn.init.normal_(self.weight, std=0.02)
        self.gemm_state = GemmState()

    @property
    def in_features(self) -> int:
        return self.nx

    @property
    def out_features(self) -> int:
        return self.nf

    @classmethod
    def from_conv1d(cls, conv: torch.nn.Module, name: str, recipe) -> "Conv1DLinear":
        """A layer sharing `conv`'s weight and bias Parameters (optimizers built before keep working)."""
        layer = cls(conv.nf, conv.nx, name=name, params_dtype=conv.weight.dtype, device="meta")
        layer.weight = conv.weight
        layer.bias = conv.bias
        layer.default_recipe = recipe
        layer.train(conv.training)
        return layer

    def reset_parameters(self) -> None:
        """The constructor's initialisation again, in place (a model built on the "meta" device and materialised by
        ``to_empty``, FSDP's convention, gets its values here): transformers' Conv1D's (normal weight of std 0.02, zero
        bias)."""
        torch.nn.init.normal_(self.weight, std=0.02)
        torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.nx:
            raise ValueError(f"Conv1DLinear '{self.name}': input last dim {x.shape[-1]} != in_features {self.nx}")
        return linear_gemm(x, self.weight.t(), self.bias, self.gemm_state, self.name, self.active_recipe())

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, name={self.name!r} (weight stored [in, out])"


# ------------------------------------------------------------------------------------------------ MoE experts
_GATED_PROJ, _UP_PROJ, _DOWN_PROJ = "gate_up_proj", "up_proj", "down_proj"


def _param3d(module: torch.nn.Module, name: str) -> bool:
    p = module._parameters.get(name) if hasattr(module, "_parameters") else None
    return isinstance(p, torch.nn.Parameter) and p.dim() == 3


def is_grouped_experts(module: torch.nn.Module) -> bool:
    """True for a transformers experts module with 3-D expert weights (``use_experts_implementation``)."""
    if isinstance(module, _GroupedExpertsMixin):
        return False
    if not all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts")):
        return False
    first = _GATED_PROJ if module.has_gate else _UP_PROJ
    return _param3d(module, first) and _param3d(module, _DOWN_PROJ)


def expert_projections(module: torch.nn.Module) -> List[str]:
    """The names of the 3-D projection parameters of an experts module, in the order the forward uses them."""
    return [_GATED_PROJ if module.has_gate else _UP_PROJ, _DOWN_PROJ]


class _GroupedExpertsMixin(BaseLayer):
    """The forward of converted experts modules (see the module docstring).  Never instantiated directly: the
    class is mixed into a subclass of the transformers class and assigned to an existing module."""

    def _expert_linear(self, proj: str, x: torch.Tensor, counts: List[int], recipe) -> torch.Tensor:
        weight3d = getattr(self, proj)
        bias2d = getattr(self, f"{proj}_bias") if self.has_bias else None
        states: List[GemmState] = self.tedebug_gemm_states[proj]
        out_dim = weight3d.shape[2] if self.is_transposed else weight3d.shape[1]
        outputs, empty = [], []
        for e, chunk in enumerate(torch.split(x, counts, dim=0)):
            if chunk.shape[0] == 0:
                empty.append(states[e])
                continue
            weight = weight3d[e].t() if self.is_transposed else weight3d[e]
            bias = None if bias2d is None else bias2d[e]
            outputs.append(
                linear_gemm(chunk, weight, bias, states[e], f"{self.name}.{proj}.gemm_{e}", recipe, reduce_amax=False)
            )
        out = torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, out_dim)
        return skipped_uses(out, empty, recipe)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        num_tokens, hidden_dim = hidden_states.shape[0], hidden_states.shape[-1]
        num_top_k = top_k_index.size(-1)
        expert_ids = top_k_index.reshape(-1)
        sample_weights = top_k_weights.reshape(-1)
        # rows sorted by expert; expert-parallel sentinels (ids >= num_experts) go last and contribute nothing
        sort_key = torch.where(expert_ids < self.num_experts, expert_ids, torch.full_like(expert_ids, self.num_experts))
        order = torch.argsort(sort_key, stable=True)
        counts_all = torch.bincount(expert_ids.clamp(max=self.num_experts), minlength=self.num_experts + 1)
        counts = [int(c) for c in counts_all.tolist()]  # the one host read: split sizes
        kept = sum(counts[: self.num_experts])
        order = order[:kept]
        token_of_row = order // num_top_k
        x = hidden_states[token_of_row]
        recipe = self.active_recipe()
        gate_proj, down_proj = expert_projections(self)
        if recipe is not None:  # one amax reduction for every expert GEMM: the same collective on every rank
            reduce_amaxes([s for proj in (gate_proj, down_proj) for s in self.tedebug_gemm_states[proj]], recipe)
        h = self._expert_linear(gate_proj, x, counts[: self.num_experts], recipe)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = self._expert_linear(down_proj, h, counts[: self.num_experts], recipe)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        h = h * sample_weights[order].unsqueeze(-1).to(h.dtype)
        out = torch.zeros(num_tokens * num_top_k, hidden_dim, dtype=h.dtype, device=h.device)
        out = out.index_copy(0, order, h)
        return out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, name={self.name!r} (tedebug grouped experts)"

    def __reduce_ex__(self, protocol):
        # pickle (``torch.save(model)``) names a class by its module and name, which a class made at conversion
        # (`_converted_class`) lacks: the copy is rebuilt from the transformers class it extends
        return _converted_instance, (type(self).transformers_class,), self.__getstate__()


def _converted_instance(cls: type) -> torch.nn.Module:
    """An empty instance of the converted class of the transformers experts class `cls` (pickle fills it)."""
    sub = _converted_class(cls)
    return sub.__new__(sub)


_SUBCLASSES: Dict[type, type] = {}


def _converted_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(
            f"Tedebug{cls.__name__}",
            (_GroupedExpertsMixin, cls),
            {"__module__": __name__, "__doc__": f"{cls.__name__} with tedebug GEMMs.", "transformers_class": cls},
        )
    return sub


def convert_experts(module: torch.nn.Module, name: str, recipe) -> torch.nn.Module:
    """Turn a transformers experts module into tedebug grouped experts in place (class swap; see the module
    docstring); returns the module."""
    if not is_grouped_experts(module):
        raise TypeError(
            f"convert_experts: {type(module).__name__} is not a transformers experts module with 3-D expert weights"
        )
    module.__class__ = _converted_class(type(module))
    module.name = name
    module.default_recipe = recipe
    module.tedebug_gemm_states = {
        proj: [GemmState() for _ in range(module.num_experts)] for proj in expert_projections(module)
    }
    register_state_hooks(module)
    return module
