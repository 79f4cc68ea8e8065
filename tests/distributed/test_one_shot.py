"""The one-shot collectives against NCCL, on every GPU: all-gather, reduce-scatter and all-reduce, bf16 and fp32,
from 1 to 256 rows of 6144 (those that fit the buffer), launched eagerly and replayed from a CUDA graph with
new inputs each replay; and a call too large for the buffer is an error, not a silent overflow."""

import pytest
import torch
import torch.distributed as dist

from spmoe.distributed import get_parallel_state

from ..multigpu import requires_gpus, run_on_gpus

H = 6144


def compare_with_nccl() -> list[str]:
    """-> one line per mismatch (empty when every case matches NCCL: bit for bit on 2 ranks, where a sum of
    two has one order; on more ranks NCCL sums in another order, so within rounding)."""
    from spmoe.distributed.one_shot import BUFFER_BYTES, OneShot

    state = get_parallel_state()
    group, t, device = state.tp_group, state.tp_size, state.device
    one_shot, failures = OneShot(group, device), []
    gen = torch.Generator(device=device).manual_seed(state.rank)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 64, 256):
            shard = torch.empty(rows, H, dtype=dtype, device=device)
            full = torch.empty(rows * t, H, dtype=dtype, device=device)
            outs = {
                "all_gather": torch.empty_like(full),
                "reduce_scatter": torch.empty_like(shard),
                "all_reduce": torch.empty_like(full),
            }

            inputs = {"all_gather": shard, "reduce_scatter": full, "all_reduce": full}
            kinds = [k for k, x in inputs.items() if one_shot.fits(k, x)]
            if not kinds:
                continue

            def ours():
                for kind in kinds:
                    one_shot.run(kind, inputs[kind], outs[kind])

            def nccl() -> dict:
                want = {k: torch.empty_like(v) for k, v in outs.items()}
                dist.all_gather_into_tensor(want["all_gather"], shard, group=group)
                dist.reduce_scatter_tensor(want["reduce_scatter"], full, group=group)
                want["all_reduce"].copy_(full)
                dist.all_reduce(want["all_reduce"], group=group)
                return want

            graph = None
            for trial in ("eager", "graph replay 1", "graph replay 2"):
                shard.normal_(generator=gen)
                full.normal_(generator=gen)
                if trial == "eager":
                    ours()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        ours()
                else:
                    graph.replay()
                for kind, want in nccl().items():
                    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
                    close = (
                        torch.equal
                        if t == 2 or kind == "all_gather"
                        else lambda a, b: torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
                    )
                    if kind in kinds and not close(outs[kind], want):
                        err = (outs[kind].float() - want.float()).abs().max().item()
                        failures.append(f"{kind} {dtype} rows={rows} {trial}: max |diff| {err:.3e}")
    # one element more than fits: elements x t ranks x 2 B > BUFFER_BYTES
    too_big = torch.empty(BUFFER_BYTES // (2 * t) + 1, dtype=torch.bfloat16, device=device)
    try:
        one_shot.run("all_reduce", too_big, too_big)
        failures.append("an all-reduce larger than the buffer ran")
    except ValueError:
        pass
    return failures


@pytest.mark.gpu
@requires_gpus(2)
def test_one_shot_collectives_equal_nccl():
    results = run_on_gpus(compare_with_nccl)
    assert results == [[]] * len(results), results


def compare_add_norm_with_nccl() -> list[str]:
    """The one-shot collectives fused with the residual add + RMSNorm (`OneShot.add_rms_norm`) against the NCCL
    collective and `RMSNorm.add_norm` apart, for each kind, N from 1 (fewer tokens than ranks) to 64, with and
    without a residual, eager and from a CUDA graph with new inputs; -> one line per mismatch."""
    from spmoe.distributed.one_shot import OneShot
    from spmoe.layers.norm import RMSNorm

    state = get_parallel_state()
    group, t, device = state.tp_group, state.tp_size, state.device
    one_shot, failures = OneShot(group, device), []
    gen = torch.Generator(device=device).manual_seed(state.rank)
    norm = RMSNorm(H, 1e-5).to(device=device, dtype=torch.bfloat16)

    def reference(kind, x, residual, num_tokens):
        n = -(-num_tokens // t)
        if kind == "all_gather":
            normed, new_residual = norm.add_norm(x, residual)
            gathered = torch.empty(n * t, H, dtype=normed.dtype, device=device)
            dist.all_gather_into_tensor(gathered, normed.contiguous(), group=group)
            return gathered[:num_tokens], new_residual
        summed = (
            torch.cat([x, x.new_zeros(n * t - num_tokens, H)])
            if kind == "reduce_scatter"
            else x.clone()
        )
        if kind == "reduce_scatter":
            block = torch.empty(n, H, dtype=x.dtype, device=device)
            dist.reduce_scatter_tensor(block, summed, group=group)
            return norm.add_norm(block, residual)
        dist.all_reduce(summed, group=group)
        return norm.add_norm(summed, residual)

    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, H))
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
            for num_tokens in (1, 3, 64):
                n = -(-num_tokens // t)
                x_rows = n if kind == "all_gather" else num_tokens
                res_rows = num_tokens if kind == "all_reduce" else n
                for with_residual in (True, False):
                    x = torch.empty(x_rows, H, dtype=torch.bfloat16, device=device)
                    residual = (
                        torch.empty(res_rows, H, dtype=torch.bfloat16, device=device)
                        if with_residual
                        else None
                    )

                    def fill():
                        x.normal_(generator=gen)
                        if residual is not None:
                            residual.normal_(generator=gen)
                            if kind == "all_reduce":  # a FULL residual is the same on every rank
                                dist.broadcast(residual, 0, group=group)

                    fill()
                    got = one_shot.add_rms_norm(
                        kind, x, residual, norm.weight, norm.eps, num_tokens
                    )
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        captured = one_shot.add_rms_norm(
                            kind, x, residual, norm.weight, norm.eps, num_tokens
                        )
                    for trial in ("eager", "graph replay"):
                        if trial == "graph replay":
                            fill()
                            graph.replay()
                            got = captured
                        want = reference(kind, x, residual, num_tokens)
                        for name, a, b in zip(("normed", "residual"), got, want):
                            if a.shape != b.shape or not torch.allclose(
                                a.float(), b.float(), rtol=2e-2, atol=2e-2
                            ):
                                failures.append(
                                    f"{kind} {name} N={num_tokens} residual={with_residual} {trial}: "
                                    f"{tuple(a.shape)} vs {tuple(b.shape)}"
                                )
    return failures


@pytest.mark.gpu
@requires_gpus(2)
def test_one_shot_collectives_fused_with_add_norm_equal_nccl_then_add_norm():
    results = run_on_gpus(compare_add_norm_with_nccl)
    assert results == [[]] * len(results), results
