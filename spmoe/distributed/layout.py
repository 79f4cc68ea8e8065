"""The sequence-parallel layout contract and its primitives.

Every tensor that crosses a layer boundary has a declared `Layout`:

- `FULL`     `[N, H]`: all N tokens, identical on every TP rank.
- `SHARDED`  `[n, H]` with `n = ceil(N/t)`: rank r owns rows `[r*n, (r+1)*n)` of the sequence
             zero-padded to `n*t` rows. Pad rows sit at the tail and are exactly zero.
- `PARTIAL`  `[N, H]`: this rank's partial sum (row-parallel output); it must be reduced
             exactly once.

The layout is always passed in by the caller, never inferred from a shape: at N <= 1 a shard and a
full tensor have the same number of rows, which is the upstream N=1 bug (vLLM #50154, #50691).
Instead each primitive checks that the rows it gets are the rows the declared layout implies, and
raises naming both shapes.

All primitives run over the TP group of `get_parallel_state()`.
"""

import enum

import torch

from spmoe.distributed.comm import all_gather_rows, all_reduce, reduce_scatter_rows
from spmoe.distributed.groups import get_parallel_state
from spmoe.distributed.simulated import is_simulated


class Layout(enum.Enum):
    FULL = "full"
    SHARDED = "sharded"
    PARTIAL = "partial"


def shard_rows(num_tokens: int, tp_size: int) -> int:
    """`n = ceil(N/t)`: rows per rank of a SHARDED tensor."""
    return -(-num_tokens // tp_size)


def check_rows(x: torch.Tensor, rows: int, what: str) -> None:
    """Raise unless `x` is 2-D `[rows, H]`."""
    if x.dim() != 2 or x.shape[0] != rows:
        raise ValueError(
            f"{what}: expected a 2-D tensor with {rows} rows, got shape {tuple(x.shape)}"
        )


def sp_shard(x: torch.Tensor) -> torch.Tensor:
    """FULL `[N, H]` -> SHARDED `[n, H]`, locally (no communication); this rank's rows, zero-padded.

    Used for the residual when entering a sharded region. Returns a view of `x` when this rank's
    rows need no padding, otherwise a new tensor.
    """
    if x.dim() != 2:
        raise ValueError(f"sp_shard: expected a 2-D [N, H] tensor, got shape {tuple(x.shape)}")
    state = get_parallel_state()
    num_tokens, n = x.shape[0], shard_rows(x.shape[0], state.tp_size)
    start, stop = min(state.tp_rank * n, num_tokens), min((state.tp_rank + 1) * n, num_tokens)
    if stop - start == n:
        return x[start:stop]
    out = x.new_zeros((n, x.shape[1]))
    out[: stop - start] = x[start:stop]
    return out


def sp_all_gather(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """SHARDED `[n, H]` -> FULL `[N, H]`: one all-gather over the TP group, then drop the
    tail pad rows."""
    check_rows(
        x, shard_rows(num_tokens, get_parallel_state().tp_size), f"sp_all_gather (N={num_tokens})"
    )
    return all_gather_rows(x, get_parallel_state().tp_group)[:num_tokens]


def sp_reduce_scatter(partial: torch.Tensor) -> torch.Tensor:
    """PARTIAL `[N, H]` -> SHARDED `[n, H]`: zero-pad to `n*t` rows, reduce-scatter
    over the TP group.

    A pad row of the result is a sum of zeros, so it is exactly zero.
    """
    if partial.dim() != 2:
        raise ValueError(
            "sp_reduce_scatter: expected a 2-D [N, H] partial sum, got shape "
            f"{tuple(partial.shape)}"
        )
    t = get_parallel_state().tp_size
    pad = shard_rows(partial.shape[0], t) * t - partial.shape[0]
    if pad:
        partial = torch.cat([partial, partial.new_zeros((pad, partial.shape[1]))])
    return reduce_scatter_rows(partial, get_parallel_state().tp_group)


def _all_gather_sp_states(
    hidden: torch.Tensor, residual: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SHARDED (hidden, residual), each `[n, H]` -> FULL, each `[N, H]`, with ONE
    all-gather of `[n, 2H]`.

    The pair is joined along the hidden dim so a row keeps its hidden and residual together through
    one collective and one trim. The returned residual is contiguous (an in-place fused add-norm may
    write it); the hidden is a strided view.
    """
    n = shard_rows(num_tokens, get_parallel_state().tp_size)
    check_rows(hidden, n, f"_all_gather_sp_states hidden (N={num_tokens})")
    if residual.shape != hidden.shape:
        raise ValueError(
            f"_all_gather_sp_states: residual shape {tuple(residual.shape)} does not match "
            f"hidden shape {tuple(hidden.shape)}"
        )
    size = hidden.shape[1]
    both = sp_all_gather(torch.cat([hidden, residual], dim=1), num_tokens)
    return both[:, :size], both[:, size:].contiguous()


def _restore_full_token_layout_if_needed(
    hidden: torch.Tensor, residual: torch.Tensor, num_tokens: int, is_sequence_parallel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) -> FULL `[N, H]` each. The caller says whether they are SHARDED `[n, H]`
    (then one fused gather, `_all_gather_sp_states`) or already in a token-complete layout
    (returned unchanged)."""
    if is_sequence_parallel:
        return _all_gather_sp_states(hidden, residual, num_tokens)
    return hidden, residual


def largest_dp_batch(num_tokens: int, agreed: int | None = None) -> int:
    """The largest N over the data-parallel ranks: the expert dispatch spans every DP rank, so all
    of them pad their rows to the same count. `agreed`: decided before the forward (a captured step
    must not ask the other ranks, `StepGraphs.shape`); None: agreed now, one tiny all-reduce read
    back by the host (none when DP = 1). A simulated rank counts it and takes its own N (no host
    sync: its step can be captured)."""
    if agreed is not None:
        if agreed < num_tokens:
            raise ValueError(
                f"the largest DP batch agreed is {agreed} rows; this rank has {num_tokens}"
            )
        return agreed
    state = get_parallel_state()
    if state.ep_size == state.tp_size:  # DP 1 (a simulated rank's control plane says DP 1 too)
        return num_tokens
    if is_simulated(state.ep_group):  # the other DP groups run batches of this one's size
        all_reduce(torch.tensor([num_tokens]), state.ep_group, op="max")  # counted; no device sync
        return num_tokens
    agreed = torch.tensor([num_tokens], device=state.device)
    return int(all_reduce(agreed, state.ep_group, op="max").item())
