"""Layout self-check: run every SP primitive on real ranks and compare with a single-process answer.

Each rank builds the same deterministic full tensors, so the expected result of every collective is
known locally. Returns one row per (N, dtype) with the worst error and the collectives that ran.
"""

import torch

from spmoe.distributed.comm import count_collectives
from spmoe.distributed.groups import get_parallel_state
from spmoe.distributed.layout import (
    _all_gather_sp_states,
    shard_rows,
    sp_all_gather,
    sp_reduce_scatter,
    sp_shard,
)

TOKEN_COUNTS = (0, 1, 2, 3, 5, 17)
HIDDEN = 64


def layout_selfcheck() -> list[dict]:
    state = get_parallel_state()
    t, r = state.tp_size, state.tp_rank
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for num_tokens in TOKEN_COUNTS:
            gen = torch.Generator().manual_seed(num_tokens)
            full = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
            residual = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
            partials = [
                torch.randint(-8, 8, (num_tokens, HIDDEN), generator=gen).to(dtype)
                for _ in range(t)
            ]
            n = shard_rows(num_tokens, t)
            expected_shard = torch.zeros(n * t, HIDDEN, dtype=dtype)
            expected_shard[:num_tokens] = sum(partials)
            with count_collectives() as stats:
                gathered = sp_all_gather(sp_shard(full), num_tokens)
                reduced = sp_reduce_scatter(partials[r])
                hidden_full, residual_full = _all_gather_sp_states(
                    sp_shard(full), sp_shard(residual), num_tokens
                )
            err = max(
                _max_err(gathered, full),
                _max_err(reduced, expected_shard[r * n : (r + 1) * n]),
                _max_err(hidden_full, full),
                _max_err(residual_full, residual),
            )
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "N": num_tokens,
                    "n": n,
                    "max_err": err,
                    "collectives": stats.as_dict(),
                }
            )
    return rows


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
