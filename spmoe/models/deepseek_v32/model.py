"""DeepSeek-V3.2 / GLM-5.2 (glm_moe_dsa) with TP attention, EP experts and sequence-parallel MoE.

Notation: N tokens in the flat batch, t = TP size, n = ceil(N/t) rows per rank, H = hidden size.

Each decoder layer declares, when the model is built, the layout its input arrives in (`input_layout`) and
whether it runs its norms and MLP on the token shard (`use_sequence_parallel_moe`). The forward never looks
at a shape to decide a layout; it checks the shape against the declared layout and raises on a mismatch.

Per layer (SP = use_sequence_parallel_moe):

    input layout   PARTIAL: all-reduce + add-norm (FULL)   FULL: add-norm   SHARDED: add-norm on shard, gather h
    attention      FULL [N, H] -> PARTIAL [N, H]
    SP:            reduce-scatter -> [n, H]; residual chunked locally if it was FULL; add-norm; MLP on shard
    non-SP:        all-reduce + add-norm; TP MLP -> PARTIAL [N, H]

The model loop does the transitions between layers: the embedding's PARTIAL sum is reduce-scattered when
layer 0 is SP, and `_restore_full_token_layout_if_needed` rebuilds FULL (hidden, residual) with one gather
before a non-SP layer that follows an SP one.

With a KV cache (`cache`, from the engine) the N new tokens attend their sequences' cached keys as well.
"""

from contextlib import contextmanager

import torch
from torch import nn

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import (Layout, _restore_full_token_layout_if_needed, get_parallel_state, shard_rows,
                               sp_all_gather, sp_reduce_scatter, sp_shard)
from spmoe.distributed.layout import check_rows, largest_dp_batch
from spmoe.layers.attention import AttentionBatch, KeyStore, MLAttention
from spmoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmoe.layers.mlp import MLP
from spmoe.layers.moe.experts.base import Experts, ExpertsDeployment
from spmoe.layers.moe.experts.selection import select_experts
from spmoe.layers.moe.moe import MoE
from spmoe.layers.norm import RMSNorm, fused_allreduce_rms_norm
from spmoe.layers.rotary import Rotary


class DeepseekV32DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, use_sequence_parallel_moe: bool, input_layout: Layout,
                 experts: type[Experts], ep_backend: str):
        """experts, ep_backend: the routed-expert backend and the SP dispatch, used if this is an MoE layer."""
        super().__init__()
        tp_size = get_parallel_state().tp_size
        if input_layout is Layout.SHARDED and not use_sequence_parallel_moe:
            raise ValueError(f"layer {layer_idx}: a non-SP layer cannot take a SHARDED input")
        self.layer_idx = layer_idx
        self.tp_size = tp_size
        self.use_sequence_parallel_moe = use_sequence_parallel_moe
        self.input_layout = input_layout
        self.is_moe = cfg.layer_is_moe(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx, tp_size, has_indexer=cfg.layer_has_indexer(layer_idx))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoE(cfg, use_sequence_parallel_moe, experts, ep_backend)
        else:  # replicated on SP layers (they see only their own rows), TP-sharded otherwise
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, 1 if use_sequence_parallel_moe else tp_size)

    @property
    def output_layout(self) -> Layout:
        """Layout of the returned MLP output (the residual is FULL or SHARDED to match)."""
        return Layout.SHARDED if self.use_sequence_parallel_moe else Layout.PARTIAL

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: AttentionBatch,
                selected: torch.Tensor | None, max_tokens: int):
        """hidden (and residual) in `input_layout` -> (mlp output, residual) in `output_layout`, selected.
        max_tokens: the largest N over the DP ranks (`largest_dp_batch`), for the MoE dispatch."""
        num_tokens = batch.num_tokens
        rows = shard_rows(num_tokens, self.tp_size) if self.input_layout is Layout.SHARDED else num_tokens
        check_rows(hidden, rows, f"layer {self.layer_idx} input ({self.input_layout.name}, N={num_tokens})")
        if self.input_layout is Layout.PARTIAL:
            h, residual = fused_allreduce_rms_norm(hidden, residual, self.input_layernorm)
        else:
            h, residual = self.input_layernorm.add_norm(hidden, residual)
            if self.input_layout is Layout.SHARDED:
                h = sp_all_gather(h, num_tokens)
        attn, selected = self.self_attn(h, batch, selected)  # PARTIAL [N, H]
        if self.use_sequence_parallel_moe:
            attn = sp_reduce_scatter(attn)  # [n, H], complete
            if self.input_layout is not Layout.SHARDED:
                residual = sp_shard(residual)  # FULL -> SHARDED, no communication
            h, residual = self.post_attention_layernorm.add_norm(attn, residual)
        else:
            h, residual = fused_allreduce_rms_norm(attn, residual, self.post_attention_layernorm)
        out = self.mlp(h, num_tokens, max_tokens) if self.is_moe else self.mlp(h)
        return out, residual, selected


