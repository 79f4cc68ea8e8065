"""CUDA graphs for the plain decode step (one new token per live sequence), SP on or off.

Launching a decode step's few hundred small kernels and collectives one by one costs more than running them
at small batches. Instead the step (the model, then the LM head) is captured once per padded batch size B in
`BATCH_SIZES` up to the engine's sequence count, and each decode step replays the smallest graph that fits.
Pad rows get token 0 at position 0 in the cache's scratch slot or block; they attend only themselves and
their logits are dropped.

Every B is captured at start-up (largest first, the others share its memory pool), on every rank in the same
order, so nothing is captured while serving; `captures` counts them.

- Slot cache: a row reads its slot's `max_len` positions.
- Paged cache: the block tables are as wide as the longest sequence may need (`max_model_len` positions, at
  most the whole cache), padded with the scratch block, so one graph serves every context length. The
  kernels read each row's real position and table from device memory: the indexer loads and scores only the
  blocks up to the row's position (the rest of its row are -inf keys, written without a load), `cache_rows`
  and sparse MLA look up only the selected positions. Each step copies only the table columns its longest
  sequence uses; stale entries beyond a row's own length are never read (every kernel masks positions past
  the row's position), and a pad row's first entry is always the scratch block, where it writes.

Captured, the step must not sync the host nor change shape with the data. Hence it needs: DP = 1 (DP ranks
would have to agree on B each step), the `allgather_reducescatter` dispatch (`all_to_all` reads its counts
back), experts that never sync the host (not the torch reference), and a CUDA device.
"""

from dataclasses import dataclass

import numpy as np
import torch

