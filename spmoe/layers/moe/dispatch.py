"""EP dispatch and combine: each EP rank holds its own block of token rows (its SP shard, or with DP
> 1 its DP group's tokens) and gets back the complete routed output of those rows. Blocks may differ
in size across ranks (DP ranks have different batches); `rows_max`, the largest block, is agreed
once per step. Two backends, same result:

- `allgather_reducescatter`: gather every rank's block (hidden with its routing, in one all-gather)
  so each rank runs its local experts on all `n * P` rows; reduce-scatter the partial outputs back.
- `all_to_all`: send each row only to the ranks that own one of its experts, once per rank however
  many of its experts live there; compute there; send the partial outputs back and sum them per row.
"""

import torch

from spmoe.distributed.comm import all_gather_rows, all_to_all_rows, reduce_scatter_rows
from spmoe.distributed.groups import group_size
from spmoe.layers.moe.work import run_experts


def allgather_reducescatter(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts,
    group,
    rows_max: int,
    node: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """x `[n, H]`, ids / weights `[n, k]` -> `[n, H]`: the routed output of this rank's rows,
    complete. Blocks are padded to `rows_max` rows with id -1, so every rank gathers the same shape.
    The routing rides behind the hidden columns (its float32 bytes viewed in x's dtype): one
    all-gather, not two. `node`: on a simulated group, every rank's ids and weights
    `[P * rows_max, k]`, which the simulated all-gather returns behind copies of this rank's
    hidden rows."""
    (n, k), pad, size = ids.shape, rows_max - ids.shape[0], x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros(pad, size)])
        ids, weights = (
            torch.cat([ids, ids.new_full((pad, k), -1)]),
            torch.cat([weights, weights.new_zeros(pad, k)]),
        )
    routing = torch.cat([ids.float(), weights.float()], dim=1)  # [rows_max, 2k] float32
    filled = None
    if node is not None:
        every = torch.cat([node[0].float(), node[1].float()], dim=1)  # [rows_max*P, 2k]
        filled = torch.cat([x.repeat(group_size(group), 1), every.view(x.dtype)], dim=1)
    # [rows_max*P, H + ...]
    gathered = all_gather_rows(torch.cat([x, routing.view(x.dtype)], dim=1), group, filled)
    got = gathered[:, size:].view(torch.float32)  # [rows_max*P, 2k], a strided view
    partial = run_experts(experts, gathered[:, :size], got[:, :k].long(), got[:, k:])
    return reduce_scatter_rows(partial, group)[:n]


def all_to_all(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts,
    group,
    rows_max: int,
    node: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """x `[n, H]`, ids / weights `[n, k]` -> `[n, H]`: the routed output of this rank's rows,
    complete. Uneven blocks need no padding here (`rows_max` is unused); `node` must be None (no
    simulated group).

    Three all-to-alls: the row counts, the rows with their routing packed behind the hidden columns,
    and the partial outputs back. Experts are split evenly: rank r owns ids
    `[r * E_r, (r + 1) * E_r)`.
    """
    world, (n, k), size = group_size(group), ids.shape, x.shape[1]
    owner = torch.where(ids >= 0, ids // experts.count, world)  # [n, k]; world = nowhere (pad rows)
    needs = torch.zeros(n, world + 1, dtype=torch.bool, device=x.device).scatter_(1, owner, True)[
        :, :world
    ]
    send_rank, send_row = needs.t().nonzero(as_tuple=True)  # by destination rank, then row
    send_counts = needs.sum(0)  # [P]
    recv_counts = all_to_all_rows(
        send_counts.unsqueeze(1), [1] * world, [1] * world, group
    ).squeeze(1)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    routing = torch.cat([ids.float(), weights.float()], dim=1)[send_row]  # [S, 2k] float32
    # routing's bytes ride behind the hidden
    payload = torch.cat([x[send_row], routing.view(x.dtype)], dim=1)
    received = all_to_all_rows(payload, sends, recvs, group)  # [R, H + ...]
    got_routing = received[:, size:].contiguous().view(torch.float32)  # [R, 2k]
    # [R, H]
    partial = run_experts(
        experts, received[:, :size], got_routing[:, :k].long(), got_routing[:, k:]
    )
    returned = all_to_all_rows(partial, recvs, sends, group)  # [S, H]
    return torch.zeros_like(x).index_add_(0, send_row, returned)


DISPATCH = {"allgather_reducescatter": allgather_reducescatter, "all_to_all": all_to_all}
