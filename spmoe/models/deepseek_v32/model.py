"""DeepSeek-V3.2 / GLM-5.2 (glm_moe_dsa) with TP attention, EP experts and sequence-parallel MoE:
the layer loop, the final norm and the LM head, and the causal LM's API for the engine.

Notation: N tokens in the flat batch, t = TP size, n = ceil(N/t) rows per rank, H = hidden size.

The layer plan (`spmoe.distributed.layer_plan`), built once from the model and parallel configs,
declares every layer's layouts; the communicator (`spmoe.distributed.communicator`) applies every
transition: the embedding's PARTIAL sum into layer 0's input layout, the transitions inside each
layer, and the exit. The loop itself hands each layer's output to the next unchanged.

With a KV cache (`cache`, from the engine) the N new tokens attend their sequences'
cached keys as well.
"""

from contextlib import contextmanager

import torch
from torch import nn

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state
from spmoe.distributed.communicator import enter, final_norm
from spmoe.distributed.layer_plan import build_layer_plan
from spmoe.distributed.layout import largest_dp_batch
from spmoe.layers.attention import CacheNeeds, KeyStore
from spmoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmoe.layers.moe.experts.base import ExpertsDeployment
from spmoe.layers.moe.experts.selection import select_experts
from spmoe.layers.norm import RMSNorm
from spmoe.layers.rotary import RotaryTable
from spmoe.models.deepseek_v32.decoder_layer import DeepseekV32DecoderLayer, attention_batch
from spmoe.models.deepseek_v32.mtp import DeepseekV32MultiTokenPredictorLayer


class DeepseekV32Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        """dtype and device decide the expert backend (every MoE layer has the same SP decision, so
        one choice)."""
        super().__init__()
        state = get_parallel_state()
        if parallel.tensor_parallel_size != state.tp_size:
            raise ValueError(
                f"parallel config has tensor_parallel_size={parallel.tensor_parallel_size} but the "
                f"process group has {state.tp_size} TP ranks"
            )
        cfg.check_parallel(parallel)
        self.cfg = cfg
        self.plan = build_layer_plan(cfg, parallel)
        self.experts_backend = select_experts(
            ExpertsDeployment.for_layer(
                cfg, parallel, parallel.use_sequence_parallel_moe, dtype, device
            ),
            parallel.moe_backend,
        )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV32DecoderLayer(cfg, plan, self.experts_backend, parallel.ep_backend)
            for plan in self.plan.layers
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_table = RotaryTable.for_model(cfg, device, dtype)  # shared with the MTP layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        cache: KeyStore | None = None,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions `[N]`; seq_lens: new tokens per sequence, laid end to end -> FULL
        `[N, H]` final-normed hidden states, identical on every TP rank. max_tokens: the largest N
        over the DP ranks when decided before the forward (None: agreed here,
        `largest_dp_batch`)."""
        num_tokens = input_ids.shape[0]
        batch = attention_batch(
            self.cfg,
            input_ids,
            positions,
            seq_lens,
            cache,
            self.norm.weight.dtype,
            self.rotary_table,
        )
        max_tokens = largest_dp_batch(num_tokens, max_tokens)
        # PARTIAL [N, H] -> layer 0
        hidden = enter(self.embed_tokens(input_ids), self.plan.layers[0].input)
        residual, selected = None, None
        for layer in self.layers:
            hidden, residual, selected = layer(hidden, residual, batch, selected, max_tokens)
        return final_norm(hidden, residual, self.norm, self.plan.exit, num_tokens)


class DeepseekV32ForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mtp_own_weights: tuple[tuple[bool, bool], ...] = (),
    ):
        """Built in `dtype` on `device` (FP8 expert weights and router weights keep their own
        dtypes). mtp_own_weights: one (own embedding, own head) pair per MTP layer to build,
        none by default."""
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        with torch.device(device), _default_dtype(dtype):
            self.model = DeepseekV32Model(cfg, parallel, dtype, device)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            self.mtp = nn.ModuleList(
                DeepseekV32MultiTokenPredictorLayer(
                    cfg,
                    self.model.plan.mtp[i],
                    VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
                    if own_embed
                    else self.model.embed_tokens,
                    ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if own_head else self.lm_head,
                    self.model.experts_backend,
                    parallel.ep_backend,
                    self.model.rotary_table,
                )
                for i, (own_embed, own_head) in enumerate(mtp_own_weights)
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        cache: KeyStore | None = None,
    ) -> torch.Tensor:
        """-> logits `[N, vocab]` float32, identical on every TP rank."""
        return self.compute_logits(self.forward_hidden(input_ids, positions, seq_lens, cache))

    # The API the engine uses; it never reaches into the submodules.

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        cache: KeyStore | None = None,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions `[N]`; seq_lens: new tokens per sequence, end to end -> FULL
        `[N, H]` post-norm hidden, identical on every TP rank. max_tokens: see
        `DeepseekV32Model.forward`."""
        return self.model(input_ids, positions, seq_lens, cache, max_tokens)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FULL hidden `[N, H]` -> logits `[m, vocab]` float32 of `rows` `[m]` (int64; all N rows if
        None), written into `out` if given."""
        return self.lm_head(hidden if rows is None else hidden[rows], out)

    @property
    def num_draft_layers(self) -> int:
        """MTP layers built (0 unless loaded with_mtp)."""
        return len(self.mtp)

    def kv_cache_needs(self) -> list[CacheNeeds]:
        """What each attention layer keeps per token in the KV cache, the MTP layers' included (the
        engine sizes its cache from this)."""
        blocks = [*self.model.layers, *(mtp.mtp_block for mtp in self.mtp)]
        return [block.self_attn.cache_needs() for block in blocks]

    def forward_draft_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        seq_lens: list[int],
        cache: KeyStore | None = None,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """MTP layer 0: input_ids `[N]` (the token after each position), positions `[N]`,
        previous_hidden FULL `[N, H]` post-norm -> FULL `[N, H]` post-norm hidden. max_tokens: as
        `forward_hidden`'s."""
        return self.mtp[0](input_ids, positions, previous_hidden, seq_lens, cache, max_tokens)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP post-norm hidden `[m, H]` -> draft logits `[m, vocab]` float32."""
        return self.mtp[0].logits(hidden)

    @property
    def graph_capturable(self) -> tuple[bool, str]:
        """(whether a forward can be captured in a CUDA graph as far as the expert kernels go,
        which backend)."""
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
