"""MoE work counters: rows each rank hands to the expert dispatch and rows each local
expert computes.

Without SP, with DP > 1, every TP rank of a DP group dispatches the same tokens, so the experts
compute each token t times; with SP each token is dispatched once. These counters make that visible:

    with count_moe_work() as work:
        model(...)
    # this rank: real rows dispatched; rows per local expert `[E_r]`
    work.rows_dispatched, work.expert_rows
    work.calls  # rows per local expert `[E_r]` of each MoE call (layer), in call order
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class MoEWork:
    rows_dispatched: int = 0  # real (not padding) token rows this rank sent to its experts' owners
    # `[local experts]` int64: (row, expert) pairs computed, summed
    expert_rows: torch.Tensor | None = None
    calls: list = field(default_factory=list)  # the same per MoE call (a layer), in call order

    def as_dict(self) -> dict:
        rows = [] if self.expert_rows is None else self.expert_rows.tolist()
        return {
            "rows_dispatched": self.rows_dispatched,
            "expert_rows": rows,
            "rows_computed": sum(rows),
        }


_ACTIVE: list[MoEWork] = []


@contextmanager
def count_moe_work():
    """Count the MoE work done inside the block (nested blocks each count their own)."""
    work = MoEWork()
    _ACTIVE.append(work)
    try:
        yield work
    finally:
        _ACTIVE.remove(work)


def record_dispatched(rows: int) -> None:
    for work in _ACTIVE:
        work.rows_dispatched += rows


def run_experts(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`experts(x, ids, weights)`, counting the pairs each local expert computes while a block is
    active (the count costs a host sync, so only then)."""
    if _ACTIVE:
        local = experts.local_ids(ids)
        rows = torch.bincount(local[local >= 0], minlength=experts.count).cpu()
        for work in _ACTIVE:
            work.expert_rows = rows if work.expert_rows is None else work.expert_rows + rows
            work.calls.append(rows)
    return experts(x, ids, weights)
