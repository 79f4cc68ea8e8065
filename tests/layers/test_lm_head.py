"""The vocab-parallel LM head on real gloo ranks against the whole table on one rank, with and without
an `out` buffer (the one CUDA graphs share across sizes)."""

import pytest
import torch

from spmoe.distributed import get_parallel_state, spawn
from spmoe.layers.embedding import ParallelLMHead

V, H, N = 24, 8, 5


def whole_table() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(V, H, generator=gen), torch.randn(N, H, generator=gen)


@torch.no_grad()
def head_on_rank(dtype: torch.dtype) -> list[torch.Tensor]:
    state = get_parallel_state()
    weight, x = whole_table()
    head = ParallelLMHead(V, H)
    rows = V // state.tp_size
    head.weight.data = weight[state.tp_rank * rows : (state.tp_rank + 1) * rows].to(dtype)
    fresh = head(x.to(dtype))
    out = torch.full((N, V), float("nan"))
    written = head(x.to(dtype), out=out)
    assert written.data_ptr() == out.data_ptr(), "the logits were not written into `out`"
    try:
        head(x.to(dtype), out=torch.empty(N, V + 1))
    except ValueError as e:
        assert f"[{N}, {V}]" in str(e) and f"[{N}, {V + 1}]" in str(e), str(e)
    else:
        raise AssertionError("an `out` of the wrong shape was taken")
    return [fresh, out]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_matches_whole_table(world, dtype):
    weight, x = whole_table()
    want = (x.to(dtype) @ weight.to(dtype).T).float()
    for fresh, out in spawn(head_on_rank, world, dtype):
        assert fresh.dtype == out.dtype == torch.float32
        # a slice's matmul may add in another order than the whole table's (float32: ~1e-7)
        torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, fresh, rtol=0, atol=0)
