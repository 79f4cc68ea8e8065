"""Multi-token prediction (MTP): the layer after the last decoder layer that drafts one more token.

MTP layer i sits at checkpoint layer index `num_hidden_layers + i`. At position p it takes the token
at p + 1 and a post-norm hidden state at p, and predicts the token at p + 2:

    e = enorm(embed(next token)), zero where p == 0    [N, H]
    h = hnorm(previous hidden)                         [N, H]  the target's post-norm hidden on
                                                               the first draft step, this layer's
                                                               own output after that
    x = eh_proj([e | h])                               [N, H]  (SP: on this rank's n rows only)
    out, residual = decoder block(x, residual=None)            own attention + indexer, MoE
    hidden = shared_head.norm(out + residual)          FULL [N, H]

`hidden` serves both the draft logits (the LM head alone, no second norm) and the next draft step:
the recycled state is the post-norm one, which is what `hnorm` was trained on (upstream's pre-norm
recycle lowered acceptance, `docs/upstream-bugs.md` item 8).

Layout, fixed at build time by the layer plan (`use_sequence_parallel_moe`: the decision for an MoE
layer); the communicator performs every transition:
- SP: the embedding's partial sum is reduce-scattered straight into shards, the previous hidden is
  chunked locally, the block takes SHARDED `[n, H]` rows and its MoE output is complete, so the exit
  norms on the shard and gathers H once. The step has no all-reduce.
- not SP: the embedding is all-reduced, the block takes FULL rows and returns a PARTIAL sum, which
  the exit reduces exactly once, with the norm.
"""

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.distributed.communicator import enter, final_norm, shard_like
from spmoe.distributed.layer_plan import LayerPlan
from spmoe.distributed.layout import check_rows, largest_dp_batch
from spmoe.layers.attention import KeyStore
from spmoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmoe.layers.linear import Linear
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.norm import RMSNorm
from spmoe.layers.rotary import RotaryTable
from spmoe.models.deepseek_v32.decoder_layer import DeepseekV32DecoderLayer, attention_batch


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, head: ParallelLMHead):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = head


class DeepseekV32MultiTokenPredictorLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        plan: LayerPlan,
        embed_tokens: VocabParallelEmbedding,
        head: ParallelLMHead,
        experts: type[Experts],
        ep_backend: str,
        rotary_table: RotaryTable | None,
    ):
        """plan: this MTP layer's entry of the layer plan; `embed_tokens` and `head`: the layer's
        own (when the checkpoint has them) or the main model's; `experts`, `ep_backend`: the main
        model's expert backend and dispatch; `rotary_table`: the main model's cos/sin
        table, or None."""
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.use_sequence_parallel_moe = plan.use_sequence_parallel_moe
        self.embed_tokens = embed_tokens
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)  # replicated
        self.mtp_block = DeepseekV32DecoderLayer(cfg, plan, experts, ep_backend)
        self.shared_head = SharedHead(cfg, head)
        self.rotary_table = rotary_table

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        seq_lens: list[int],
        cache: KeyStore | None = None,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """input_ids `[N]` (the token after each position), positions `[N]`, previous_hidden FULL
        `[N, H]` -> FULL `[N, H]` post-norm hidden, identical on every TP rank. max_tokens: the
        largest N over the DP ranks when decided before the forward (None: agreed here,
        `largest_dp_batch`)."""
        num_tokens, layout = input_ids.shape[0], self.plan.input
        batch = attention_batch(
            self.cfg,
            input_ids,
            positions,
            seq_lens,
            cache,
            self.enorm.weight.dtype,
            self.rotary_table,
        )
        check_rows(previous_hidden, num_tokens, f"MTP previous hidden (FULL, N={num_tokens})")
        at_start = (positions == 0).unsqueeze(1)  # [N, 1]
        # SP: shard before eh_proj, so the 2H -> H projection runs on n rows
        # PARTIAL [N, H] -> complete, in `layout`
        embeds = enter(self.embed_tokens(input_ids), layout)
        previous_hidden, at_start = (
            shard_like(previous_hidden, layout),
            shard_like(at_start, layout),
        )
        x = self.eh_proj(
            torch.cat(
                [self.enorm(embeds.masked_fill(at_start, 0.0)), self.hnorm(previous_hidden)], -1
            )
        )
        out, residual, _ = self.mtp_block(
            x, None, batch, None, largest_dp_batch(num_tokens, max_tokens)
        )
        return final_norm(out, residual, self.shared_head.norm, self.plan.output, num_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FULL post-norm hidden `[m, H]` -> draft logits `[m, V]` float32 (the LM head only)."""
        return self.shared_head.head(hidden)
