"""MLA attention with the DSA lightning indexer, heads split over the TP group.

Runs over the N new tokens of a flat batch of sequences (FULL layout), which attend K keys: their
own sequences' cached tokens and themselves. q_a / kv_a projections, their norms and the indexer are
replicated (the four projections of the input, q_a, kv_a and the indexer's wk and weights_proj, run
as one GEMM, `x_proj`; the checkpoint keeps them apart); q_b and kv_b are column-parallel over
heads; o_proj is row-parallel and the output is this rank's PARTIAL sum `[N, H]`. Per token and
layer the cache keeps MLA's compressed latent with its rotated rope key, and the indexer's key.

Two paths, chosen by the cache the batch carries:
- dense (no cache, or `KeyStore`): every key decompressed through kv_b_proj, scores `[heads, N, K]`,
  the indexer's top-k applied as a mask. The reference (what the transformers oracle checks). The
  scores (and the indexer's) are computed for chunks of queries (`query_chunks`), so their memory
  stays within a fixed budget however many tokens a forward holds.
- paged (`PagedKeyStore`): the indexer picks cache rows, and absorbed MLA attends only those
  (`sparse_attention`); for contexts of at most index_topk tokens this is exactly dense
  causal attention.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from spmoe.config import ModelConfig
from spmoe.layers.fused import use_fused
from spmoe.layers.linear import Linear, MergedLinear
from spmoe.layers.norm import RMSNorm
from spmoe.layers.paged_rows import (
    PagedKeyStore,
    quantize_index_vectors,
    write_index_key,
    write_latent_projection,
)
from spmoe.layers.quantization.fp8 import hadamard_matrix, hadamard_rotate
from spmoe.layers.quantization.fp8_linear import fp8_head_matmul
from spmoe.layers.rotary import Rotary
from spmoe.layers.sparse_attention import (
    head_matmul,
    indexer_topk,
    query_chunks,
    sparse_mla,
    visible_rows,
)


class KeyStore(Protocol):
    """Keys kept across forwards (the engine's KV cache), viewed for one forward of N new tokens."""

    allowed: torch.Tensor  # [N, K] bool

    def store_and_read(self, layer: int, kind: str, new: torch.Tensor) -> torch.Tensor: ...


@dataclass
class AttentionBatch:
    """What attention needs to know about one forward: N new tokens attending K keys.

    rotary: cos/sin at the N query positions. allowed `[N, K]` bool: query i may attend key j (same
    sequence, j not after i). cache: None when the keys are just this forward's N tokens (K = N).
    """

    rotary: Rotary
    allowed: torch.Tensor
    cache: KeyStore | None = None

    @property
    def num_tokens(self) -> int:
        return self.allowed.shape[0]

    def keys(self, layer: int, kind: str, new: torch.Tensor) -> torch.Tensor:
        """This forward's rows `[N, w]` of one kind of key -> all keys the batch
        attends `[K, w]`."""
        return new if self.cache is None else self.cache.store_and_read(layer, kind, new)


class Indexer(nn.Module):
    """DSA lightning indexer: scores every allowed key per query and keeps the top `index_topk`.

    Its projections of the layer input, `wk` `[d, H]` and `weights_proj` `[h, H]`, live in the
    attention's merged `x_proj`; the indexer gets their outputs."""

    PROJECTIONS = ("indexer.wk", "indexer.weights_proj")  # their names in MLAttention.x_proj

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)

    def forward(
        self,
        wk_x: torch.Tensor,
        head_weights: torch.Tensor,
        q_latent: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """wk_x `[N, d]` (wk of the input), head_weights `[N, h]` (weights_proj of the input),
        q_latent `[N, q_lora]` -> selected `[N, K]` bool (top-k allowed keys per query); over a
        paged cache, the selected cache rows `[N, k]` int64 (-1 = none; `_paged_rows`)."""
        cfg = self.cfg
        if isinstance(batch.cache, PagedKeyStore):
            return self._paged_rows(wk_x, head_weights, q_latent, batch.rotary, batch.cache)
        q = self._query(q_latent, batch.rotary)  # [N, h, d]
        k = batch.keys(self.layer_idx, "indexer", self._key(wk_x, batch.rotary)).float()  # [K, d]
        weights = head_weights.float() * cfg.index_n_heads**-0.5  # [N, h]
        selected = torch.zeros_like(batch.allowed)
        # scores [n, h, K], index, its sort
        for c in query_chunks(q.shape[0], k.shape[0] * (q.shape[1] + 3)):
            scores = F.relu(torch.einsum("qhd,kd->qhk", q[c].float(), k) * cfg.index_head_dim**-0.5)
            index = torch.einsum("qh,qhk->qk", weights[c], scores).masked_fill(
                ~batch.allowed[c], float("-inf")
            )
            # a stable sort, so that tied scores (relu makes exact zeros common) pick the earliest
            # positions, whatever else shares the batch or the cache
            topk = index.sort(dim=-1, descending=True, stable=True).indices[:, : cfg.index_topk]
            selected[c].scatter_(1, topk, True)
        return selected & batch.allowed

    def _query(self, q_latent: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """q_latent `[N, q_lora]` -> the query heads `[N, h, d]`, their rope part rotated."""
        cfg = self.cfg
        q = self.wq_b(q_latent).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        rotary.rotate_(q[..., : cfg.qk_rope_head_dim], cfg.indexer_rope_interleaved)
        return q

    def _key(self, wk_x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """wk_x `[N, d]` -> the key `[N, d]`: normed, its rope part rotated."""
        k = self.k_norm(wk_x)
        rotary.rotate_(k[:, None, : self.cfg.qk_rope_head_dim], self.cfg.indexer_rope_interleaved)
        return k

    def _paged_rows(
        self,
        wk_x: torch.Tensor,
        head_weights: torch.Tensor,
        q_latent: torch.Tensor,
        rotary: Rotary,
        cache: PagedKeyStore,
    ) -> torch.Tensor:
        """-> the selected cache rows `[N, k]`, after this forward's keys are written. When the
        block tables span at most index_topk positions every visible row is selected, and nothing is
        scored. Else the dense path's scores, without its two constant scales (a positive factor
        common to every score ranks alike, up to rounding); FP8 caches score FP8 queries against FP8
        keys, both Hadamard-rotated first (`hadamard_rotate`: q . k unchanged, less FP8 rounding),
        the queries' scales in the head weights."""
        cfg = self.cfg
        self._write_key(wk_x, rotary, cache)
        if cache.block_tables.shape[1] * cache.block_size <= cfg.index_topk:
            return visible_rows(
                cache.block_tables, cache.seq_index, cache.positions, cache.block_size
            )
        q, weights, rows = self._query(q_latent, rotary), head_weights, cache.layer(self.layer_idx)
        if rows.index_scale is not None:
            q, q_scale = quantize_index_vectors(hadamard_rotate(q))  # [N, h, d], [N, h, 1]
            weights = head_weights * q_scale.squeeze(-1)
        return indexer_topk(
            q,
            weights,
            rows,
            cache.block_tables,
            cache.seq_index,
            cache.positions,
            cfg.index_topk,
            cache.block_size,
        )

    def _write_key(self, wk_x: torch.Tensor, rotary: Rotary, cache: PagedKeyStore) -> None:
        """wk_x `[N, d]` -> this forward's keys (`_key`) in their cache rows, Hadamard-rotated in an
        FP8 cache; on CUDA one Triton kernel (`fused_triton.index_key_to_cache`) norms, rotates,
        quantises and writes them."""
        rows = cache.layer(self.layer_idx)
        fp8 = rows.index_scale is not None
        if not use_fused(wk_x):
            k = self._key(wk_x, rotary)
            write_index_key(rows, cache.slot_mapping, hadamard_rotate(k) if fp8 else k)
            return
        from spmoe.layers.fused_triton import index_key_to_cache

        index_key_to_cache(
            wk_x,
            self.k_norm.weight,
            self.k_norm.bias,
            self.k_norm.eps,
            rotary.cos,
            rotary.sin,
            self.cfg.indexer_rope_interleaved,
            cache.slot_mapping,
            rows.index_key,
            rows.index_scale,
            hadamard_matrix(wk_x.shape[1], wk_x.device) if fp8 else None,
        )


@dataclass(frozen=True)
class CacheNeeds:
    """What one attention layer keeps per token in the KV cache: its layer index (the MTP layer's
    follow the main layers'), the widths of the latent, the rope key and the indexer key (0: no
    indexer), in `dtype` on `device`. The model hands these to the engine, which sizes the
    cache from them."""

    layer: int
    latent: int
    rope: int
    index_key: int
    dtype: torch.dtype
    device: torch.device


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp_size: int, has_indexer: bool):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.local_heads = cfg.num_attention_heads // tp_size
        heads = cfg.num_attention_heads
        projections = {
            "q_a_proj": cfg.q_lora_rank,
            "kv_a_proj_with_mqa": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        }
        if has_indexer:
            projections |= dict(zip(Indexer.PROJECTIONS, (cfg.index_head_dim, cfg.index_n_heads)))
        self.x_proj = MergedLinear(cfg.hidden_size, projections)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, tp_dim=0, tp_size=tp_size)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank,
            heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            tp_dim=0,
            tp_size=tp_size,
        )
        self.o_proj = Linear(heads * cfg.v_head_dim, cfg.hidden_size, tp_dim=1, tp_size=tp_size)
        self.indexer = Indexer(cfg, layer_idx) if has_indexer else None

    def cache_needs(self) -> CacheNeeds:
        cfg, weight = self.cfg, self.x_proj.weight
        index_key = cfg.index_head_dim if self.indexer is not None else 0
        return CacheNeeds(
            self.layer_idx,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            index_key,
            weight.dtype,
            weight.device,
        )

    def forward(self, x: torch.Tensor, batch: AttentionBatch, selected: torch.Tensor | None):
        """x FULL `[N, H]` -> (PARTIAL `[N, H]`, selected `[N, K]`; over a paged cache, cache
        rows `[N, k]`).

        `selected` comes from the previous "full" layer on an IndexShare "shared" layer, else None.
        """
        cfg, n_tok, heads = self.cfg, x.shape[0], self.local_heads
        proj = self.x_proj(x)  # views of one [N, q_lora + c + rope (+ d + h)] product
        q_latent = self.q_a_layernorm(proj["q_a_proj"])  # [N, q_lora]
        q = self.q_b_proj(q_latent).view(n_tok, heads, cfg.qk_head_dim)
        batch.rotary.rotate_(q[..., cfg.qk_nope_head_dim :], interleaved=True)
        kv_a = proj["kv_a_proj_with_mqa"]  # [N, c + rope]: the latent, then the rope key
        if isinstance(batch.cache, PagedKeyStore):  # normed, rotated and written in one go
            cache = batch.cache
            write_latent_projection(
                cache.layer(self.layer_idx),
                cache.slot_mapping,
                kv_a,
                self.kv_a_layernorm,
                batch.rotary,
            )
            if self.indexer is not None:
                selected = self.indexer(
                    *(proj[name] for name in Indexer.PROJECTIONS), q_latent, batch
                )
            return self.o_proj(self._sparse_absorbed(q, batch.cache, selected)), selected
        kv_latent, k_rope = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv_latent = self.kv_a_layernorm(kv_latent)  # [N, c]
        batch.rotary.rotate_(k_rope.unsqueeze(1), interleaved=True)  # [N, rope]
        latent = batch.keys(self.layer_idx, "mla", torch.cat([kv_latent, k_rope], dim=-1))
        # [K, c], [K, rope]
        kv_latent, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(kv_latent).view(
            latent.shape[0], heads, cfg.qk_nope_head_dim + cfg.v_head_dim
        )
        # [K, h, nope], [K, h, v]
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        # [K, h, qk_head]
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
        if self.indexer is not None:
            selected = self.indexer(*(proj[name] for name in Indexer.PROJECTIONS), q_latent, batch)
        out = torch.empty(n_tok, heads, cfg.v_head_dim, dtype=v.dtype, device=v.device)
        # scores [h, n, K], float32 and v's dtype probs
        for c in query_chunks(n_tok, heads * k.shape[0] * 3):
            scores = torch.einsum("qhd,khd->hqk", q[c], k) * cfg.attention_scale
            scores = scores.masked_fill(~selected[c], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
            out[c] = torch.einsum("hqk,khd->qhd", probs, v)
        return self.o_proj(out.reshape(n_tok, heads * cfg.v_head_dim)), selected

    def _sparse_absorbed(
        self, q: torch.Tensor, cache: PagedKeyStore, selected: torch.Tensor
    ) -> torch.Tensor:
        """Absorbed MLA over the selected cache rows (this forward's rows already written): q
        `[N, h, qk_head]`, selected rows `[N, k]` -> `[N, h * v]`.

        W_UK `[h, nope, c]` and W_UV `[h, v, c]` are views of kv_b_proj's weight: q_nope @ W_UK puts
        the query in latent space, and the weighted latent goes back through W_UV. An FP8 kv_b_proj
        is used as stored (`fp8_head_matmul`: each head's 448 rows need not start on a
        128-row block)."""
        cfg, heads, nope = self.cfg, self.local_heads, self.cfg.qk_nope_head_dim
        rows, kv_b = nope + cfg.v_head_dim, self.kv_b_proj
        if kv_b.is_fp8:
            q_latent = fp8_head_matmul(
                q[..., :nope], kv_b.weight, kv_b.weight_scale, rows, 0, cfg.kv_lora_rank, True
            )
        else:
            w_uk, w_uv = kv_b.weight.view(heads, rows, cfg.kv_lora_rank).split(
                [nope, cfg.v_head_dim], dim=1
            )
            q_latent = head_matmul(q[..., :nope], w_uk)  # [N, h, c]
        out = sparse_mla(
            q_latent, q[..., nope:], cache.layer(self.layer_idx), selected, cfg.attention_scale
        )
        if kv_b.is_fp8:
            out = fp8_head_matmul(
                out, kv_b.weight, kv_b.weight_scale, rows, nope, cfg.v_head_dim, False
            )
        else:
            out = head_matmul(out, w_uv.transpose(1, 2))  # [N, h, v]
        return out.reshape(q.shape[0], heads * cfg.v_head_dim)  # N may be 0 (a DP rank in step)