class DeepseekV32Model(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype, device: torch.device | str):
        """dtype and device decide the expert backend (every MoE layer has the same SP flag, so one choice)."""
        super().__init__()
        state = get_parallel_state()
        if parallel.tensor_parallel_size != state.tp_size:
            raise ValueError(f"parallel config has tensor_parallel_size={parallel.tensor_parallel_size} but the "
                             f"process group has {state.tp_size} TP ranks")
        cfg.check_parallel(parallel)
        self.cfg = cfg
        self.experts_backend = select_experts(ExpertsDeployment.for_layer(
            cfg, parallel, parallel.use_sequence_parallel_moe, dtype, device), parallel.moe_backend)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        layers, previous_sp = [], None
        for i in range(cfg.num_hidden_layers):
            sp = parallel.layer_uses_sp(cfg.layer_is_moe(i))
            if previous_sp is None:  # layer 0 takes the embedding: reduce-scattered if SP, else PARTIAL
                input_layout = Layout.SHARDED if sp else Layout.PARTIAL
            elif previous_sp:
                input_layout = Layout.SHARDED if sp else Layout.FULL  # FULL: the loop gathers first
            else:
                input_layout = Layout.PARTIAL
            layers.append(DeepseekV32DecoderLayer(cfg, i, sp, input_layout, self.experts_backend,
                                                  parallel.ep_backend))
            previous_sp = sp
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                cache: KeyStore | None = None) -> torch.Tensor:
        """input_ids, positions `[N]`; seq_lens: new tokens per sequence, laid end to end -> FULL `[N, H]`
        final-normed hidden states, identical on every TP rank."""
        num_tokens = input_ids.shape[0]
        batch = attention_batch(self.cfg, input_ids, positions, seq_lens, cache, self.norm.weight.dtype)
        max_tokens = largest_dp_batch(num_tokens)
        hidden = self.embed_tokens(input_ids)  # PARTIAL [N, H]
        if self.layers[0].input_layout is Layout.SHARDED:
            hidden = sp_reduce_scatter(hidden)  # FULL -> SHARDED entry: all-reduce + chunk in one collective
        residual, selected, layout = None, None, self.layers[0].input_layout
        for layer in self.layers:
            if not layer.use_sequence_parallel_moe:  # a non-SP layer needs every token: end a sharded region
                hidden, residual = _restore_full_token_layout_if_needed(hidden, residual, num_tokens,
                                                                        is_sequence_parallel=layout is Layout.SHARDED)
            hidden, residual, selected = layer(hidden, residual, batch, selected, max_tokens)
            layout = layer.output_layout
        return final_norm(hidden, residual, self.norm, layout, num_tokens)


def final_norm(hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, layout: Layout,
               num_tokens: int) -> torch.Tensor:
    """The last block's (output, residual) in `layout` -> FULL `[N, H]` normed hidden.

    SHARDED: the output is complete, so add + norm on the shard and gather H columns (not 2H). PARTIAL: reduce
    the partial sum exactly once, fused with the add + norm.
    """
    if layout is Layout.SHARDED:
        return sp_all_gather(norm.add_norm(hidden, residual)[0], num_tokens)
    return fused_allreduce_rms_norm(hidden, residual, norm)[0]


