"""EP dispatch and combine, backend `allgather_reducescatter`.

Each EP rank holds a SHARDED `[n, H]` token block. Dispatch gathers every rank's block (hidden and routing)
so each rank can run its local experts on all `n * P` rows; combine reduce-scatters the per-rank partial
expert outputs back, so each rank receives the complete routed output of its own rows.
"""

import torch

from spmoe.distributed.comm import all_gather_rows, reduce_scatter_rows


def allgather_reducescatter(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts, group):
    """x `[n, H]`, ids / weights `[n, k]` -> `[n, H]`: the routed output of this rank's rows, complete."""
    k = ids.shape[1]
    routing = all_gather_rows(torch.cat([ids.float(), weights.float()], dim=1), group)  # [n*P, 2k]
    gathered = all_gather_rows(x, group)  # [n*P, H]
    partial = experts(gathered, routing[:, :k].long(), routing[:, k:])
    return reduce_scatter_rows(partial, group)
