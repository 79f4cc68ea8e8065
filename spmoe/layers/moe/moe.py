"""DeepSeek MoE: router + routed experts (EP) + shared experts."""

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state, shard_rows
from spmoe.distributed.layout import check_rows
from spmoe.layers.mlp import MLP
from spmoe.layers.moe.dispatch import DISPATCH
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.moe.router import Router
from spmoe.layers.moe.work import record_dispatched, run_experts


class MoE(nn.Module):
    """Routed experts are split over the EP group (all DP x TP ranks); the layout is fixed at build time by
    `sequence_parallel`. N is this DP rank's token count, t the TP size:

    - True: input SHARDED `[n, H]`, n = ceil(N / t); pad rows get no experts; dispatch / combine over the
      EP group with `ep_backend`, so each token is dispatched once; the shared expert is replicated; output
      complete SHARDED `[n, H]`.
    - False, DP = 1: input FULL `[N, H]`, the same on every rank, and the EP group is the TP group: each rank
      runs its experts on all N tokens, no dispatch; with the TP-sharded shared expert, output PARTIAL.
    - False, DP > 1: the experts live across DP groups, so every TP rank dispatches its group's N tokens (the
      same tokens t times: the duplication SP removes); only TP rank 0 keeps the complete routed output, so
      the output is again PARTIAL.
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

    def forward(self, x: torch.Tensor, num_tokens: int, max_tokens: int) -> torch.Tensor:
        """x SHARDED `[n, H]` (SP) or FULL `[N, H]`; num_tokens: N; max_tokens: the largest N over DP ranks."""
        state = get_parallel_state()
        if self.sequence_parallel:
            n = shard_rows(num_tokens, state.tp_size)
            check_rows(x, n, f"SP MoE input (N={num_tokens}, t={state.tp_size})")
            valid_rows = min(n, max(0, num_tokens - state.tp_rank * n))  # pad rows sit at the tail
            ids, weights = self.gate(x, valid_rows)
            record_dispatched(valid_rows)
            out = self.dispatch(x, ids, weights, self.experts, state.ep_group, shard_rows(max_tokens, state.tp_size))
        elif self.experts.routes_internally:
            out = self.experts(x, self.gate)
        elif state.dp_size > 1:
            ids, weights = self.gate(x, x.shape[0])
            record_dispatched(num_tokens)
            out = self.dispatch(x, ids, weights, self.experts, state.ep_group, max_tokens)
            if state.tp_rank:  # every TP rank holds the same complete output; keep one copy -> PARTIAL
                out = torch.zeros_like(out)
        else:
            ids, weights = self.gate(x, x.shape[0])
            out = run_experts(self.experts, x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)
