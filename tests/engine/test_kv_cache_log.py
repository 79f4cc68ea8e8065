"""The start-up log's line about the KV cache: its dtype (FP8 under `--kv-cache-dtype fp8`) and its
capacity, from the cache's own sizes; bytes per token counted here by hand from the demo checkpoint's
widths (latent 128, rope key 16, indexer key 32 on the layers that run the indexer)."""

import torch

from spmoe.config import ModelConfig
from spmoe.engine.build import cache_room
from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.entrypoints.demo import CHECKPOINT

LAYERS = {0: True, 1: False, 2: True}  # IndexShare: full, shared, full
# float32: latent 128 x 4 + rope 16 x 4 a layer, indexer key 32 x 4 on two of them
F32_BYTES = 3 * (128 * 4 + 16 * 4) + 2 * 32 * 4
# FP8: latent 128 x 1 + its scale 4 + rope 16 x 4 a layer; indexer key 32 x 1 + its scale 4 on two
FP8_BYTES = 3 * (128 + 4 + 16 * 4) + 2 * (32 + 4)


def test_the_paged_cache_says_its_dtype_and_capacity():
    cfg = ModelConfig.from_file(CHECKPOINT)
    fp8 = PagedKVCache(cfg, LAYERS, 3 * 64 * FP8_BYTES, torch.float32, "cpu", "fp8")
    assert fp8.describe() == (
        "paged KV cache FP8 (fp8_e4m3: the latent and indexer keys in e4m3 with their scales, the "
        f"rope key in float32): 3 blocks of 64 tokens = 192 tokens, "
        f"{3 * 64 * FP8_BYTES / 2**30:.3g} GiB on each rank ({FP8_BYTES} B a token)"
    )
    plain = PagedKVCache(cfg, LAYERS, 5 * 64 * F32_BYTES + 7, torch.float32, "cpu")
    assert plain.describe().startswith(
        f"paged KV cache float32: 5 blocks of 64 tokens = 320 tokens, {5 * 64 * F32_BYTES / 2**30:.3g}"
    )
    assert cache_room(plain, 128) == 2.5  # vLLM's "maximum concurrency": 320 / 128


def test_the_dense_cache_says_its_slots():
    cfg = ModelConfig.from_file(CHECKPOINT)
    dense = KVCache(cfg, LAYERS, 2, 100, torch.float32, "cpu")
    # the scratch slot is allocated too: 3 slots of 100 positions
    assert dense.describe() == (
        f"dense KV cache float32: 2 slots of 100 positions = 200 tokens, "
        f"{3 * 100 * F32_BYTES / 2**30:.3g} GiB on each rank"
    )
    assert (cache_room(dense, 100), cache_room(dense, 101)) == (2, 0)
