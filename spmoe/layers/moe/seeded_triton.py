"""The simulated rank's stand-in routing (`simulated.seeded_routing`, and
`simulated.rotate_to_busiest` on the busiest load) in one Triton launch, two when the busiest
rotation spans more than one program; the torch reference (with `simulated.block_tokens`) takes
about 30 small int64 kernels a MoE layer.

`_seeded_routing_kernel`, one program per `BLOCK_ROWS` rows: each row's block (first token and valid
rows, as `simulated.block_tokens` lays the EP group's blocks out), token and key, the scores of all
experts (`[BLOCK_ROWS, experts]`, the reference's int64 hashes: Triton's int64 products wrap as
torch's do, and `>>` on signed integers is arithmetic in both), and the k largest, largest first, as
`torch.topk`. A row's scores are distinct: the hash is a bijection of 64-bit integers (xor-shifts
and odd multipliers) and the keys `key + e * odd` of one row's experts differ, so the order has no
ties. Pad rows get id -1 and weight 0. With the busiest load it counts its rows' (row, expert) pairs
per EP rank; when one program holds every row it rotates the ids itself, else it leaves its counts
and `_rotate_to_busiest_kernel` sums them and rotates all ids in place. The busiest rank is the
first of the largest count, as `argmax` picks it.

Shapes depend only on the inputs' shapes and nothing is read back to the host, so it runs inside
CUDA graphs.
"""

import torch
import triton
import triton.language as tl

from spmoe.distributed.simulated import DP_STRIDE, MIX

MIX0 = tl.constexpr(MIX[0])
MIX1 = tl.constexpr(MIX[1])
MIX2 = tl.constexpr(MIX[2])
INT64_MIN = tl.constexpr(-(2**63))
STRIDE = tl.constexpr(DP_STRIDE)
TILE = 8192  # scores a program holds: BLOCK_ROWS rows of the experts (power of 2)
ROTATE_BLOCK = 2048  # ids a program of `_rotate_to_busiest_kernel` moves
COUNTS_BLOCK = 64  # programs' counts it sums per step
NUM_WARPS = 8


@triton.jit
def _mix(h):
    """`simulated._mix` on int64."""
    h = (h ^ (h >> 31)) * MIX1
    h = (h ^ (h >> 29)) * MIX2
    return h ^ (h >> 32)


@triton.jit
def _busiest_shift(counts, ranks, EP: tl.constexpr, PER_RANK: tl.constexpr):
    """Pairs per EP rank `[BLOCK_EP]` -> the first id of the first rank of most pairs (int64)."""
    counts = tl.where(ranks < EP, counts, -1)
    most = tl.max(counts, axis=0)
    return tl.min(tl.where(counts == most, ranks, EP), axis=0).to(tl.int64) * PER_RANK


@triton.jit
def _rotated(ids, shift, EXPERTS: tl.constexpr):
    """Ids moved down by `shift` modulo EXPERTS; pad ids (-1) kept."""
    moved = ids - shift
    moved = tl.where(moved < 0, moved + EXPERTS, moved)
    return tl.where(ids >= 0, moved, ids)


@triton.jit
def _block_tokens(block, tokens, tp_size, dp_rank, SHARDED: tl.constexpr, BLOCKS: tl.constexpr):
    """`simulated.block_tokens` of blocks `block` (int64) -> (their first tokens, valid rows)."""
    if BLOCKS > 1:
        dp = block // tp_size
    else:
        dp = block * 0 + dp_rank
    if SHARDED:
        n = (tokens + tp_size - 1) // tp_size
        start = (block % tp_size) * n
        valid = tl.minimum(tl.maximum(tokens - start, 0), n)
    else:
        start = block * 0
        valid = block * 0 + tokens
    return dp * STRIDE + start, valid