from spmoe.distributed import CommStats, count_collectives, get_parallel_state
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import PagedKVCache
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [3, B] int64: token ids, KV cache slots (paged: the row's own index), positions
    block_tables: torch.Tensor | None  # [B, W] int32 (paged cache: W = `DecodeGraphs.width`), else None
    logits: torch.Tensor  # [B, V] float32, rewritten by each replay
    collectives: CommStats  # of one replay, counted at capture


def deployment_problems(device_type: str, dp_size: int, ep_backend: str) -> list[str]:
    """What the deployment lacks for captured decode steps (empty if nothing), known before any rank starts.
    Whether the experts can be captured is known only once they are built."""
    problems = []
    if device_type != "cuda":
        problems.append(f"a CUDA device (the model is on {device_type})")
    if dp_size > 1:
        problems.append(f"data_parallel_size 1 (got {dp_size})")
    if ep_backend != "allgather_reducescatter":
        problems.append(f"ep_backend 'allgather_reducescatter' (got {ep_backend!r})")
    return problems


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured for up to `max_batch` sequences."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


def table_width(cache: PagedKVCache, max_model_len: int) -> int:
    """Blocks in a captured step's block tables: enough for `max_model_len` positions, at most the cache's."""
    return min(-(-max_model_len // cache.block_size), cache.num_blocks)


def padded_tables(tables: list[list[int]], rows: int, width: int, scratch: int) -> np.ndarray:
    """Block tables of a decode step -> `[rows, width]` int32, each padded with `scratch`, then pad rows of
    `scratch` alone (a pad row writes its one token to the scratch block)."""
    out = np.full((rows, width), scratch, dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


def decode_logits(
    model: DeepseekV32ForCausalLM,
    cache: KVCache | PagedKVCache,
    inputs: torch.Tensor,
    block_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step a graph captures, run eagerly: inputs `[3, B]` (ids, slots, positions; paged: ids, row index,
    positions) and, paged, block_tables `[B, W]` -> logits `[B, V]`."""
    ids, where, positions = inputs
    if block_tables is None:
        view = cache.decode_view(where, positions)
    else:
        view = cache.decode_view(block_tables, where, positions)
    return model.compute_logits(model.forward_hidden(ids, positions, [1] * ids.shape[0], view))


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        max_num_seqs: int,
        max_model_len: int | None = None,
        on_capture=None,
    ):
        """Captures one graph per size in `graph_sizes(max_num_seqs)` now, on every rank in the same order.
        Paged cache: block tables of `table_width(cache, max_model_len)` blocks (None: the whole cache).
        `on_capture(size)` is called before each capture (progress output)."""
        problems = deployment_problems(cache.device.type, get_parallel_state().dp_size, model.parallel.ep_backend)
        capturable, experts = model.graph_capturable
        if not capturable:
            problems.append(
                f"experts that never sync the host (got moe backend {experts!r}; bfloat16 on a GPU picks triton)"
            )
        if problems:
            raise ValueError("CUDA graphs for decode need " + "; ".join(problems))
        self.model, self.cache, self.max_num_seqs = model, cache, max_num_seqs
        self.paged = isinstance(cache, PagedKVCache)
        self.width = table_width(cache, max_model_len or cache.capacity_tokens) if self.paged else 0
        self.steps: dict[int, CapturedStep] = {}  # B -> graph
        self.captures = 0  # graphs captured by this object, ever
        self._pool = None
        for size in reversed(graph_sizes(max_num_seqs)):  # largest first, the others reuse its memory
            if on_capture is not None:
                on_capture(size)
            self._capture(size)

    def batch_sizes(self) -> list[int]:
        """The padded batch sizes captured."""
        return sorted(self.steps)

    def eager_step(self, inputs: torch.Tensor, block_tables: torch.Tensor | None = None) -> torch.Tensor:
        """`decode_logits` of this model and cache."""
        return decode_logits(self.model, self.cache, inputs, block_tables)

    def _capture(self, size: int) -> None:
        device = self.cache.device
        inputs = torch.zeros(3, size, dtype=torch.long, device=device)
        tables = None
        if self.paged:
            inputs[1] = torch.arange(size, device=device)
            tables = torch.full((size, self.width), self.cache.scratch_block, dtype=torch.int32, device=device)
        else:
            inputs[1] = self.cache.scratch_slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sets up communicators
                self.eager_step(inputs, tables)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with count_collectives() as collectives, torch.cuda.graph(graph, pool=self._pool):
                logits = self.eager_step(inputs, tables)
        self._pool = graph.pool()
        self.steps[size] = CapturedStep(graph, inputs, tables, logits, collectives)
        self.captures += 1

    def step(self, ids: list[int], locations: list, positions: list[int], stats: CommStats) -> torch.Tensor:
        """One decode step for `len(ids)` sequences (`locations`: their slots, or block tables) -> logits
        `[len(ids), V]` (a view of the graph's output, valid until the next step). Adds the replayed
        collectives to `stats`."""
        count = len(ids)
        if count > self.max_num_seqs:
            raise ValueError(
                f"{count} sequences in one decode step; graphs were captured for up to {self.max_num_seqs}"
            )
        size = min(s for s in graph_sizes(self.max_num_seqs) if s >= count)
        captured, pad = self.steps[size], size - count
        if not self.paged:
            if any(p >= self.cache.max_len for p in positions):
                raise ValueError(f"a decode position reaches {max(positions)}; the cache holds {self.cache.max_len}")
            host = torch.tensor([ids + [0] * pad, locations + [self.cache.scratch_slot] * pad, positions + [0] * pad])
            captured.inputs.copy_(host)
        else:
            used = max(len(table) for table in locations)
            if used > self.width:
                raise ValueError(
                    f"a block table of {used} blocks in a decode step; graphs were captured for {self.width} "
                    f"(max_model_len)"
                )
            tables = padded_tables(locations, size, used, self.cache.scratch_block)
            captured.inputs[0::2].copy_(torch.tensor([ids + [0] * pad, positions + [0] * pad]))
            captured.block_tables[:, :used].copy_(torch.from_numpy(tables))
        captured.graph.replay()
        stats.add(captured.collectives)
        return captured.logits[:count]
