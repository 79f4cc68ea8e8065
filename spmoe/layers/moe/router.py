"""The DeepSeek router: sigmoid scores, bias-corrected (grouped) top-k selection,
renormalised weights.

On CUDA the float32 logits come from a Triton GEMV for a few rows (`fused_triton.router_logit_sums`)
and everything after them runs as one Triton kernel (`fused_triton.route`); the torch code here is
the reference. Where tied choice scores straddle the k-th place, the kernel keeps the
lowest expert ids."""

import torch
import torch.nn.functional as F
from torch import nn

from spmoe.config import ModelConfig
from spmoe.layers.fused import use_fused


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32)
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor, valid_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[m, H]`, of which the first `valid_rows` are tokens -> (ids `[m, k]` int64, weights
        `[m, k]` float32).

        The correction bias only chooses experts; the weights are the raw sigmoid scores. The rows
        after `valid_rows` (SP pad rows, always at the tail) get id -1 and weight 0: no expert
        ever sees them.
        """
        cfg = self.cfg
        if use_fused(x):
            from spmoe.layers.fused_triton import route, router_logit_sums

            return route(
                router_logit_sums(x, self.weight),
                self.e_score_correction_bias,
                valid_rows,
                cfg.n_group,
                cfg.topk_group,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            )
        logits = F.linear(x.float(), self.weight.float())  # [m, E]
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [m, groups]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        if valid_rows < x.shape[0]:
            ids[valid_rows:], weights[valid_rows:] = -1, 0.0
        return ids, weights
