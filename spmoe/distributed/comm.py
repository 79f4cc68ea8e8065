"""Collectives with accounting, and the choice between NCCL and the one-shot kernels.

Every collective the project runs goes through this module. The model's go through the four counted
functions (`all_reduce`, `all_gather_rows`, `reduce_scatter_rows`, `all_to_all_rows`), so
`count_collectives()` sees all of them. The host objects of the control plane (the serving loop's
step plans, gathered outputs and job results) go through `broadcast_object` and `gather_object` on
the gloo control group: host-only, never on the model's path, and not counted. On groups where
`enable_one_shot` succeeded, small all-gathers, reduce-scatters and all-reduce sums of
floating-point tensors run as one-shot kernels (`one_shot.py`) up to `ONE_SHOT_MAX_BYTES` of buffer,
the sizes where they beat NCCL inside a CUDA graph (`benchmarks/bench_collectives.py`); NCCL runs
the rest. Bytes are the size of the full-length buffer of the call on this rank:

| kind           | bytes counted                        |
|----------------|--------------------------------------|
| all_reduce     | the tensor reduced                   |
| all_gather     | the gathered output (all ranks' rows)|
| reduce_scatter | the full input (before scattering)   |
| all_to_all     | the bytes this rank sends            |

Each call is also counted under its path: "one_shot_fused" (a collective fused with its add-norm),
"one_shot", "nccl" or "gloo". On a simulated group (`simulated.SimulatedGroup`: the other ranks do
not exist) the functions move no data, return finite, deterministic tensors of the real shapes and
count the path the real group would take at that size (`simulated.node_path`).
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmoe.distributed.simulated import is_simulated

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

# torch 2.13 renamed the single-tensor collectives; older torch (2.6-2.12) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-kind `{"count": int, "bytes": int}` of the collectives run while it was active, and the
    same per (kind, path) in `paths`."""

    counts: dict = field(default_factory=lambda: {k: {"count": 0, "bytes": 0} for k in KINDS})
    paths: dict = field(default_factory=dict)  # (kind, path) -> {"count": int, "bytes": int}

    def record(self, kind: str, nbytes: int, path: str) -> None:
        for entry in (self.counts[kind], self.paths.setdefault((kind, path), _zero())):
            entry["count"] += 1
            entry["bytes"] += nbytes

    def add(self, other: "CommStats") -> None:
        """Add `other`'s counts (a CUDA graph's collectives, counted once at capture, on
        each replay)."""
        for kind, value in other.counts.items():
            self.counts[kind]["count"] += value["count"]
            self.counts[kind]["bytes"] += value["bytes"]
        for key, value in other.paths.items():
            entry = self.paths.setdefault(key, _zero())
            entry["count"] += value["count"]
            entry["bytes"] += value["bytes"]

    def as_dict(self) -> dict:
        return {k: dict(v) for k, v in self.counts.items()}

    def path_rows(self) -> list[dict]:
        """`[{"kind", "path", "count", "bytes"}]`, one per (kind, path) seen, sorted."""
        return [{"kind": k, "path": p, **v} for (k, p), v in sorted(self.paths.items())]


def _zero() -> dict:
    return {"count": 0, "bytes": 0}


_ACTIVE: list[CommStats] = []
_ONE_SHOT: dict = {}  # group -> OneShot
# Buffer bytes up to which the one-shot kernel beat NCCL in a CUDA graph on 2 x H200 at H = 6144,
# bf16 (docs/performance-log/2026-11.md): all-gather and reduce-scatter up to N = 256 tokens,
# all-reduce up to N = 64.
ONE_SHOT_MAX_BYTES = {"all_gather": 4 << 20, "reduce_scatter": 4 << 20, "all_reduce": 2 << 20}


def enable_one_shot(group, device: torch.device) -> str | None:
    """Set up the one-shot kernels on `group` (collective over it). Returns None, or why they are
    not used; the members agree, so either all of them use the kernels or none does."""
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


def node_path(kind: str, x: torch.Tensor, world: int, op: str = "sum") -> str:
    """The path the real group of `world` GPUs takes for a `kind` call on input `x` (the input of
    all_gather and all_reduce, the full input of reduce_scatter): "one_shot" where the one-shot
    kernel takes it (`ONE_SHOT_MAX_BYTES`, the buffer), else "nccl"."""
    from spmoe.distributed.one_shot import BUFFER_BYTES, DTYPES

    if kind not in ONE_SHOT_MAX_BYTES or op != "sum" or x.dtype not in DTYPES:
        return "nccl"
    buffer = x.numel() * x.element_size() * (1 if kind == "reduce_scatter" else world)
    return "one_shot" if buffer <= min(ONE_SHOT_MAX_BYTES[kind], BUFFER_BYTES) else "nccl"


def disable_one_shot() -> None:
    """Forget every group's one-shot kernels (the groups are being destroyed)."""
    _ONE_SHOT.clear()


def group_size(group) -> int:
    """The number of ranks in `group` (a simulated group's included)."""
    return group.size if is_simulated(group) else dist.get_world_size(group)


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
    """Count every collective run inside the block into `stats` (a new one by default; nested blocks
    each count their own)."""
    stats = stats if stats is not None else CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:  # by identity: CommStats compare by value, and nested blocks may hold equal counts
        del _ACTIVE[next(i for i, active in enumerate(_ACTIVE) if active is stats)]


def _record(kind: str, t: torch.Tensor, path: str) -> None:
    _record_bytes(kind, t.numel() * t.element_size(), path)


def _record_bytes(kind: str, nbytes: int, path: str) -> None:
    for stats in _ACTIVE:
        stats.record(kind, nbytes, path)


