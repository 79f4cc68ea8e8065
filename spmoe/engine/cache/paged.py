"""The paged KV cache's tensors: one pool of blocks per attention layer (the MTP layer's included),
sized from a byte budget, and the per-step view that attention reads and writes (`PagedCacheView`:
the cache stores and hands out rows; attention's own code writes them, `layers/paged_rows.py`).

Per token and attention layer (R rows = (num_blocks + 1) * BLOCK_SIZE; see `PagedLayerCache`):

    kv_cache_dtype "auto": latent [c] + rope key [r] in the model dtype; indexer key [d] likewise
    kv_cache_dtype "fp8":  latent [c] e4m3 + c/128 float32 scales, rope key [r] in the model dtype,
                           indexer key [d] e4m3 + 1 float32 scale (Hadamard-rotated by the
                           indexer, as its FP8 queries are: `hadamard_rotate`)
    (GLM-5.2 in bf16 with fp8: 512 + 4 * 4 + 64 * 2 = 656 B, plus 128 + 4 B on indexer layers)

The block manager hands out blocks 0 .. num_blocks - 1. The extra last block, `scratch_block`,
belongs to no sequence: the pad rows of a CUDA-graph step write there and pad block-table entries
point there, so every index is a valid row and no kernel needs a bounds check or a host sync.
"""

from dataclasses import dataclass

import torch
from torch import nn

from spmoe.config import ModelConfig
from spmoe.engine.cache.slots import cache_layout
from spmoe.layers.paged_rows import PagedKeyStore, PagedLayerCache

BLOCK_SIZE = 64
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.8  # of the free GPU memory once the weights are loaded


def cache_budget_bytes(
    device: torch.device | str, gib: float | None = None, memory_fraction: float | None = None
) -> int:
    """The cache's byte budget: `gib` GiB, or `memory_fraction` of the device's free memory
    (CUDA only)."""
    if (gib is None) == (memory_fraction is None):
        raise ValueError(
            f"give the KV cache budget as exactly one of GiB or a fraction of free memory, got "
            f"gib={gib}, memory_fraction={memory_fraction}"
        )
    if gib is not None:
        if not 0 < gib < float("inf"):  # NaN too
            raise ValueError(f"the KV cache budget must be a finite number of GiB > 0, got {gib}")
        return int(gib * 2**30)
    device = torch.device(device)
    if not 0 < memory_fraction <= 1 or device.type != "cuda":
        raise ValueError(
            f"a KV cache budget as a fraction of free memory needs a CUDA device and a fraction in "
            f"(0, 1], got {memory_fraction} on {device}"
        )
    return int(torch.cuda.mem_get_info(device)[0] * memory_fraction)