def attention_batch(cfg: ModelConfig, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                    cache: KeyStore | None, dtype: torch.dtype) -> AttentionBatch:
    """Check the flat batch and describe it to attention. Without a cache each sequence attends only its own
    new tokens (causally); with one, the cache says which keys each token attends."""
    num_tokens = input_ids.shape[0]
    if input_ids.dim() != 1 or positions.shape != input_ids.shape or sum(seq_lens) != num_tokens:
        raise ValueError(f"expected input_ids and positions of shape [N] with N = sum(seq_lens); got "
                         f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}, "
                         f"sum(seq_lens) = {sum(seq_lens)}")
    if cache is None:
        allowed = causal_within_sequences(seq_lens, input_ids)
    else:
        allowed = cache.allowed
        if allowed.shape[0] != num_tokens:
            raise ValueError(f"the KV cache view is for {allowed.shape[0]} new tokens, the batch has {num_tokens}")
    return AttentionBatch(Rotary(cfg, positions, dtype), allowed, cache)


def causal_within_sequences(seq_lens: list[int], like: torch.Tensor) -> torch.Tensor:
    """`[N, N]` bool: token i may attend token j when both are in the same sequence and j <= i."""
    seq_id = torch.repeat_interleave(torch.arange(len(seq_lens), device=like.device),
                                     torch.tensor(seq_lens, dtype=torch.long, device=like.device))
    idx = torch.arange(seq_id.shape[0], device=like.device)
    return (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])


class DeepseekV32ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", mtp_own_weights: tuple[tuple[bool, bool], ...] = ()):
        """Built in `dtype` on `device` (FP8 expert weights and router weights keep their own dtypes).
        mtp_own_weights: one (own embedding, own head) pair per MTP layer to build, none by default."""
        from spmoe.models.deepseek_v32.mtp import DeepseekV32MultiTokenPredictorLayer  # mtp.py builds on this module

        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        with torch.device(device), _default_dtype(dtype):
            self.model = DeepseekV32Model(cfg, parallel, dtype, device)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            self.mtp = nn.ModuleList(
                DeepseekV32MultiTokenPredictorLayer(
                    cfg, parallel, i,
                    VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if own_embed else self.model.embed_tokens,
                    ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if own_head else self.lm_head,
                    self.model.experts_backend)
                for i, (own_embed, own_head) in enumerate(mtp_own_weights))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                cache: KeyStore | None = None) -> torch.Tensor:
        """-> logits `[N, vocab]` float32, identical on every TP rank."""
        return self.compute_logits(self.forward_hidden(input_ids, positions, seq_lens, cache))

    # The API the engine uses; it never reaches into the submodules.

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                       cache: KeyStore | None = None) -> torch.Tensor:
        """input_ids, positions `[N]`; seq_lens: new tokens per sequence, end to end -> FULL `[N, H]` post-norm
        hidden, identical on every TP rank."""
        return self.model(input_ids, positions, seq_lens, cache)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """FULL hidden `[N, H]` -> logits `[m, vocab]` float32 of `rows` `[m]` (int64; all N rows if None)."""
        return self.lm_head(hidden if rows is None else hidden[rows])

    @property
    def num_draft_layers(self) -> int:
        """MTP layers built (0 unless loaded with_mtp)."""
        return len(self.mtp)

    def forward_draft_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                             seq_lens: list[int], cache: KeyStore | None = None) -> torch.Tensor:
        """MTP layer 0: input_ids `[N]` (the token after each position), positions `[N]`, previous_hidden FULL
        `[N, H]` post-norm -> FULL `[N, H]` post-norm hidden."""
        return self.mtp[0](input_ids, positions, previous_hidden, seq_lens, cache)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP post-norm hidden `[m, H]` -> draft logits `[m, vocab]` float32."""
        return self.mtp[0].logits(hidden)

    @property
    def graph_capturable(self) -> tuple[bool, str]:
        """(whether a forward can be captured in a CUDA graph as far as the expert kernels go, which backend)."""
        backend = self.model.experts_backend
        return not backend.syncs_host, backend.name


GlmMoeDsaForCausalLM = DeepseekV32ForCausalLM


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
