"""Collectives with accounting, and the choice between NCCL and the one-shot kernels.

Every collective the project runs goes through this module. The model's go through the four counted
functions (`all_reduce`, `all_gather_rows`, `reduce_scatter_rows`, `all_to_all_rows`), so `count_collectives()`
sees all of them. The host objects of the control plane (the serving loop's step plans, gathered outputs and
job results) go through `broadcast_object` and `gather_object` on the gloo control group: host-only, never on
the model's path, and not counted. On groups where `enable_one_shot` succeeded, small all-gathers, reduce-scatters and
all-reduce sums of floating-point tensors run as one-shot kernels (`one_shot.py`) up to `ONE_SHOT_MAX_BYTES`
of buffer, the sizes where they beat NCCL inside a CUDA graph (`benchmarks/bench_collectives.py`); NCCL runs
the rest. Bytes are the size of the full-length buffer of the call on this rank:

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
_ONE_SHOT: dict = {}  # group -> OneShot
# Buffer bytes up to which the one-shot kernel beat NCCL in a CUDA graph on 2 x H200 at H = 6144, bf16
# (docs/performance-log/2026-11.md): all-gather and reduce-scatter up to N = 256 tokens, all-reduce up to N = 64.
ONE_SHOT_MAX_BYTES = {"all_gather": 4 << 20, "reduce_scatter": 4 << 20, "all_reduce": 2 << 20}


def enable_one_shot(group, device: torch.device) -> str | None:
    """Set up the one-shot kernels on `group` (collective over it). Returns None, or why they are not used;
    the members agree, so either all of them use the kernels or none does."""
    from spmoe.distributed.one_shot import OneShot

    reason = None
    try:
        one_shot = OneShot(group, device)
    except Exception as e:  # noqa: BLE001 - any failure means NCCL, with the reason reported
        reason = f"{type(e).__name__}: {e}"
    agreed = torch.tensor([reason is None], dtype=torch.int32, device=device)
    all_reduce(agreed, group, op="min")
    if not agreed.item():
        return reason or "another rank of the group could not set them up"
    _ONE_SHOT[group] = one_shot
    return None


def disable_one_shot() -> None:
    """Forget every group's one-shot kernels (the groups are being destroyed)."""
    _ONE_SHOT.clear()


def _one_shot(kind: str, x: torch.Tensor, group):
    """The group's one-shot kernels if they should take this call, else None (NCCL)."""
    one_shot = _ONE_SHOT.get(group)
    return (
        one_shot
        if one_shot is not None and one_shot.fits(kind, x, ONE_SHOT_MAX_BYTES[kind])
        else None
    )


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
    _record_bytes(kind, t.numel() * t.element_size())


def _record_bytes(kind: str, nbytes: int) -> None:
    for stats in _ACTIVE:
        stats.record(kind, nbytes)


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over `group` in place (`op`: "sum", "max" or "min"). Returns `x`."""
    _record("all_reduce", x)
    one_shot = _one_shot("all_reduce", x, group) if op == "sum" and x.is_contiguous() else None
    if one_shot is not None:
        return one_shot.run("all_reduce", x, x)
    dist.all_reduce(x, op=REDUCE_OPS[op], group=group)
    return x


def one_shot_add_rms_norm(
    kind: str, x: torch.Tensor, residual: torch.Tensor | None, norm, num_tokens: int, group
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `kind` collective of x over `group` fused with the RMSNorm `norm`'s residual add and norm, as one
    one-shot kernel (`OneShot.add_rms_norm`, which gives the shapes) -> (normed, new residual); None, with
    nothing run, where the group has no one-shot kernels or the call does not fit them. Counted as the
    collective alone would be (reduce-scatter and all-gather: the `[n * t, H]` padded rows)."""
    one_shot = _ONE_SHOT.get(group)
    if (
        one_shot is None
        or x.dim() != 2
        or not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
    ):
        return None
    row_bytes = x.shape[1] * x.element_size()
    if one_shot.world * one_shot.norm_rows(kind, num_tokens) * row_bytes > ONE_SHOT_MAX_BYTES[kind]:
        return None  # the buffer bytes per rank, as `OneShot.buffer_bytes` counts them for the collective alone
    counted = (
        num_tokens
        if kind == "all_reduce"
        else one_shot.norm_rows(kind, num_tokens) * one_shot.world
    )
    _record_bytes(kind, counted * row_bytes)
    return one_shot.add_rms_norm(kind, x, residual, norm.weight, norm.eps, num_tokens)


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`[m, ...]` on each rank -> `[m * world, ...]`, rank blocks in rank order."""
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    _record("all_gather", out)
    one_shot = _one_shot("all_gather", x, group)
    if one_shot is not None:
        return one_shot.run("all_gather", x.contiguous(), out)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`[m * world, ...]` partial sums -> `[m, ...]`: this rank's block of the sum."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_rows needs rows divisible by the group size {world}, got {tuple(x.shape)}"
        )
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _record("reduce_scatter", x)
    one_shot = _one_shot("reduce_scatter", x, group)
    if one_shot is not None:
        return one_shot.run("reduce_scatter", x.contiguous(), out)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_to_all_rows(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group
) -> torch.Tensor:
    """Send `send_counts[j]` consecutive rows of `x` to rank j; receive `recv_counts[i]` rows from rank i."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    _record("all_to_all", x)
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def broadcast_object(obj, group, src: int = 0):
    """A picklable host object from global rank `src` to every rank of `group` (the gloo control group) ->
    the object on every rank (`obj` is ignored on the others). A group of one rank returns `obj` as it is
    (not pickled: `spmoe serve` on one rank broadcasts a plan every step)."""
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj, group, dst: int = 0) -> list | None:
    """Every rank's picklable host object -> on global rank `dst` the list in group rank order, else None."""
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered
