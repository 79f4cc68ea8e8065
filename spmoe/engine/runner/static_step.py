"""The step a CUDA graph captures, as plain functions of static-shape inputs (run eagerly too: the
tests compare them with the engine's own step): the decode or mixed step's hidden and logits, the
drafter's step, their inputs (padded block tables, mixed rows), the sizes captured, and what a
deployment lacks for graphs (`graphs.py` captures and replays them)."""

import numpy as np
import torch

from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

# a decode step's sequences, padded to the next: on an H200 (4 GLM-width layers, in a graph) a step
# takes 4.72 ms at 48 rows, 4.92 at 64, 5.40 at 128 and 6.46 at 256, about 8 us per row above 64, so
# 129 sequences padded to 256 took a fifth longer than they need; four sizes per doubling above 32
# keep the padding under a quarter of the rows (above 128, at most 31 pad rows, about 0.25 ms). Each
# size is one more graph captured at start-up, holding its [B * T, V] float32 logits (620 KB a row
# at 154880 tokens): up to 256, 18 graphs and 1519 rows, 0.88 GiB x T (powers of two alone: 9
# graphs, 511 rows, 0.29 GiB x T).
BATCH_SIZES = (
    1, 2, 4, 8, 16, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512
)  # fmt: skip
# a step's fed tokens, padded to the next: above about 200 tokens a step's time grows with its rows
# (`bench_decode_step.py`), so the sizes are close enough that padding adds at most a quarter above
# 128
MIXED_TOKENS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def deployment_problems(device_type: str, ep_backend: str) -> list[str]:
    """What the deployment lacks for captured decode steps (empty if nothing), known before any rank
    starts. Whether the experts can be captured is known only once they are built."""
    problems = []
    if device_type != "cuda":
        problems.append(f"a CUDA device (the model is on {device_type})")
    if ep_backend != "allgather_reducescatter":
        problems.append(f"ep_backend 'allgather_reducescatter' (got {ep_backend!r})")
    return problems


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured for up to `max_batch` sequences."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    """The padded sizes of the mixed-step graphs for a step token budget of
    `max_num_batched_tokens`."""
    most = min(max_num_batched_tokens, MIXED_TOKENS[-1])
    return [n for n in MIXED_TOKENS if n < most] + [most]


def table_width(cache: PagedKVCache, max_model_len: int) -> int:
    """Blocks in a captured step's block tables: enough for `max_model_len` positions, at most
    the cache's."""
    return min(-(-max_model_len // cache.block_size), cache.num_blocks)


def padded_tables(tables: list[list[int]], rows: int, width: int, scratch: int) -> np.ndarray:
    """Block tables of a decode step -> `[rows, width]` int32, each padded with `scratch`, then pad
    rows of `scratch` alone (a pad row writes its one token to the scratch block)."""
    out = np.full((rows, width), scratch, dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


def mixed_rows(
    tokens: list[list[int]], starts: list[int], size: int, pad_where: int
) -> list[list[int]]:
    """The inputs `[3, size]` (ids, where, positions; see `step_view`) of a mixed-step graph:
    sequence i's `tokens[i]` at positions `starts[i]` .. in table row i, laid end to end, then pad
    rows of token 0 in table row `pad_where`, at positions within its first block (`BLOCK_SIZE`)."""
    ids = [t for seq in tokens for t in seq]
    where = [i for i, seq in enumerate(tokens) for _ in seq]
    positions = [start + j for seq, start in zip(tokens, starts) for j in range(len(seq))]
    pad = size - len(ids)
    return [
        ids + [0] * pad,
        where + [pad_where] * pad,
        positions + [j % BLOCK_SIZE for j in range(pad)],
    ]


def step_view(
    cache: KVCache | PagedKVCache, where: torch.Tensor, positions: torch.Tensor, block_tables
):
    """The cache view of rows `[N]` at `positions` `[N]`: `where` is each row's slot (slot cache) or
    its sequence's row of block_tables `[S, W]` (paged cache)."""
    if block_tables is None:
        return cache.decode_view(where, positions)
    return cache.decode_view(block_tables, where, positions)


def decode_hidden(
    model: DeepseekV32ForCausalLM, cache, inputs: torch.Tensor, block_tables
) -> torch.Tensor:
    """The step a graph captures, run eagerly: inputs `[3, N]` (ids, where, positions; see
    `step_view`) and, paged, block_tables `[S, W]` -> the post-norm hidden `[N, H]`, before the LM
    head. Every DP rank replays a graph of the same N (`StepGraphs.shape`), so N is the largest DP
    batch: no rank asks the others."""
    ids, where, positions = inputs
    rows = ids.shape[0]
    view = step_view(cache, where, positions, block_tables)
    return model.forward_hidden(ids, positions, [1] * rows, view, max_tokens=rows)


def draft_tokens(
    model: DeepseekV32ForCausalLM,
    cache: KVCache | PagedKVCache,
    inputs: torch.Tensor,
    block_tables: torch.Tensor | None,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    last: torch.Tensor,
    where: torch.Tensor,
    first: torch.Tensor,
    forced: torch.Tensor,
) -> torch.Tensor:
    """The drafter's step a graph captures, run eagerly, after a target step over S sequences of T
    fed rows: inputs `[3, S * T]` and block_tables as that step's, hidden `[S * T, H]` its post-norm
    hidden; next_ids `[S * T]` the token after each fed row; per sequence `[S]`: last, its last
    verified row; where and first, the room (see `step_view`) and first position of its k - 1
    one-token steps; forced `[S, k]` the lookup's draft at each slot (-1: none) -> the MTP layer's
    own choice at each slot `[S, k]` int64.

    The MTP layer catches up on every fed row (rows past a sequence's last verified one write cache
    rows that are rewritten before they are read), its choice for slot 1 comes from the last
    verified row, and each next one from a one-token step fed the previous slot's draft (the forced
    token where there is one, else its own choice) and the MTP layer's own post-norm hidden. As in
    `decode_hidden`, each forward's rows are the largest DP batch."""
    _, rows_where, positions = inputs
    view = step_view(cache, rows_where, positions, block_tables)
    rows = next_ids.shape[0]
    # [S, H]
    h = model.forward_draft_hidden(next_ids, positions, hidden, [1] * rows, view, rows)[last]
    own = [model.compute_draft_logits(h).argmax(-1)]  # [S] per slot
    ones = [1] * last.shape[0]
    for i in range(forced.shape[1] - 1):
        tokens = torch.where(forced[:, i] >= 0, forced[:, i], own[-1])
        step_positions = first + i
        view = step_view(cache, where, step_positions, block_tables)
        h = model.forward_draft_hidden(tokens, step_positions, h, ones, view, len(ones))
        own.append(model.compute_draft_logits(h).argmax(-1))
    return torch.stack(own, dim=1)