def _backend(x: torch.Tensor) -> str:
    return "nccl" if x.is_cuda else "gloo"


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over `group` in place (`op`: "sum", "max" or "min"). Returns `x`
    (simulated: unchanged)."""
    if is_simulated(group):
        _record("all_reduce", x, node_path("all_reduce", x, group.size, op))
        return x
    one_shot = _one_shot("all_reduce", x, group) if op == "sum" and x.is_contiguous() else None
    _record("all_reduce", x, "one_shot" if one_shot is not None else _backend(x))
    if one_shot is not None:
        return one_shot.run("all_reduce", x, x)
    dist.all_reduce(x, op=REDUCE_OPS[op], group=group)
    return x


def one_shot_add_rms_norm(
    kind: str, x: torch.Tensor, residual: torch.Tensor | None, norm, num_tokens: int, group
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `kind` collective of x over `group` fused with the RMSNorm `norm`'s residual add and
    norm, as one one-shot kernel (`OneShot.add_rms_norm`, which gives the shapes) -> (normed, new
    residual); None, with nothing run, where the group has no one-shot kernels or the call does not
    fit them. Counted as the collective alone would be (reduce-scatter and all-gather: the
    `[n * t, H]` padded rows). A simulated group on CUDA runs this rank's part: the add-norm of its
    rows, its block or its rows repeated for the others'."""
    simulated = is_simulated(group)
    one_shot = None if simulated else _ONE_SHOT.get(group)
    if (
        (one_shot is None and not simulated)
        or x.dim() != 2
        or not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
    ):
        return None
    world = group.size if simulated else one_shot.world
    rows = num_tokens if kind == "all_reduce" else -(-num_tokens // world)
    row_bytes = x.shape[1] * x.element_size()
    if world * rows * row_bytes > ONE_SHOT_MAX_BYTES[kind]:
        # the buffer bytes per rank, as `OneShot.buffer_bytes` counts them for the collective alone
        return None
    _record_bytes(
        kind, (rows if kind == "all_reduce" else rows * world) * row_bytes, "one_shot_fused"
    )
    if simulated:
        return _simulated_add_rms_norm(kind, x, residual, norm, num_tokens, rows, group)
    return one_shot.add_rms_norm(kind, x, residual, norm.weight, norm.eps, num_tokens)


def _simulated_add_rms_norm(kind, x, residual, norm, num_tokens: int, rows: int, group):
    """This rank's part of `one_shot_add_rms_norm` on a simulated group (shapes as there)."""
    if kind == "reduce_scatter":  # this rank's block of the partial sum, zero pad past N
        x = x[group.rank * rows : (group.rank + 1) * rows]
        x = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if x.shape[0] < rows else x
    normed, new_residual = norm.add_norm(x, residual)
    if kind == "all_gather":
        normed = normed.repeat(group.size, 1)[:num_tokens]
    return normed, new_residual


def all_gather_rows(
    x: torch.Tensor, group, simulated_out: torch.Tensor | None = None
) -> torch.Tensor:
    """`[m, ...]` on each rank -> `[m * world, ...]`, rank blocks in rank order. On a simulated
    group: `simulated_out` (the blocks the other ranks would send, as the caller knows them), or by
    default this rank's block repeated."""
    world = group_size(group)
    if is_simulated(group):
        _record_bytes(
            "all_gather", x.numel() * x.element_size() * world, node_path("all_gather", x, world)
        )
        if simulated_out is None:
            return x.repeat(world, *([1] * (x.dim() - 1)))
        if simulated_out.shape != (x.shape[0] * world, *x.shape[1:]):
            raise ValueError(
                f"simulated all-gather of {tuple(x.shape)} over {world} ranks: the filled output "
                f"must be {(x.shape[0] * world, *x.shape[1:])}, got {tuple(simulated_out.shape)}"
            )
        return simulated_out
    out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
    one_shot = _one_shot("all_gather", x, group)
    _record("all_gather", out, "one_shot" if one_shot is not None else _backend(x))
    if one_shot is not None:
        return one_shot.run("all_gather", x.contiguous(), out)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`[m * world, ...]` partial sums -> `[m, ...]`: this rank's block of the sum (simulated: of
    its own partial sum)."""
    world = group_size(group)
    if x.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_rows needs rows divisible by the group size {world}, got "
            f"{tuple(x.shape)}"
        )
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    if is_simulated(group):
        _record("reduce_scatter", x, node_path("reduce_scatter", x, world))
        return out.copy_(x[group.rank * out.shape[0] : (group.rank + 1) * out.shape[0]])
    one_shot = _one_shot("reduce_scatter", x, group)
    _record("reduce_scatter", x, "one_shot" if one_shot is not None else _backend(x))
    if one_shot is not None:
        return one_shot.run("reduce_scatter", x.contiguous(), out)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_to_all_rows(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group
) -> torch.Tensor:
    """Send `send_counts[j]` consecutive rows of `x` to rank j; receive `recv_counts[i]` rows
    from rank i."""
    if is_simulated(group):
        raise ValueError(
            "all_to_all_rows on a simulated group: the simulated rank supports the "
            "all-gather dispatch only"
        )
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    _record("all_to_all", x, _backend(x))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def broadcast_object(obj, group, src: int = 0):
    """A picklable host object from global rank `src` to every rank of `group` (the gloo control
    group) -> the object on every rank (`obj` is ignored on the others). A group of one rank returns
    `obj` as it is (not pickled: `spmoe serve` on one rank broadcasts a plan every step)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj, group, dst: int = 0) -> list | None:
    """Every rank's picklable host object -> on global rank `dst` the list in group rank
    order, else None."""
    if is_simulated(group):  # the control plane of a simulated rank: a world of one
        return [obj]
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered
