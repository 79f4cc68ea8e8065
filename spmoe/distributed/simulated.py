"""The simulated rank: rank 0 of a TP x DP x EP deployment run for real in one process, the other
ranks simulated (`ParallelConfig.simulate_rank`, the CLI's `--simulate-rank`; a
measurement mode only).

- The process groups are `SimulatedGroup`s. The counted collectives of `comm.py` see one and move no
  data: they return finite, deterministic tensors of the real shapes (an all-gather repeats this
  rank's block, or fills each peer's block as its caller says; a reduce-scatter keeps this rank's
  block; an all-reduce leaves its input), and count each call on the path the real group would take
  at its size (`comm.node_path`).
- The routers' top-k is a seeded function of (layer, global token) with k distinct experts
  (`seeded_routing`), so the blocks of the other ranks hold exactly the rows the real node would
  send this rank; `ParallelConfig.routing_seed` turns the same routing on in a real multi-rank run,
  which is how the tests compare the two. With `simulated_load="busiest"` each layer's expert ids
  are rotated so that this rank holds the experts of the layer's busiest EP rank. These torch
  functions are the reference (and the CPU's path); on CUDA the MoE layer runs both in one Triton
  launch, two when the rotation spans several programs (`layers/moe/seeded_triton.py`), where torch
  takes about 30 small kernels.
- The control plane (step plans, the DP output gather) runs as a world of one: with DP > 1 this rank
  serves the requests it is given as its DP group's share, and assumes every other DP group runs a
  batch of the same size.
"""

from dataclasses import dataclass

import torch

# Global token index of row i of DP group d: d * DP_STRIDE + i (no step has this many rows on one DP
# group).
DP_STRIDE = 1 << 24
LOADS = ("rank0", "busiest")
MIX = (-7046029254386353131, -4658895280553007687, -49064778989728563)  # 64-bit odd multipliers


@dataclass(frozen=True)
class SimulatedGroup:
    """A process group of `size` ranks of which only this process's rank `rank` exists."""

    name: str
    size: int
    rank: int = 0


def is_simulated(group) -> bool:
    return isinstance(group, SimulatedGroup)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer hash (wrapping int64 arithmetic, the same on CPU and CUDA)."""
    h = (h ^ (h >> 31)) * MIX[1]
    h = (h ^ (h >> 29)) * MIX[2]
    return h ^ (h >> 32)


def seeded_routing(
    seed: int,
    layer: int,
    first_tokens: torch.Tensor,
    valid: torch.Tensor,
    rows: int,
    experts: int,
    k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of B blocks of `rows` rows: block b's first `valid[b]` rows are the global tokens
    `first_tokens[b]`, `first_tokens[b] + 1`, ... (int64 `[B]` each) -> (ids `[B * rows, k]` int64:
    k distinct experts of `experts`, a seeded function of (seed, layer, token); weights
    `[B * rows, k]` float32, `scale / k` each). Pad rows (from `valid[b]` on) get id -1 and weight
    0. No host sync: it can run inside a CUDA graph."""
    device = first_tokens.device
    offsets = torch.arange(rows, device=device, dtype=torch.int64)
    tokens = (first_tokens[:, None] + offsets).reshape(-1)  # [B * rows]
    key = _mix(_mix(tokens * MIX[0] + seed) + layer)
    scores = _mix(key[:, None] + torch.arange(experts, device=device, dtype=torch.int64) * MIX[2])
    ids = scores.topk(k, dim=1).indices
    pad = (offsets >= valid[:, None]).reshape(-1, 1)
    return ids.masked_fill(pad, -1), torch.full_like(ids, 0, dtype=torch.float32).masked_fill(
        ~pad, scale / k
    )


def block_tokens(
    tokens: int, sharded: bool, tp_size: int, ep_size: int, dp_rank: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks of the EP group's ranks in one MoE call, for `seeded_routing` -> (first global
    token `[ep_size]`, valid rows `[ep_size]`), int64. EP rank j is TP rank j % tp_size of DP group
    j // tp_size; its block is its SP shard of its DP group's `tokens` rows (`sharded`) or all of
    them. A real run knows only its own DP group's row count: the ranks of other DP groups are given
    the same one (on a simulated rank, that is the assumption; a real rank reads its own block
    only). Without a dispatch (`ep_size` 1) the one block is DP group `dp_rank`'s."""
    j = torch.arange(ep_size, device=device, dtype=torch.int64)
    dp = j // tp_size if ep_size > 1 else torch.full_like(j, dp_rank)
    if not sharded:
        return dp * DP_STRIDE, torch.full_like(j, tokens)
    n = -(-tokens // tp_size)
    start = (j % tp_size) * n
    return dp * DP_STRIDE + start, (tokens - start).clamp(0, n)


def rotate_to_busiest(ids: torch.Tensor, ep_size: int, experts: int) -> torch.Tensor:
    """Expert ids `[R, k]` of every row the EP group routes in one layer (pad -1), relabelled so
    that EP rank 0 holds the experts of the rank that gets the most (row, expert) pairs: ids move
    down by that rank's first expert, modulo `experts`. Device-side, no host sync."""
    per_rank = experts // ep_size
    owner = torch.where(ids >= 0, ids // per_rank, ep_size).reshape(-1)
    load = torch.zeros(ep_size + 1, dtype=torch.int64, device=ids.device)
    load = load.scatter_add(0, owner, torch.ones_like(owner))[:ep_size]
    shift = load.argmax() * per_rank
    return torch.where(ids >= 0, (ids - shift) % experts, ids)


def banner(config) -> str:
    """The line a simulated job (`config.simulate_rank`) prints first."""
    return (
        f"SIMULATED RANK: rank 0 of tp={config.tensor_parallel_size} x "
        f"dp={config.data_parallel_size} (EP {config.world_size}) runs here; the other "
        f"{config.world_size - 1} ranks are simulated: collectives move no data, routing is seeded "
        f"(load: {config.simulated_load}). Outputs are not the model's; measurement only."
    )
