"""DeepSeek MoE: router + routed experts (EP) + shared experts."""

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state, shard_rows
from spmoe.layers.mlp import MLP
from spmoe.layers.moe.dispatch import DISPATCH
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.moe.router import Router


class MoE(nn.Module):
    """Routed experts are split over the EP group; the layout is fixed at build time by `sequence_parallel`:

    - False: input FULL `[N, H]` (same on every rank); each rank runs its experts on all N tokens and the
      TP-sharded shared expert; output PARTIAL `[N, H]`.
    - True: input SHARDED `[n, H]`; pad rows get no experts; dispatch/combine over the EP group with
      `ep_backend`; the shared expert is replicated; output complete SHARDED `[n, H]`.
    """

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, experts: type[Experts], ep_backend: str):
        super().__init__()
        state = get_parallel_state()
        per_rank = cfg.n_routed_experts // state.ep_size
        if sequence_parallel and experts.routes_internally:
            raise ValueError(f"experts backend {experts.name} routes inside its kernel, which SP layers cannot use")
        self.sequence_parallel = sequence_parallel
        self.dispatch = DISPATCH[ep_backend]
        self.gate = Router(cfg)
        self.experts = experts(cfg, state.ep_rank * per_rank, per_rank)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   1 if sequence_parallel else state.tp_size) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        state = get_parallel_state()
        if self.sequence_parallel:
            n = shard_rows(num_tokens, state.tp_size)
            valid = torch.arange(state.tp_rank * n, (state.tp_rank + 1) * n, device=x.device) < num_tokens
            ids, weights = self.gate(x, valid)
            out = self.dispatch(x, ids, weights, self.experts, state.ep_group)
        elif self.experts.routes_internally:
            out = self.experts(x, self.gate)
        else:
            ids, weights = self.gate(x, torch.ones(x.shape[0], dtype=torch.bool, device=x.device))
            out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)
