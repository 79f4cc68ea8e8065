"""Multi-token prediction (MTP): the layer after the last decoder layer that drafts one more token.

MTP layer i sits at checkpoint layer index `num_hidden_layers + i`. At position p it takes the token at
p + 1 and a post-norm hidden state at p, and predicts the token at p + 2:

    e = enorm(embed(next token)), zero where p == 0    [N, H]
    h = hnorm(previous hidden)                         [N, H]  the target's post-norm hidden on the first
                                                               draft step, this layer's own output after that
    x = eh_proj([e | h])                               [N, H]  (SP: on this rank's n rows only)
    out, residual = decoder block(x, residual=None)            own attention + indexer, MoE
    hidden = shared_head.norm(out + residual)          FULL [N, H]

`hidden` serves both the draft logits (the LM head alone, no second norm) and the next draft step: the
recycled state is the post-norm one, which is what `hnorm` was trained on (upstream's pre-norm recycle
lowered acceptance, `docs/upstream-bugs.md` item 8).

Layout, fixed at build time by `is_sequence_parallel` (the config's decision for an MoE layer):
- SP: the embedding's partial sum is reduce-scattered straight into shards, the previous hidden is chunked
  locally, the block takes SHARDED `[n, H]` rows and its MoE output is complete, so the exit norms on the
  shard and gathers H once. The step has no all-reduce.
- non-SP: the embedding is all-reduced, the block takes FULL rows and returns a PARTIAL sum, which the exit
  reduces exactly once, fused with the norm.
"""

import torch
from torch import nn

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import Layout, get_parallel_state, sp_reduce_scatter, sp_shard
from spmoe.distributed.comm import all_reduce
from spmoe.distributed.layout import check_rows, largest_dp_batch
from spmoe.layers.attention import KeyStore
from spmoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmoe.layers.linear import Linear
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.norm import RMSNorm
from spmoe.models.deepseek_v32.model import DeepseekV32DecoderLayer, attention_batch, final_norm


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, head: ParallelLMHead):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = head


class DeepseekV32MultiTokenPredictorLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig, index: int, embed_tokens: VocabParallelEmbedding,
                 head: ParallelLMHead, experts: type[Experts]):
        """`embed_tokens` and `head`: the layer's own (when the checkpoint has them) or the main model's;
        `experts`: the main model's expert backend."""
        super().__init__()
        self.cfg = cfg
        self.layer_idx = cfg.num_hidden_layers + index
        self.is_sequence_parallel = parallel.layer_uses_sp(True)
        self.embed_tokens = embed_tokens
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)  # replicated
        self.mtp_block = DeepseekV32DecoderLayer(cfg, self.layer_idx, self.is_sequence_parallel,
                                                 Layout.SHARDED if self.is_sequence_parallel else Layout.FULL,
                                                 experts, parallel.ep_backend)
        self.shared_head = SharedHead(cfg, head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                seq_lens: list[int], cache: KeyStore | None = None) -> torch.Tensor:
        """input_ids `[N]` (the token after each position), positions `[N]`, previous_hidden FULL `[N, H]`
        -> FULL `[N, H]` post-norm hidden, identical on every TP rank."""
        state, num_tokens = get_parallel_state(), input_ids.shape[0]
        batch = attention_batch(self.cfg, input_ids, positions, seq_lens, cache, self.eh_proj.weight.dtype)
        check_rows(previous_hidden, num_tokens, f"MTP previous hidden (FULL, N={num_tokens})")
        at_start = (positions == 0).unsqueeze(1)  # [N, 1]
        embeds = self.embed_tokens(input_ids)  # PARTIAL [N, H]
        if self.is_sequence_parallel:  # shard before eh_proj, so the 2H -> H projection runs on n rows
            embeds, previous_hidden, at_start = sp_reduce_scatter(embeds), sp_shard(previous_hidden), sp_shard(at_start)
        elif state.tp_size > 1:
            embeds = all_reduce(embeds, state.tp_group)
        x = self.eh_proj(torch.cat([self.enorm(embeds.masked_fill(at_start, 0.0)), self.hnorm(previous_hidden)], -1))
        out, residual, _ = self.mtp_block(x, None, batch, None, largest_dp_batch(num_tokens))
        return final_norm(out, residual, self.shared_head.norm, self.mtp_block.output_layout, num_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FULL post-norm hidden `[m, H]` -> draft logits `[m, V]` float32 (the LM head only)."""
        return self.shared_head.head(hidden)
