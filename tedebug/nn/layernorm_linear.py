"""`tedebug.nn.LayerNormLinear`: LayerNorm/RMSNorm in high precision, then one quantized linear GEMM (`name`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tedebug.nn import parallel
from tedebug.nn.base import BaseLayer, GemmState, resolve_dtype
from tedebug.nn.linear import init_linear_, linear_params

__all__ = ["LayerNormLinear", "NORMALIZATIONS", "normalize"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    return normalization


def normalize(x, normalization: str, weight, bias, eps: float) -> torch.Tensor:
    """LayerNorm (with bias) or RMSNorm (no bias) over the last dim, in x's dtype."""
    shape = (x.shape[-1],)
    dtype = x.dtype
    if weight.dtype != dtype:  # (compared first: a `.to` call costs host time even when it returns its input)
        weight = weight.to(dtype)
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, weight, bias if bias.dtype == dtype else bias.to(dtype), eps)
    return F.rms_norm(x, shape, weight, eps)


def make_norm_params(module: torch.nn.Module, hidden: int, normalization: str, kw: dict) -> None:
    """`layer_norm_weight` (ones) and, for LayerNorm, `layer_norm_bias` (zeros) - TE's parameter names."""
    module.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden, **kw))
    if normalization == "LayerNorm":
        module.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden, **kw))
    else:
        module.register_parameter("layer_norm_bias", None)


def reset_norm_params(module: torch.nn.Module) -> None:
    """`make_norm_params`' values again, in place."""
    torch.nn.init.ones_(module.layer_norm_weight)
    if module.layer_norm_bias is not None:
        torch.nn.init.zeros_(module.layer_norm_bias)


class LayerNormLinear(BaseLayer):
    """Normalization (high precision) followed by a linear layer with quantized GEMMs (see `tedebug.nn.Linear`).

    Tensor parallelism as in `tedebug.nn.Linear`; the normalization always sees the whole hidden dimension: with
    `sequence_parallel` it runs on this rank's sequence shard before the gather (its weights are then marked
    ``sequence_parallel``); in `"row"` mode the layer takes the whole input and multiplies its slice of the
    normalized input with its weight columns.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        *,
        name: Optional[str] = None,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        tp_group=None,
        tp_size: int = 1,
        parallel_mode: Optional[str] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(name)
        who = f"LayerNormLinear {self.name!r}"
        self.tp = parallel.TensorParallel.resolve(
            who, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode, sequence_parallel=sequence_parallel
        )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.eps = float(eps)
        self.normalization = check_normalization(normalization)
        kw = dict(dtype=resolve_dtype(params_dtype), device=device)
        make_norm_params(self, self.in_features, self.normalization, kw)
        gemm_in, gemm_out = self.in_features, self.out_features
        if self.tp.active and self.tp.mode == "column":
            gemm_out = self.out_features = self.tp.split(self.out_features, "out_features", who)
        elif self.tp.active:
            gemm_in = self.tp.split(self.in_features, "in_features", who)
        self.weight, self.bias = linear_params(gemm_out, gemm_in, bias, **kw)
        if self.tp.active and self.tp.sequence_parallel:
            parallel.mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)
            if self.tp.mode == "row":
                parallel.mark_sequence_parallel(self.bias)
        self.gemm_state = GemmState()
        parallel.configure(self.gemm_state, self.tp)

    def reset_parameters(self) -> None:
        """The constructor's initialisation again, in place (a model built on the "meta" device and materialised by
        ``to_empty``, FSDP's convention, gets its values here): the norm's ones and zeros, torch.nn.Linear's weight and
        bias."""
        reset_norm_params(self)
        init_linear_(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"LayerNormLinear '{self.name}': input last dim {x.shape[-1]} != in_features {self.in_features}"
            )
        ln_out = normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return parallel.parallel_linear(
            ln_out, self.weight, self.bias, self.gemm_state, self.name, self.active_recipe(), self.tp, input_whole=True
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"normalization={self.normalization}, bias={self.bias is not None}, name={self.name!r}"
            f"{self.tp.describe()}"
        )
