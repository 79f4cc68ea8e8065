"""DeepSeek MoE: router + routed experts (EP) + shared experts."""

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state
from spmoe.distributed.communicator import ExpertRows
from spmoe.distributed.layer_plan import LayerPlan
from spmoe.layers.mlp import MLP
from spmoe.layers.moe.dispatch import DISPATCH
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.moe.router import Router
from spmoe.layers.moe.work import record_dispatched, run_experts


class MoE(nn.Module):
    """Routed experts are split over the EP group (all DP x TP ranks). The layer plan fixes the layout at build
    time (N: this DP rank's tokens, t: the TP size, n = ceil(N/t)):

    - SP (`plan.use_sequence_parallel_moe`): input SHARDED `[n, H]`; pad rows get no experts; dispatch and
      combine over the EP group with `ep_backend`, so each token is dispatched once; the shared expert is
      replicated; output complete SHARDED `[n, H]`.
    - not SP, DP = 1: input FULL `[N, H]`, the same on every rank, and the EP group is the TP group: each rank
      runs its experts on all N tokens, no dispatch; with the TP-sharded shared expert, output PARTIAL.
    - not SP, DP > 1: the experts live across DP groups, so every TP rank dispatches its group's N tokens (the
      same tokens t times: the duplication SP removes) and gets the complete routed output back; one TP rank
      keeps it (`ExpertRows.keep_output`), so the output is again PARTIAL.
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, experts: type[Experts], ep_backend: str):
        super().__init__()
        state = get_parallel_state()
        per_rank = cfg.n_routed_experts // state.ep_size
        if plan.use_sequence_parallel_moe and experts.routes_internally:
            raise ValueError(
                f"experts backend {experts.name} routes inside its kernel, which SP layers cannot use"
            )
        self.dispatch = DISPATCH[ep_backend]
        self.gate = Router(cfg)
        self.experts = experts(cfg, state.ep_rank * per_rank, per_rank)
        shared_tp = 1 if plan.use_sequence_parallel_moe else state.tp_size
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, shared_tp)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """x SHARDED `[n, H]` (SP) or FULL `[N, H]` -> `[n, H]` complete or `[N, H]` PARTIAL; `rows` from the
        layer's communicator."""
        if self.experts.routes_internally:
            out = self.experts(x, self.gate)
        else:
            ids, weights = self.gate(x, rows.valid)
            if rows.group is None:
                out = run_experts(self.experts, x, ids, weights)
            else:
                record_dispatched(rows.valid)
                out = self.dispatch(x, ids, weights, self.experts, rows.group, rows.rows_max)
                if (
                    not rows.keep_output
                ):  # a TP peer holds the same complete output; keep one copy -> PARTIAL
                    out = torch.zeros_like(out)
        return (
            out if self.shared_experts is None else self.shared_experts(x, out=out)
        )  # added by its GEMM
