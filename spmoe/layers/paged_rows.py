"""What attention keeps in the paged MLA cache: one layer's rows (`PagedLayerCache`), the per-step
view of the whole cache (`PagedKeyStore`, built by the engine, which stores and hands out the
blocks), and attention's writes into the rows (`write_latent_projection`, `write_latent`,
`write_index_key`, FP8 keys quantised by `quantize_index_vectors`). The math that reads them is in
`sparse_attention`."""

from dataclasses import dataclass

import torch

from spmoe.layers.fused import use_fused
from spmoe.layers.norm import RMSNorm
from spmoe.layers.quantization.fp8 import FP8_GROUP, quantize_fp8_groups, quantize_fp8_vectors
from spmoe.layers.rotary import Rotary


@dataclass
class PagedLayerCache:
    """One attention layer's rows in the paged cache. FP8 caches carry scales, others
    have None there."""

    latent: torch.Tensor  # [R, c] model dtype or float8_e4m3fn
    latent_scale: torch.Tensor | None  # [R, c / 128] float32
    rope: torch.Tensor  # [R, r] model dtype
    index_key: torch.Tensor | None  # [R, d] model dtype or float8_e4m3fn; None off indexer layers
    index_scale: torch.Tensor | None  # [R, 1] float32: one scale per key


class PagedKeyStore:
    """The paged cache as one forward of N new tokens of S sequences sees it (built by the engine;
    attention takes the sparse path for an instance of this class, a plain isinstance check
    on the hot path).

    `allowed` `[N, 0]` bool: the paged cache has no flat key axis (keys are found through the block
    tables); it is there so the model counts the forward's tokens as it does with a dense cache.
    """

    block_size: int
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_index: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64: the row each new token writes
    allowed: torch.Tensor  # [N, 0] bool

    def layer(self, layer: int) -> PagedLayerCache:
        raise NotImplementedError


def write_latent(
    rows: PagedLayerCache, slot_mapping: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor
) -> None:
    """One forward's normed latent `[N, c]` and rotated rope key `[N, r]` -> their rows
    `slot_mapping` `[N]` of one layer (FP8: one scale per 128 values of the latent)."""
    _write(rows.latent, rows.latent_scale, slot_mapping, latent, quantize_fp8_groups)
    rows.rope.index_copy_(0, slot_mapping, rope.to(rows.rope.dtype))


def write_latent_projection(
    rows: PagedLayerCache,
    slot_mapping: torch.Tensor,
    kv_a: torch.Tensor,
    norm: RMSNorm,
    rotary: Rotary,
) -> None:
    """One forward's kv_a projection `[N, c + r]` (the raw latent, then the raw rope key) -> the
    latent normed by `norm` and the rope key rotated by `rotary` (MLA's interleaved pairs) in their
    rows: one Triton kernel on CUDA (`fused_triton.write_mla_cache`), else `write_latent` of the
    torch results (the rope part of kv_a is rotated in place)."""
    if use_fused(kv_a):
        from spmoe.layers.fused_triton import write_mla_cache

        write_mla_cache(
            kv_a,
            norm.weight,
            norm.eps,
            rotary.cos,
            rotary.sin,
            slot_mapping,
            rows.latent,
            rows.latent_scale,
            rows.rope,
        )
        return
    latent, rope = kv_a.split([rows.latent.shape[1], kv_a.shape[1] - rows.latent.shape[1]], dim=-1)
    rotary.rotate_(rope.unsqueeze(1), interleaved=True)
    write_latent(rows, slot_mapping, norm(latent), rope)


def quantize_index_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 indexer's queries and keys `[..., d]` -> `quantize_fp8_vectors(x)`; vectors of
    `FP8_GROUP` values on CUDA: the experts' quantisation kernel, one launch
    (`fused.use_fused` picks)."""
    if use_fused(x) and x.shape[-1] == FP8_GROUP and x.numel():
        from spmoe.layers.moe.experts.triton_kernels import quantize_fp8

        values, scale = quantize_fp8(x.reshape(-1, FP8_GROUP))
        return values.view(x.shape), scale.view(*x.shape[:-1], 1)
    return quantize_fp8_vectors(x)


def write_index_key(rows: PagedLayerCache, slot_mapping: torch.Tensor, key: torch.Tensor) -> None:
    """One forward's indexer keys `[N, d]` -> their rows of one layer (FP8: one scale per key)."""
    _write(rows.index_key, rows.index_scale, slot_mapping, key, quantize_index_vectors)


def _write(
    values: torch.Tensor,
    scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    x: torch.Tensor,
    quantize,
) -> None:
    """x `[N, w]` -> rows of `values` `[R, w]` at `slot_mapping`; FP8 rows (`scales` not None) take
    `quantize(x)`'s values and scales, the values copied as bytes (CPU torch has no FP8
    index_copy)."""
    if scales is None:
        values.index_copy_(0, slot_mapping, x.to(values.dtype))
        return
    quantized, scale = quantize(x)
    values.view(torch.uint8).index_copy_(0, slot_mapping, quantized.view(torch.uint8))
    scales.index_copy_(0, slot_mapping, scale)
