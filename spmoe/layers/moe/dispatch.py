"""EP dispatch and combine for SP layers: each EP rank holds its own SHARDED `[n, H]` token block and gets
back the complete routed output of those rows. Two backends, same result:

- `allgather_reducescatter`: gather every rank's block (routing and hidden) so each rank runs its local
  experts on all `n * P` rows; reduce-scatter the partial outputs back.
- `all_to_all`: send each row only to the ranks that own one of its experts, once per rank however many of
  its experts live there; compute there; send the partial outputs back and sum them per row.
"""

import torch

from spmoe.distributed.comm import all_gather_rows, all_to_all_rows, reduce_scatter_rows


def allgather_reducescatter(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts, group):
    """x `[n, H]`, ids / weights `[n, k]` -> `[n, H]`: the routed output of this rank's rows, complete."""
    k = ids.shape[1]
    routing = all_gather_rows(torch.cat([ids.float(), weights.float()], dim=1), group)  # [n*P, 2k]
    gathered = all_gather_rows(x, group)  # [n*P, H]
    partial = experts(gathered, routing[:, :k].long(), routing[:, k:])
    return reduce_scatter_rows(partial, group)


def all_to_all(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts, group):
    """x `[n, H]`, ids / weights `[n, k]` -> `[n, H]`: the routed output of this rank's rows, complete.

    Three all-to-alls: the row counts, the rows with their routing packed behind the hidden columns, and the
    partial outputs back. Experts are split evenly: rank r owns ids `[r * E_r, (r + 1) * E_r)`.
    """
    world, (n, k), size = torch.distributed.get_world_size(group), ids.shape, x.shape[1]
    owner = torch.where(ids >= 0, ids // experts.count, world)  # [n, k]; world = nowhere (pad rows)
    needs = torch.zeros(n, world + 1, dtype=torch.bool, device=x.device).scatter_(1, owner, True)[:, :world]
    send_rank, send_row = needs.t().nonzero(as_tuple=True)  # by destination rank, then row
    send_counts = needs.sum(0)  # [P]
    recv_counts = all_to_all_rows(send_counts.unsqueeze(1), [1] * world, [1] * world, group).squeeze(1)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    routing = torch.cat([ids.float(), weights.float()], dim=1)[send_row]  # [S, 2k] float32
    payload = torch.cat([x[send_row], routing.view(x.dtype)], dim=1)  # routing's bytes ride behind the hidden
    received = all_to_all_rows(payload, sends, recvs, group)  # [R, H + ...]
    got_routing = received[:, size:].contiguous().view(torch.float32)  # [R, 2k]
    partial = experts(received[:, :size], got_routing[:, :k].long(), got_routing[:, k:])  # [R, H]
    returned = all_to_all_rows(partial, recvs, sends, group)  # [S, H]
    return torch.zeros_like(x).index_add_(0, send_row, returned)


DISPATCH = {"allgather_reducescatter": allgather_reducescatter, "all_to_all": all_to_all}