def field_widths(
    cfg: ModelConfig, has_indexer: bool, dtype: torch.dtype, fp8: bool
) -> dict[str, tuple[int, torch.dtype]]:
    """Field of `PagedLayerCache` -> (values per token, dtype)."""
    e4m3 = torch.float8_e4m3fn
    widths = {
        "latent": (cfg.kv_lora_rank, e4m3 if fp8 else dtype),
        "rope": (cfg.qk_rope_head_dim, dtype),
    }
    if fp8:
        widths["latent_scale"] = (cfg.kv_lora_rank // 128, torch.float32)
    if has_indexer:
        widths["index_key"] = (cfg.index_head_dim, e4m3 if fp8 else dtype)
        if fp8:
            widths["index_scale"] = (1, torch.float32)
    return widths


def token_bytes(
    cfg: ModelConfig, layers: dict[int, bool], dtype: torch.dtype, kv_cache_dtype: str
) -> int:
    """Cache bytes one token takes over `layers` (attention layer index -> whether it runs
    the indexer)."""
    return sum(
        width * field_dtype.itemsize
        for has_indexer in layers.values()
        for width, field_dtype in field_widths(
            cfg, has_indexer, dtype, kv_cache_dtype == "fp8"
        ).values()
    )


def model_layers(cfg: ModelConfig, with_mtp: bool) -> dict[int, bool]:
    """The attention layers a model built from `cfg` has -> whether each runs the indexer."""
    count = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    return {i: cfg.layer_has_indexer(i) for i in range(count)}


def check_paged_budget(
    cfg: ModelConfig,
    with_mtp: bool,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    gib: float | None,
    memory_fraction: float | None,
    device: str,
    longest: int,
) -> None:
    """Before anything is allocated: a one-line error unless the options make a valid budget, the
    budget holds a block of every layer, and (a budget in GiB) the longest sequence (`longest`
    tokens with its new tokens and drafts) fits the whole cache."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "fp8":
        layers = model_layers(cfg, with_mtp)
        check_fp8_widths(cfg, any(layers.values()))
    if gib is not None and memory_fraction is not None:
        raise ValueError(
            f"give the KV cache budget as --kv-cache-memory or --gpu-memory-utilization, not both; "
            f"got {gib} and {memory_fraction}"
        )
    if memory_fraction is not None and (device != "cuda" or not 0 < memory_fraction <= 1):
        raise ValueError(
            "--gpu-memory-utilization needs --device cuda and a fraction in (0, 1], got "
            f"{memory_fraction} on {device}"
        )
    if gib is None:
        return
    if not 0 < gib < float("inf"):  # NaN too
        raise ValueError(f"--kv-cache-memory must be a finite number of GiB > 0, got {gib}")
    per_token = token_bytes(cfg, model_layers(cfg, with_mtp), dtype, kv_cache_dtype)
    blocks = int(gib * 2**30) // (per_token * BLOCK_SIZE)
    if blocks < 1:
        raise ValueError(
            f"--kv-cache-memory {gib} GiB holds no block: one block of {BLOCK_SIZE} tokens in each "
            f"of the {len(model_layers(cfg, with_mtp))} attention layers takes "
            f"{per_token * BLOCK_SIZE} B"
        )
    check_sequence_fits(
        longest, blocks * BLOCK_SIZE, f"--kv-cache-memory {gib} GiB", "--kv-cache-memory"
    )


def check_fp8_widths(cfg: ModelConfig, with_indexer: bool) -> None:
    """Raise unless an FP8 cache can hold `cfg`'s rows: a latent scaled per 128 values, indexer keys
    (`with_indexer`) Hadamard-rotated, which needs a power-of-2 width."""
    if cfg.kv_lora_rank % 128:
        raise ValueError(
            f"an FP8 KV cache scales the latent per 128 values; kv_lora_rank {cfg.kv_lora_rank} "
            f"is not a multiple of 128"
        )
    d = cfg.index_head_dim
    if with_indexer and d & (d - 1):
        raise ValueError(
            f"an FP8 KV cache Hadamard-rotates the indexer keys, which needs a power-of-2 width; "
            f"index_head_dim {d} is not a power of 2"
        )


def check_sequence_fits(longest: int, capacity_tokens: int, budget: str, flag: str) -> None:
    """Raise unless a sequence of `longest` positions fits a cache of `capacity_tokens` tokens in
    all, sized by `budget` (what the message says of it) from option `flag`."""
    if longest > capacity_tokens:
        raise ValueError(
            f"a sequence needs {longest} KV cache positions (prompt, new tokens and drafts); "
            f"{budget} holds {capacity_tokens} tokens in all: raise {flag} or ask for fewer "
            "positions with --max-model-len"
        )


def build_paged_cache(
    model: nn.Module,
    gib: float | None,
    memory_fraction: float | None,
    kv_cache_dtype: str,
    default_seqs: int,
    longest: int,
) -> "PagedKVCache":
    """The paged cache sized from `gib` GiB, else `memory_fraction` of the free GPU memory; with
    neither, on CUDA `DEFAULT_GPU_MEMORY_UTILIZATION` of it, on CPU room for `default_seqs`
    sequences of `longest` tokens, each in its own blocks. A share of the free memory, known only
    now, must hold a sequence of `longest` positions (`check_paged_budget` checked the other budgets
    before any rank started)."""
    cfg, layers, dtype, device = cache_layout(model)
    if gib is None and memory_fraction is None:
        if device.type == "cuda":
            memory_fraction = DEFAULT_GPU_MEMORY_UTILIZATION
        else:
            blocks = default_seqs * -(-longest // BLOCK_SIZE)
            budget = blocks * BLOCK_SIZE * token_bytes(cfg, layers, dtype, kv_cache_dtype)
            return PagedKVCache(cfg, layers, budget, dtype, device, kv_cache_dtype)
    budget = cache_budget_bytes(device, gib, memory_fraction)
    cache = PagedKVCache(cfg, layers, budget, dtype, device, kv_cache_dtype)
    if gib is None:
        said = (
            f"--gpu-memory-utilization {memory_fraction} ({budget / 2**30:.2f} GiB of this "
            "GPU's free memory)"
        )
        check_sequence_fits(longest, cache.capacity_tokens, said, "--gpu-memory-utilization")
    return cache


def check_room(block_tables: list[list[int]], starts: list[int], lens: list[int]) -> None:
    """Raise unless each sequence's blocks hold the `lens[i]` positions it writes from `starts[i]`
    (past them a kernel would write through a padded or stale table entry)."""
    for i, (table, start, n) in enumerate(zip(block_tables, starts, lens)):
        if start + n > len(table) * BLOCK_SIZE:
            raise ValueError(
                f"sequence {i} needs {start + n} positions; its {len(table)} blocks hold "
                f"{len(table) * BLOCK_SIZE}"
            )


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        layers: dict[int, bool],
        budget_bytes: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
    ):
        """layers: attention layer index -> whether it runs the indexer. As many blocks as
        `budget_bytes` holds (the scratch block comes on top)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
            )
        self.fp8 = kv_cache_dtype == "fp8"
        if self.fp8:
            check_fp8_widths(cfg, any(layers.values()))
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.block_size = BLOCK_SIZE
        self.layer_indexer = dict(layers)
        block_bytes = self.bytes_per_token * BLOCK_SIZE
        if budget_bytes < block_bytes:
            raise ValueError(
                f"the KV cache needs at least {block_bytes} bytes for one block of each of "
                f"{len(layers)} layers, got {budget_bytes}"
            )
        self.num_blocks = budget_bytes // block_bytes
        self.scratch_block = self.num_blocks
        rows = (self.num_blocks + 1) * BLOCK_SIZE
        self.layers = {
            layer: self._allocate(rows, has_indexer) for layer, has_indexer in layers.items()
        }

    @classmethod
    def for_model(
        cls, model: nn.Module, budget_bytes: int, kv_cache_dtype: str = "auto"
    ) -> "PagedKVCache":
        """A cache for every attention layer in `model` (the MTP layer's included), in the
        model's dtype."""
        cfg, layers, dtype, device = cache_layout(model)
        return cls(cfg, layers, budget_bytes, dtype, device, kv_cache_dtype)

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers (on each rank)."""
        return token_bytes(self.cfg, self.layer_indexer, self.dtype, "fp8" if self.fp8 else "auto")

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    def describe(self) -> str:
        """One line for the start-up log: the cache's dtype and capacity on each rank."""
        dtype = str(self.dtype).removeprefix("torch.")
        kind = (
            f"FP8 (fp8_e4m3: the latent and indexer keys in e4m3 with their scales, the rope key "
            f"in {dtype})"
            if self.fp8
            else dtype
        )
        gib = (self.num_blocks * BLOCK_SIZE * self.bytes_per_token) / 2**30
        return (
            f"paged KV cache {kind}: {self.num_blocks} blocks of {BLOCK_SIZE} tokens = "
            f"{self.capacity_tokens} tokens, {gib:.3g} GiB on each rank ({self.bytes_per_token} B "
            f"a token)"
        )

    def _allocate(self, rows: int, has_indexer: bool) -> PagedLayerCache:
        fields = {
            name: torch.zeros(rows, width, dtype=dtype, device=self.device)
            for name, (width, dtype) in field_widths(
                self.cfg, has_indexer, self.dtype, self.fp8
            ).items()
        }
        if self.fp8:  # zero rows must dequantise to zero, and stay finite: scales of 1
            for name in ("latent_scale", "index_scale"):
                if name in fields:
                    fields[name].fill_(1.0)
        return PagedLayerCache(
            fields["latent"],
            fields.get("latent_scale"),
            fields["rope"],
            fields.get("index_key"),
            fields.get("index_scale"),
        )

    # -- views ------------------------------------------------------------------------------------

    def view(
        self, block_tables: list[list[int]], starts: list[int], lens: list[int]
    ) -> "PagedCacheView":
        """One forward in which sequence i (blocks `block_tables[i]`, `starts[i]` tokens already
        cached) adds `lens[i]` new tokens at positions `starts[i] ...`, laid end to end."""
        check_room(block_tables, starts, lens)
        # an empty batch (a DP rank in step): [0, 1]
        width = max((len(t) for t in block_tables), default=1)
        tables = torch.tensor(
            [t + [self.scratch_block] * (width - len(t)) for t in block_tables], dtype=torch.int32
        ).view(len(block_tables), width)
        if tables.numel() and not (0 <= tables.min() and tables.max() <= self.scratch_block):
            raise ValueError(  # a kernel would read or write outside the cache
                f"block ids must be in [0, {self.scratch_block}] (the cache's {self.num_blocks} "
                f"blocks and its scratch block), got {tables.min().item()} .. "
                f"{tables.max().item()}"
            )
        seq_index = torch.repeat_interleave(
            torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long)
        )
        positions = torch.cat(
            [torch.zeros(0, dtype=torch.long)]
            + [torch.arange(s, s + n) for s, n in zip(starts, lens)]
        )
        return self.decode_view(
            tables.to(self.device), seq_index.to(self.device), positions.to(self.device)
        )

    def decode_view(
        self, block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor
    ) -> "PagedCacheView":
        """A view built on the device from block_tables `[S, max_blocks]` int32 (pad entries:
        `scratch_block`), seq_index and positions `[N]` int64. Shapes depend on N, S and max_blocks
        alone and nothing is read back to the host, so a CUDA graph can capture it. A pad row: a
        sequence whose table is all `scratch_block`, at position 0."""
        blocks = (
            block_tables.long()[seq_index].gather(1, (positions // BLOCK_SIZE)[:, None]).squeeze(1)
        )
        slot_mapping = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        allowed = torch.zeros(positions.shape[0], 0, dtype=torch.bool, device=positions.device)
        return PagedCacheView(self, block_tables, seq_index, positions, slot_mapping, allowed)


@dataclass
class PagedCacheView(PagedKeyStore):
    """The cache as one forward of N new tokens of S sequences sees it."""

    cache: PagedKVCache
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_index: torch.Tensor  # [N] int64: the sequence of each new token
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64: the row each new token writes
    allowed: torch.Tensor  # [N, 0] bool, see PagedKeyStore

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def layer(self, layer: int) -> PagedLayerCache:
        return self.cache.layers[layer]
