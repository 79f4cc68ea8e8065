"""One DeepSeek-V3.2 / GLM-5.2 decoder layer, and the flat batch it attends over.

Notation: N tokens in the flat batch, t = TP size, n = ceil(N/t) rows per rank, H = hidden size.

The layer's `LayerPlan` (`spmoe.distributed.layer_plan`) declares, when the model is built, the
layout its input arrives in and whether its norms and MLP run on the token shard
(`use_sequence_parallel_moe`); its `LayerCommunicator` performs every layout change. The forward
never looks at a shape to decide a layout: the communicator checks the shape against the declared
layout and raises on a mismatch.

    norm (+ transition to FULL)  -> attention FULL [N, H] -> PARTIAL [N, H]
    transition (+ norm)          -> MLP / MoE on SHARDED [n, H] (SP) or FULL [N, H] rows
    output                       -> SHARDED [n, H] complete (SP) or PARTIAL [N, H]
"""

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state
from spmoe.distributed.communicator import LayerCommunicator
from spmoe.distributed.layer_plan import LayerPlan
from spmoe.layers.attention import AttentionBatch, KeyStore, MLAttention
from spmoe.layers.mlp import MLP
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.moe.moe import MoE
from spmoe.layers.norm import RMSNorm
from spmoe.layers.rotary import Rotary, RotaryTable


class DeepseekV32DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan, experts: type[Experts], ep_backend: str):
        """plan: this layer's entry of the layer plan; experts, ep_backend: the routed-expert
        backend and the SP dispatch, used if this is an MoE layer."""
        super().__init__()
        self.layer_idx = layer_idx = plan.layer_idx
        self.tp_size = get_parallel_state().tp_size
        self.use_sequence_parallel_moe = plan.use_sequence_parallel_moe
        self.comm = LayerCommunicator(plan)
        self.is_moe = cfg.layer_is_moe(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(
            cfg, layer_idx, self.tp_size, has_indexer=cfg.layer_has_indexer(layer_idx)
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoE(cfg, plan, experts, ep_backend)
        else:  # replicated on SP layers (they see only their own rows), TP-sharded otherwise
            mlp_tp = 1 if self.use_sequence_parallel_moe else self.tp_size
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, mlp_tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: AttentionBatch,
        selected: torch.Tensor | None,
        max_tokens: int,
    ):
        """(hidden, residual) in the plan's `input` layout -> (MLP output, residual) in its `output`
        layout, and the indexer's selection for the next layer. max_tokens: the largest N over the
        DP ranks (`largest_dp_batch`), for the MoE dispatch."""
        h, residual = self.comm.before_attention(
            hidden, residual, self.input_layernorm, batch.num_tokens
        )
        attn, selected = self.self_attn(h, batch, selected)  # PARTIAL [N, H]
        h, residual = self.comm.before_mlp(attn, residual, self.post_attention_layernorm)
        if self.is_moe:
            return (
                self.mlp(h, self.comm.expert_rows(batch.num_tokens, max_tokens)),
                residual,
                selected,
            )
        return self.mlp(h), residual, selected


def attention_batch(
    cfg: ModelConfig,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: list[int],
    cache: KeyStore | None,
    dtype: torch.dtype,
    rotary_table: RotaryTable | None = None,
) -> AttentionBatch:
    """Check the flat batch and describe it to attention. Without a cache each sequence attends only
    its own new tokens (causally); with one, the cache says which keys each token attends.
    rotary_table: the model's cos/sin of every position (`RotaryTable.for_model`), or None."""
    num_tokens = input_ids.shape[0]
    if input_ids.dim() != 1 or positions.shape != input_ids.shape or sum(seq_lens) != num_tokens:
        raise ValueError(
            f"expected input_ids and positions of shape [N] with N = sum(seq_lens); got "
            f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}, "
            f"sum(seq_lens) = {sum(seq_lens)}"
        )
    if cache is None:
        allowed = causal_within_sequences(seq_lens, input_ids)
    else:
        allowed = cache.allowed
        if allowed.shape[0] != num_tokens:
            raise ValueError(
                f"the KV cache view is for {allowed.shape[0]} new tokens, the batch "
                f"has {num_tokens}"
            )
    return AttentionBatch(Rotary(cfg, positions, dtype, rotary_table), allowed, cache)


def causal_within_sequences(seq_lens: list[int], like: torch.Tensor) -> torch.Tensor:
    """`[N, N]` bool: token i may attend token j when both are in the same sequence and j <= i."""
    seq_id = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=like.device),
        torch.tensor(seq_lens, dtype=torch.long, device=like.device),
    )
    idx = torch.arange(seq_id.shape[0], device=like.device)
    return (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
