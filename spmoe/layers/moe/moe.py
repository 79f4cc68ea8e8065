"""DeepSeek MoE: router + routed experts (EP) + shared experts."""

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state
from spmoe.distributed.communicator import ExpertRows
from spmoe.distributed.layer_plan import LayerPlan
from spmoe.distributed.simulated import (
    block_tokens,
    is_simulated,
    rotate_to_busiest,
    seeded_routing,
)
from spmoe.layers.fused import use_fused
from spmoe.layers.mlp import MLP
from spmoe.layers.moe.dispatch import DISPATCH
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.moe.router import Router
from spmoe.layers.moe.work import record_dispatched, run_experts


class MoE(nn.Module):
    """Routed experts are split over the EP group (all DP x TP ranks). The layer plan fixes the
    layout at build time (N: this DP rank's tokens, t: the TP size, n = ceil(N/t)):

    - SP (`plan.use_sequence_parallel_moe`): input SHARDED `[n, H]`; pad rows get no experts;
      dispatch and combine over the EP group with `ep_backend`, so each token is dispatched once;
      the shared expert is replicated; output complete SHARDED `[n, H]`.
    - not SP, DP = 1: input FULL `[N, H]`, the same on every rank, and the EP group is the TP group:
      each rank runs its experts on all N tokens, no dispatch; with the TP-sharded shared expert,
      output PARTIAL.
    - not SP, DP > 1: the experts live across DP groups, so every TP rank dispatches its group's N
      tokens (the same tokens t times: the duplication SP removes) and gets the complete routed
      output back; one TP rank keeps it (`ExpertRows.keep_output`), so the output is again PARTIAL.

    With the parallel config's `seeded_routing` (the simulated rank; tests) the gate is not used:
    the top-k is a seeded function of (layer, global token) (`simulated.seeded_routing`). On a
    simulated EP group the dispatch gets every rank's block of routing, the rows the real
    node would gather.
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, experts: type[Experts], ep_backend: str):
        super().__init__()
        state = get_parallel_state()
        routing_seed = state.config.seeded_routing
        per_rank = cfg.n_routed_experts // state.ep_size
        if plan.use_sequence_parallel_moe and experts.routes_internally:
            raise ValueError(
                f"experts backend {experts.name} routes inside its kernel, which SP "
                "layers cannot use"
            )
        if routing_seed is not None and experts.routes_internally:
            raise ValueError(
                f"experts backend {experts.name} routes inside its kernel; seeded routing (the "
                f"simulated rank) needs experts that take the routing"
            )
        self.layer_idx, self.routing_seed = plan.layer_idx, routing_seed
        self.busiest = state.config.simulated_load == "busiest"
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
        """x SHARDED `[n, H]` (SP) or FULL `[N, H]` -> `[n, H]` complete or `[N, H]` PARTIAL; `rows`
        from the layer's communicator."""
        if self.experts.routes_internally:
            out = self.experts(x, self.gate)
        else:
            ids, weights = self.gate(x, rows.valid)  # seeded: run for its cost, choice replaced
            node = None
            if self.routing_seed is not None:
                ids, weights, node = self._seeded(x, rows)
            if rows.group is None:
                out = run_experts(self.experts, x, ids, weights)
            else:
                record_dispatched(rows.valid)
                out = self.dispatch(x, ids, weights, self.experts, rows.group, rows.rows_max, node)
                # a TP peer holds the same complete output; keep one copy -> PARTIAL
                if not rows.keep_output:
                    out = torch.zeros_like(out)
        # added by its GEMM
        return out if self.shared_experts is None else self.shared_experts(x, out=out)

    def _seeded(self, x: torch.Tensor, rows: ExpertRows):
        """Seeded routing of every EP rank's block -> (this rank's ids, weights `[m, k]`; on a
        simulated EP group every block's ids and weights `[P * rows_max, k]`, else None). On CUDA
        one or two Triton launches (`seeded_triton`), else the torch reference."""
        state, cfg = get_parallel_state(), self.gate.cfg
        ep = 1 if rows.group is None else state.ep_size
        blocks = (rows.tokens, rows.sharded, state.tp_size, ep, state.dp_rank)
        block = rows.rows_max if rows.group is not None else x.shape[0]
        seed, layer = self.routing_seed, self.layer_idx
        choice = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        busiest_ep = state.ep_size if self.busiest else None
        if use_fused(x):
            from spmoe.layers.moe.seeded_triton import seeded_routing as seeded_routing_fused

            ids, weights = seeded_routing_fused(
                seed, layer, blocks, block, *choice, x.device, busiest_ep
            )
        else:
            starts, valid = block_tokens(*blocks, x.device)
            ids, weights = seeded_routing(seed, layer, starts, valid, block, *choice)
            if busiest_ep is not None:
                ids = rotate_to_busiest(ids, busiest_ep, cfg.n_routed_experts)
        own = (state.ep_rank if rows.group is not None else 0) * block
        node = (ids, weights) if is_simulated(rows.group) else None
        return ids[own : own + x.shape[0]], weights[own : own + x.shape[0]], node