# a variant for each (experts, k, EP, load, block layout), not for each layer, seed or row count
@triton.jit(do_not_specialize=["seed", "layer", "tokens", "tp_size", "dp_rank", "rows"])
def _seeded_routing_kernel(
    ids_ptr,
    weights_ptr,
    counts_ptr,
    seed,
    layer,
    tokens,
    tp_size,
    dp_rank,
    rows,
    weight,
    SHARDED: tl.constexpr,
    BLOCKS: tl.constexpr,
    EXPERTS: tl.constexpr,
    K: tl.constexpr,
    EP: tl.constexpr,
    BUSIEST: tl.constexpr,
    ONE_PROGRAM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_EP: tl.constexpr,
):
    program = tl.program_id(0)
    row = program.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = row < BLOCKS * rows
    block = row // rows
    offset = row % rows
    first, valid = _block_tokens(block, tokens, tp_size, dp_rank, SHARDED, BLOCKS)
    real = in_range & (offset < valid)
    key = _mix(_mix((first + offset) * MIX0 + seed) + layer)
    experts = tl.arange(0, BLOCK_E)
    scores = _mix(key[:, None] + experts.to(tl.int64)[None, :] * MIX2)
    taken = tl.broadcast_to((experts >= EXPERTS)[None, :], (BLOCK_ROWS, BLOCK_E))
    cols = tl.arange(0, BLOCK_K)
    ids = tl.full((BLOCK_ROWS, BLOCK_K), -1, tl.int64)
    for j in tl.static_range(K):
        # INT64_MIN stands for taken lanes; a score of INT64_MIN itself is still found by `pick`
        best = tl.max(tl.where(taken, INT64_MIN, scores), axis=1)
        other = taken | (scores != best[:, None])
        pick = tl.min(tl.where(other, BLOCK_E, experts[None, :]), axis=1)
        taken = taken | (experts[None, :] == pick[:, None])
        ids = tl.where(cols[None, :] == j, pick.to(tl.int64)[:, None], ids)
    ids = tl.where(real[:, None], ids, -1)
    if BUSIEST:
        ranks = tl.arange(0, BLOCK_EP)
        owner = tl.where(real[:, None] & (cols < K)[None, :], ids // (EXPERTS // EP), -1)
        counts = tl.sum(tl.sum((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), 0), 0)
        if ONE_PROGRAM:
            ids = _rotated(ids, _busiest_shift(counts, ranks, EP, EXPERTS // EP), EXPERTS)
        else:
            tl.store(counts_ptr + program * BLOCK_EP + ranks, counts)
    at = row[:, None] * K + cols[None, :]
    mask = in_range[:, None] & (cols < K)[None, :]
    tl.store(ids_ptr + at, ids, mask=mask)
    tl.store(weights_ptr + at, tl.where(ids >= 0, weight, 0.0), mask=mask)


@triton.jit(do_not_specialize=["programs", "numel"])
def _rotate_to_busiest_kernel(
    ids_ptr,
    counts_ptr,
    programs,
    numel,
    EXPERTS: tl.constexpr,
    EP: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_EP: tl.constexpr,
):
    ranks = tl.arange(0, BLOCK_EP)
    counts = tl.zeros((BLOCK_EP,), tl.int32)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        at = p[:, None] * BLOCK_EP + ranks[None, :]
        counts += tl.sum(tl.load(counts_ptr + at, mask=(p < programs)[:, None], other=0), 0)
    shift = _busiest_shift(counts, ranks, EP, EXPERTS // EP)
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + at, mask=at < numel)
    tl.store(ids_ptr + at, _rotated(ids, shift, EXPERTS), mask=at < numel)


def seeded_routing(
    seed: int,
    layer: int,
    blocks: tuple[int, bool, int, int, int],
    rows: int,
    experts: int,
    k: int,
    scale: float,
    device: torch.device,
    busiest_ep: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`simulated.seeded_routing(seed, layer, *simulated.block_tokens(*blocks, device), rows,
    experts, k, scale)` (blocks: `block_tokens`' tokens, sharded, tp_size, ep_size and dp_rank ->
    ids `[ep_size * rows, k]` int64, weights `[ep_size * rows, k]` float32), then, with
    `busiest_ep`, `simulated.rotate_to_busiest(ids, busiest_ep, experts)`: the same ids and weights,
    bit for bit."""
    tokens, sharded, tp_size, ep_size, dp_rank = blocks
    if min(tokens, rows, dp_rank) < 0 or min(tp_size, ep_size) < 1:
        raise ValueError(
            f"seeded_routing needs tokens, rows, dp_rank >= 0 and tp_size, ep_size >= 1, got "
            f"blocks {blocks}, rows {rows}"
        )
    if not 1 <= k <= experts:
        raise ValueError(f"seeded_routing picks k of {experts} experts, got k={k}")
    ep = busiest_ep or 1
    if ep < 1 or experts % ep:
        raise ValueError(f"the busiest rotation needs EP ranks dividing {experts}, got {ep}")
    total = ep_size * rows
    ids = torch.empty(total, k, dtype=torch.int64, device=device)
    weights = torch.empty(total, k, dtype=torch.float32, device=device)
    if not total:
        return ids, weights
    block_e = triton.next_power_of_2(experts)
    block_rows = max(1, TILE // block_e)
    programs = triton.cdiv(total, block_rows)
    block_ep = triton.next_power_of_2(ep)
    counts = torch.empty(programs, block_ep, dtype=torch.int32, device=device)
    _seeded_routing_kernel[(programs,)](
        ids,
        weights,
        counts,
        seed,
        layer,
        tokens,
        tp_size,
        dp_rank,
        rows,
        scale / k,
        SHARDED=sharded,
        BLOCKS=ep_size,
        EXPERTS=experts,
        K=k,
        EP=ep,
        BUSIEST=busiest_ep is not None,
        ONE_PROGRAM=busiest_ep is not None and programs == 1,
        BLOCK_ROWS=block_rows,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_EP=block_ep,
        num_warps=NUM_WARPS,
    )
    if busiest_ep is not None and programs > 1:
        _rotate_to_busiest_kernel[(triton.cdiv(total * k, ROTATE_BLOCK),)](
            ids,
            counts,
            programs,
            total * k,
            EXPERTS=experts,
            EP=ep,
            BLOCK=ROTATE_BLOCK,
            BLOCK_P=COUNTS_BLOCK,
            BLOCK_EP=block_ep,
        )
    return ids, weights
