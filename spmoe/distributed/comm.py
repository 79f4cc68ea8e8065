"""Collectives with accounting.

Every collective the project runs goes through one of the four functions here, so `count_collectives()`
sees all of them. Bytes are the size of the full-length buffer of the call on this rank:

| kind           | bytes counted                        |
|----------------|--------------------------------------|
| all_reduce     | the tensor reduced                   |
| all_gather     | the gathered output (all ranks' rows)|
| reduce_scatter | the full input (before scattering)   |
| all_to_all     | the bytes this rank sends            |
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

# torch 2.13 renamed the single-tensor collectives; older torch (2.6-2.12) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-kind `{"count": int, "bytes": int}` of the collectives run while it was active."""

    counts: dict = field(default_factory=lambda: {k: {"count": 0, "bytes": 0} for k in KINDS})

    def record(self, kind: str, nbytes: int) -> None:
        self.counts[kind]["count"] += 1
        self.counts[kind]["bytes"] += nbytes

    def add(self, other: "CommStats") -> None:
        """Add `other`'s counts (a CUDA graph's collectives, counted once at capture, on each replay)."""
        for kind, value in other.counts.items():
            self.counts[kind]["count"] += value["count"]
            self.counts[kind]["bytes"] += value["bytes"]

    def as_dict(self) -> dict:
        return {k: dict(v) for k, v in self.counts.items()}


_ACTIVE: list[CommStats] = []


@contextmanager
def count_collectives(stats: CommStats | None = None):
    """Count every collective run inside the block into `stats` (a new one by default; nested blocks each
    count their own)."""
    stats = stats if stats is not None else CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def _record(kind: str, t: torch.Tensor) -> None:
    for stats in _ACTIVE:
        stats.record(kind, t.numel() * t.element_size())


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `x` over `group` (a sum unless `op` says otherwise), in place. Returns `x`."""
    _record("all_reduce", x)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`[m, ...]` on each rank -> `[m * world, ...]`, rank blocks in rank order."""
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    _record("all_gather", out)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`[m * world, ...]` partial sums -> `[m, ...]`: this rank's block of the sum."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter_rows needs rows divisible by the group size {world}, got {tuple(x.shape)}")
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _record("reduce_scatter", x)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Send `send_counts[j]` consecutive rows of `x` to rank j; receive `recv_counts[i]` rows from rank i."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    _record("all_to_all", x)
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out
