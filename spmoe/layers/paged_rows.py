"""What attention reads from the paged MLA cache: one layer's rows (`PagedLayerCache`) and the per-step view
of the whole cache (`PagedKeyStore`, built by the engine). The math over them is in `sparse_attention`."""

from dataclasses import dataclass

import torch

from spmoe.layers.norm import RMSNorm
from spmoe.layers.rotary import Rotary


@dataclass
class PagedLayerCache:
    """One attention layer's rows in the paged cache. FP8 caches carry scales, others have None there."""

    latent: torch.Tensor  # [R, c] model dtype or float8_e4m3fn
    latent_scale: torch.Tensor | None  # [R, c / 128] float32
    rope: torch.Tensor  # [R, r] model dtype
    index_key: torch.Tensor | None  # [R, d] model dtype or float8_e4m3fn; None off indexer layers
    index_scale: torch.Tensor | None  # [R, 1] float32: one scale per key


class PagedKeyStore:
    """The paged cache as one forward of N new tokens of S sequences sees it (built by the engine; attention
    takes the sparse path for an instance of this class, a plain isinstance check on the hot path).

    `allowed` `[N, 0]` bool: the paged cache has no flat key axis (keys are found through the block tables);
    it is there so the model counts the forward's tokens as it does with a dense cache.
    """

    block_size: int
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_index: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64: the row each new token writes
    allowed: torch.Tensor  # [N, 0] bool

    def layer(self, layer: int) -> PagedLayerCache:
        raise NotImplementedError

    def write_latent(self, layer: int, latent: torch.Tensor, rope: torch.Tensor) -> None:
        raise NotImplementedError

    def write_latent_projection(self, layer: int, kv_a: torch.Tensor, norm: RMSNorm, rotary: Rotary) -> None:
        raise NotImplementedError

    def write_index_key(self, layer: int, key: torch.Tensor) -> None:
        raise NotImplementedError
