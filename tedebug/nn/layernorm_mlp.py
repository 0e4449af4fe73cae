"""`tedebug.nn.LayerNormMLP`: norm -> fc1 GEMM -> activation (high precision) -> fc2 GEMM.

The two GEMMs are debugged as layers `<name>.fc1` and `<name>.fc2`, each with its own quantizers.  Activations
follow TransformerEngine: "gelu" is the tanh approximation, "qgelu" is x·sigmoid(1.702x), "srelu" is relu(x)²; the
gated variants (`*glu`) split fc1's output (2·ffn_hidden wide) in two halves and return act(first) · second.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from tedebug.nn.base import BaseLayer, GemmState, linear_gemm, resolve_dtype
from tedebug.nn.layernorm_linear import check_normalization, make_norm_params, normalize
from tedebug.nn.linear import linear_params

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
    """Normalization, fc1 (hidden -> ffn_hidden), activation, fc2 (ffn_hidden -> hidden); TE parameter names."""

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
    ) -> None:
        super().__init__(name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.hidden_size = int(hidden_size)
        self.ffn_hidden_size = int(ffn_hidden_size)
        self.eps = float(eps)
        self.normalization = check_normalization(normalization)
        self.activation = activation
        kw = dict(dtype=resolve_dtype(params_dtype), device=device)
        make_norm_params(self, self.hidden_size, self.normalization, kw)
        fc1_out = self.ffn_hidden_size * (2 if activation in _GATED else 1)
        self.fc1_weight, self.fc1_bias = linear_params(fc1_out, self.hidden_size, bias, **kw)
        self.fc2_weight, self.fc2_bias = linear_params(self.hidden_size, self.ffn_hidden_size, bias, **kw)
        self.fc1_state = GemmState()
        self.fc2_state = GemmState()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"LayerNormMLP '{self.name}': input last dim {x.shape[-1]} != hidden_size {self.hidden_size}"
            )
        recipe = self.active_recipe()
        ln_out = normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        h = linear_gemm(ln_out, self.fc1_weight, self.fc1_bias, self.fc1_state, f"{self.name}.fc1", recipe)
        h = apply_activation(self.activation, h)
        return linear_gemm(h, self.fc2_weight, self.fc2_bias, self.fc2_state, f"{self.name}.fc2", recipe)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}, name={self.name!r}")
