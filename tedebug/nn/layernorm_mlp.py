"""`tedebug.nn.LayerNormMLP`: norm -> fc1 GEMM -> activation (high precision) -> fc2 GEMM.

The two GEMMs are debugged as layers `<name>.fc1` and `<name>.fc2`, each with its own quantizers.  Activations
follow TransformerEngine: "gelu" is the tanh approximation, "qgelu" is x·sigmoid(1.702x), "srelu" is relu(x)²; the
gated variants (`*glu`) split fc1's output (2·ffn_hidden wide) in two halves and return act(first) · second.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from tedebug.nn import parallel
from tedebug.nn.base import BaseLayer, GemmState, resolve_dtype
from tedebug.nn.layernorm_linear import check_normalization, make_norm_params, normalize, reset_norm_params
from tedebug.nn.linear import init_linear_, linear_params

__all__ = ["LayerNormMLP", "ACTIVATIONS"]

_BASE: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: F.relu(x) ** 2,
}
_GATED = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu", "qgeglu": "qgelu", "sreglu": "srelu"}
ACTIVATIONS = tuple(_BASE) + tuple(_GATED)


def apply_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name in _GATED:
        a, b = x.chunk(2, dim=-1)
        return _BASE[_GATED[name]](a) * b
    return _BASE[name](x)


class LayerNormMLP(BaseLayer):
    """Normalization, fc1 (hidden -> ffn_hidden), activation, fc2 (ffn_hidden -> hidden); TE parameter names.

    Tensor parallelism (TE's arguments): with `set_parallel_mode=True` and a `tp_group`, fc1 is column-parallel
    and fc2 row-parallel, so each rank holds `ffn_hidden_size / tp_size` hidden units (a gated activation's fc1
    holds that slice of both halves, see `tedebug.nn.parallel.shard_fc1`) and one all-reduce (sequence parallel:
    all-gather before fc1, reduce-scatter after fc2) per forward.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        *,
        name: Optional[str] = None,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        tp_group=None,
        tp_size: int = 1,
        set_parallel_mode: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(name)
        who = f"LayerNormMLP {self.name!r}"
        if not isinstance(set_parallel_mode, bool):
            raise TypeError(f"{who}: set_parallel_mode must be a bool, got {set_parallel_mode!r}")
        self.set_parallel_mode = set_parallel_mode
        mode = "column" if set_parallel_mode else None
        self.tp_fc1 = parallel.TensorParallel.resolve(
            who, tp_group=tp_group, tp_size=tp_size, parallel_mode=mode, sequence_parallel=sequence_parallel
        )
        self.tp_fc2 = parallel.TensorParallel.resolve(
            who,
            tp_group=tp_group,
            tp_size=tp_size,
            parallel_mode="row" if set_parallel_mode else None,
            sequence_parallel=sequence_parallel,
        )
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.hidden_size = int(hidden_size)
        self.ffn_hidden_size = int(ffn_hidden_size)
        self.eps = float(eps)
        self.normalization = check_normalization(normalization)
        self.activation = activation
        kw = dict(dtype=resolve_dtype(params_dtype), device=device)
        make_norm_params(self, self.hidden_size, self.normalization, kw)
        local_ffn = self.ffn_hidden_size
        if self.tp_fc1.active:
            local_ffn = self.tp_fc1.split(self.ffn_hidden_size, "ffn_hidden_size", who)
        fc1_out = local_ffn * (2 if activation in _GATED else 1)
        self.fc1_weight, self.fc1_bias = linear_params(fc1_out, self.hidden_size, bias, **kw)
        self.fc2_weight, self.fc2_bias = linear_params(self.hidden_size, local_ffn, bias, **kw)
        if self.tp_fc1.active and self.tp_fc1.sequence_parallel:
            parallel.mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias, self.fc2_bias)
        self.fc1_state = GemmState()
        self.fc2_state = GemmState()
        #: (name, "<name>.fc1", "<name>.fc2"): the debug names of the two GEMMs for the current `name`
        self._gemm_names = (None, "", "")
        parallel.configure(self.fc1_state, self.tp_fc1)
        parallel.configure(self.fc2_state, self.tp_fc2)

    def reset_parameters(self) -> None:
        """The constructor's initialisation again, in place (a model built on the "meta" device and materialised by
        ``to_empty``, FSDP's convention, gets its values here): the norm's ones and zeros, then fc1's and fc2's weight
        and bias as torch.nn.Linear's."""
        reset_norm_params(self)
        init_linear_(self.fc1_weight, self.fc1_bias)
        init_linear_(self.fc2_weight, self.fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"LayerNormMLP '{self.name}': input last dim {x.shape[-1]} != hidden_size {self.hidden_size}"
            )
        recipe = self.active_recipe()
        names = self._gemm_names
        if names[0] is not self.name:  # `name` was reassigned: the GEMM names follow (built once per name)
            names = self._gemm_names = (self.name, f"{self.name}.fc1", f"{self.name}.fc2")
        ln_out = normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        h = parallel.parallel_linear(
            ln_out, self.fc1_weight, self.fc1_bias, self.fc1_state, names[1], recipe, self.tp_fc1
        )
        h = apply_activation(self.activation, h)
        return parallel.parallel_linear(
            h, self.fc2_weight, self.fc2_bias, self.fc2_state, names[2], recipe, self.tp_fc2
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, normalization={self.normalization}, name={self.name!r}"
            + (f", set_parallel_mode=True, tp_size={self.tp_fc1.size}" if self.tp_fc1.active else "")
            + (", sequence_parallel=True" if self.tp_fc1.active and self.tp_fc1.sequence_parallel else "")
        )
