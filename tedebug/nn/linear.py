"""`tedebug.nn.Linear`: y = x·Wᵀ + b with quantized GEMMs inside `tedebug.autocast` (one GEMM named `name`)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from tedebug.nn import parallel
from tedebug.nn.base import BaseLayer, GemmState, resolve_dtype

__all__ = ["Linear", "init_linear_", "linear_params"]


def init_linear_(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """torch.nn.Linear's default initialisation (Kaiming-uniform weight, uniform bias)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        torch.nn.init.uniform_(bias, -bound, bound)


def linear_params(out_features: int, in_features: int, bias: bool, **kw):
    """(weight [out, in], bias [out] or None) Parameters, initialised like torch.nn.Linear (unless on "meta")."""
    weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
    b = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
    if weight.device.type != "meta":
        init_linear_(weight.data, None if b is None else b.data)
    return weight, b


class Linear(BaseLayer):
    """A linear layer whose GEMMs (fprop, dgrad, wgrad) follow the active `tedebug.autocast` recipe.

    Parameters stay in high precision (`params_dtype`, default torch's default dtype) and are initialised like
    `torch.nn.Linear`.  Outside autocast the forward equals `torch.nn.functional.linear`.

    Tensor parallelism (TE's arguments, see `tedebug.nn.parallel`): `parallel_mode="column"` holds
    `out_features / tp_size` output rows, `"row"` holds `in_features / tp_size` input columns and reduces its output
    over `tp_group`; `sequence_parallel` gathers (column) or reduce-scatters (row) along the sequence dimension 0.
    As in TE, `in_features` / `out_features` are this rank's sizes afterwards.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
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
        self.tp = parallel.TensorParallel.resolve(
            f"Linear {self.name!r}",
            tp_group=tp_group,
            tp_size=tp_size,
            parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel,
        )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        if self.tp.active and self.tp.mode == "column":
            self.out_features = self.tp.split(self.out_features, "out_features", f"Linear {self.name!r}")
        elif self.tp.active:
            self.in_features = self.tp.split(self.in_features, "in_features", f"Linear {self.name!r}")
        kw = dict(dtype=resolve_dtype(params_dtype), device=device)
        self.weight, self.bias = linear_params(self.out_features, self.in_features, bias, **kw)
        if self.tp.active and self.tp.mode == "row" and self.tp.sequence_parallel:
            parallel.mark_sequence_parallel(self.bias)  # full bias [out], its gradient from this sequence shard
        self.gemm_state = GemmState()
        parallel.configure(self.gemm_state, self.tp)

    def reset_parameters(self) -> None:
        """The constructor's initialisation again, in place (a model built on the "meta" device and materialised by
        ``to_empty``, FSDP's convention, gets its values here): torch.nn.Linear's."""
        init_linear_(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} '{self.name}': input last dim {x.shape[-1]} != in_features {self.in_features}"
            )
        return parallel.parallel_linear(
            x, self.weight, self.bias, self.gemm_state, self.name, self.active_recipe(), self.tp
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, name={self.name!r}{self.tp.describe()}"
        )
