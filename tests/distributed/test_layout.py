"""The SP layout primitives on real gloo ranks against a single-process reference, and their accounting.

One spawned group per world size runs the whole (N, dtype) matrix; every check raises inside the rank, and
the launcher turns that into a failure here with the rank's traceback.
"""

import pytest
import torch

from spmoe.distributed import (
    _all_gather_sp_states,
    count_collectives,
    get_parallel_state,
    sp_all_gather,
    sp_reduce_scatter,
    sp_shard,
    spawn,
)
from spmoe.distributed.comm import all_reduce, all_to_all_rows
from tests.multigpu import requires_gpus, run_on_gpus

TOKEN_COUNTS = (0, 1, 2, 3, 5, 17)
DTYPES = (torch.float32, torch.bfloat16)
H = 8


def reference_shards(full: torch.Tensor, t: int) -> torch.Tensor:
    """`[N, H]` -> `[t, n, H]`: the sequence zero-padded to a multiple of t, cut into t equal blocks."""
    n = (full.shape[0] + t - 1) // t
    padded = full.new_zeros(n * t, full.shape[1])
    padded[: full.shape[0]] = full
    return padded.view(t, n, full.shape[1])


def expect_error(fn, *fragments):
    try:
        fn()
    except ValueError as e:
        for fragment in fragments:
            assert fragment in str(e), f"error {str(e)!r} does not mention {fragment!r}"
        return
    raise AssertionError(f"expected a ValueError mentioning {fragments}")


def layout_matrix() -> int:
    state = get_parallel_state()
    t, r = state.tp_size, state.tp_rank
    checked = 0
    for dtype in DTYPES:
        e = dtype.itemsize
        for N in TOKEN_COUNTS:
            gen = torch.Generator().manual_seed(1000 * N + t)
            # Integer values keep every sum exact in both dtypes, whatever order a collective adds in.
            full = torch.randint(-50, 50, (N, H), generator=gen).to(state.device, dtype)
            residual = torch.randint(-50, 50, (N, H), generator=gen).to(state.device, dtype)
            partials = torch.randint(-20, 20, (t, N, H), generator=gen).to(state.device, dtype)
            want = reference_shards(full, t)
            n = want.shape[1]

            shard = sp_shard(full)
            assert torch.equal(shard, want[r]), (N, dtype)
            assert shard.is_contiguous()

            with count_collectives() as stats:
                gathered = sp_all_gather(shard, N)
            assert torch.equal(gathered, full), (N, dtype)
            assert stats.as_dict() == {
                "all_reduce": {"count": 0, "bytes": 0},
                "all_gather": {"count": 1, "bytes": n * t * H * e},
                "reduce_scatter": {"count": 0, "bytes": 0},
                "all_to_all": {"count": 0, "bytes": 0},
            }

            with count_collectives() as stats:
                reduced = sp_reduce_scatter(partials[r])
            assert torch.equal(reduced, reference_shards(partials.sum(0), t)[r]), (N, dtype)
            assert stats.counts["reduce_scatter"] == {"count": 1, "bytes": n * t * H * e}
            assert stats.counts["all_gather"]["count"] == 0
            if n * (r + 1) > N:  # this rank holds pad rows: they must be exactly zero
                assert not reduced[max(N - n * r, 0) :].any()

            with count_collectives() as stats:
                h, res = _all_gather_sp_states(sp_shard(full), sp_shard(residual), N)
            assert torch.equal(h, full) and torch.equal(res, residual), (N, dtype)
            assert res.is_contiguous()
            assert stats.counts["all_gather"] == {"count": 1, "bytes": n * t * 2 * H * e}
            assert sum(v["count"] for v in stats.counts.values()) == 1

            with count_collectives() as outer:
                with count_collectives() as inner:
                    summed = all_reduce(partials[r].clone(), state.tp_group)
                    rows = [N] * t
                    exchanged = all_to_all_rows(
                        partials[r].repeat(t, 1), rows, rows, state.tp_group
                    )
            assert torch.equal(summed, partials.sum(0))
            assert torch.equal(exchanged, partials.reshape(t * N, H))
            assert inner.as_dict() == outer.as_dict()
            assert inner.counts["all_reduce"] == {"count": 1, "bytes": N * H * e}
            assert inner.counts["all_to_all"] == {"count": 1, "bytes": t * N * H * e}
            checked += 1

    # Inputs that do not match the declared layout fail loudly, naming the shapes.
    n5 = (5 + t - 1) // t
    torch.set_default_device(state.device)
    expect_error(lambda: sp_shard(torch.zeros(5)), "2-D", "(5,)")
    expect_error(lambda: sp_all_gather(torch.zeros(n5 + 1, H), 5), f"{n5} rows", f"({n5 + 1}, {H})")
    expect_error(lambda: sp_all_gather(torch.zeros(n5, H, 2), 5), "2-D", f"({n5}, {H}, 2)")
    expect_error(lambda: sp_reduce_scatter(torch.zeros(5)), "2-D", "(5,)")
    expect_error(
        lambda: _all_gather_sp_states(torch.zeros(n5, H), torch.zeros(n5, H + 1), 5),
        f"({n5}, {H + 1})",
        f"({n5}, {H})",
    )
    expect_error(
        lambda: _all_gather_sp_states(torch.zeros(n5 + 2, H), torch.zeros(n5 + 2, H), 5),
        f"{n5} rows",
    )
    # A FULL tensor passed where a shard is declared is caught even when N=1 would hide it from a shape test
    # on rank counts: a 1-token FULL tensor has ceil(1/t) = 1 row, so this is the case the contract exists for.
    expect_error(
        lambda: sp_all_gather(torch.zeros(t + 1, H), t + 1), f"{(t + 1 + t - 1) // t} rows"
    )
    torch.set_default_device(None)
    return checked


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_layout_primitives_match_single_process_reference(world_size):
    checked = spawn(layout_matrix, world_size)
    assert checked == [len(TOKEN_COUNTS) * len(DTYPES)] * world_size


@pytest.mark.gpu
@requires_gpus(2)
def test_layout_primitives_on_nccl():
    checked = run_on_gpus(layout_matrix)
    assert all(c == len(TOKEN_COUNTS) * len(DTYPES) for c in checked)
