"""`tedebug.nn.GroupedLinear`: one linear layer per expert over row splits of the input (MoE style).

`forward(x, m_splits)` flattens x to ``(-1, in)`` (like TransformerEngine: leading dims are token dims, the
output gets them back) and splits it along dim 0; rows of split i go through expert i's weight
(``weight<i>``, ``bias<i>``: TE's parameter names).  Each expert GEMM is debugged as layer `<name>.gemm_<i>` with its
own quantizers.  An empty split produces an empty output block (and zero gradients for that expert); under delayed
scaling its
state still advances (`GemmState.skip_use`) and the amaxes of all GEMMs are reduced once per forward
(`reduce_amax`), so data-parallel ranks stay in step whatever their splits.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from tedebug.nn import parallel
from tedebug.nn.base import BaseLayer, GemmState, linear_gemm, reduce_amaxes, resolve_dtype, skipped_uses
from tedebug.nn.linear import init_linear_, linear_params

__all__ = ["GroupedLinear"]


class GroupedLinear(BaseLayer):
    """`num_gemms` independent linear layers applied to consecutive row blocks of one input.

    Tensor parallelism (TE's arguments `tp_group`, `tp_size`, `parallel_mode`): every expert is split like a
    `tedebug.nn.Linear` (column: `out_features / tp_size` rows; row: `in_features / tp_size` columns, one
    all-reduce of the whole output, then each expert's full bias).  `sequence_parallel` is not supported (the
    token rows of the experts are not a sequence dimension): it is an error.
    """

    def __init__(
        self,
        num_gemms: int,
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
        who = f"GroupedLinear {self.name!r}"
        if sequence_parallel:
            raise ValueError(f"{who}: sequence_parallel is not supported for grouped (MoE) GEMMs")
        self.tp = parallel.TensorParallel.resolve(who, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode)
        if int(num_gemms) < 1:
            raise ValueError(f"GroupedLinear: num_gemms must be >= 1, got {num_gemms}")
        self.num_gemms = int(num_gemms)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.use_bias = bool(bias)
        if self.tp.active and self.tp.mode == "column":
            self.out_features = self.tp.split(self.out_features, "out_features", who)
        elif self.tp.active:
            self.in_features = self.tp.split(self.in_features, "in_features", who)
        kw = dict(dtype=resolve_dtype(params_dtype), device=device)
        for i in range(self.num_gemms):
            weight, b = linear_params(self.out_features, self.in_features, bias, **kw)
            self.register_parameter(f"weight{i}", weight)
            self.register_parameter(f"bias{i}", b)
        self.gemm_states: List[GemmState] = [GemmState() for _ in range(self.num_gemms)]
        for state in self.gemm_states:
            parallel.configure(state, self.tp)

    def reset_parameters(self) -> None:
        """The constructor's initialisation again, in place (a model built on the "meta" device and materialised by
        ``to_empty``, FSDP's convention, gets its values here): each GEMM's weight and bias as torch.nn.Linear's, in
        order."""
        for i in range(self.num_gemms):
            init_linear_(getattr(self, f"weight{i}"), getattr(self, f"bias{i}"))

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        m_splits = [int(m) for m in m_splits]
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear '{self.name}': got {len(m_splits)} m_splits for {self.num_gemms} GEMMs")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"GroupedLinear '{self.name}': input must be [..., {self.in_features}] with sum(m_splits) rows "
                f"in total, got {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if any(m < 0 for m in m_splits) or sum(m_splits) != x.shape[0]:
            raise ValueError(
                f"GroupedLinear '{self.name}': m_splits {m_splits} do not sum to {x.shape[0]} rows "
                f"(input {tuple(lead) + (self.in_features,)} flattened to (-1, {self.in_features}))"
            )
        recipe = self.active_recipe()
        if recipe is not None:
            reduce_amaxes(self.gemm_states, recipe)  # once for all GEMMs: the same collective on every rank
        row = self.tp.active and self.tp.mode == "row"
        x = parallel.column_input(x, self.tp)
        outputs, empty = [], []
        for i, chunk in enumerate(torch.split(x, m_splits, dim=0)):
            weight, bias = getattr(self, f"weight{i}"), (None if row else getattr(self, f"bias{i}"))
            if chunk.shape[0] == 0:
                outputs.append(torch.nn.functional.linear(chunk, weight, bias))
                empty.append(self.gemm_states[i])
                continue
            outputs.append(
                linear_gemm(
                    chunk, weight, bias, self.gemm_states[i], f"{self.name}.gemm_{i}", recipe, reduce_amax=False
                )
            )
        y = skipped_uses(torch.cat(outputs, dim=0), empty, recipe)
        if row:
            y = parallel.reduce_from_tp(y, self.tp.group)
            if self.use_bias:
                y = y + torch.cat([getattr(self, f"bias{i}").to(y.dtype).expand(m, -1) for i, m in enumerate(m_splits)])
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, name={self.name!r}{self.tp.describe()}"
        )
