"""The FP8 linear kernels (`quantization.fp8_kernels`) against their torch references on one CUDA GPU, bf16:
the GEMV / GEMM over m = 1 .. 8192 (every m bucket of the config table) at GLM-5.2 widths and at widths that
are not multiples of 128, with and without accumulation, split-K (even, uneven, a partial last block) at every
decode bucket, past 2**31 elements of input (64-bit offsets), captured in a CUDA graph; absorbed MLA's
per-head products with GLM-5.2's kv_b layout (448 rows per head, heads starting mid-block), also past 2**31
elements."""

import pytest
import torch

from spmoe.layers.quantization.fp8_linear import (
    fp8_head_matmul_torch,
    fp8_linear_torch,
    quantize_blocks,
)

from ..multigpu import requires_gpus


def fp8_matmul(*args, **kwargs):  # the kernels import triton, which CPU machines lack
    from spmoe.layers.quantization.fp8_kernels import fp8_matmul

    return fp8_matmul(*args, **kwargs)


def config(*fields):
    from spmoe.layers.quantization.fp8_kernels import MatmulConfig

    return MatmulConfig(*fields)


def fp8_head_matmul(*args):
    from spmoe.layers.quantization.fp8_kernels import fp8_head_matmul

    return fp8_head_matmul(*args)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs of the same FP8 operands: the sums' order and the output rounding differ, and the kernel's
    approximate division may round a few activations to the next e4m3 step (about 6% of each), nothing else;
    a wrong scale or block moves the outputs by tens of percent."""
    got, want = got.float(), want.float()
    rms = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert rms < 2e-2, float(rms)
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def _weight(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,k", [(2048 + 576 + 128 + 32, 6144), (6144, 16384), (4096, 6144), (200, 300), (136, 128)]
)
def test_fp8_matmul_matches_torch(n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w, s = _weight(n, k, gen)
    for m in (1, 2, 5, 16, 17, 33, 64, 65, 200, 1000, 8192):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        _close(fp8_matmul(x, w, s), fp8_linear_torch(x, w, s))
        out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = fp8_linear_torch(x, w, s, out=out.clone())
        got = fp8_matmul(x, w, s, out=out)
        assert got.data_ptr() == out.data_ptr()
        _close(got, want)
    # a view's rows
    strided = torch.randn(9, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :k]
    _close(fp8_matmul(strided, w, s), fp8_linear_torch(strided, w, s))


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2816, 6144), (200, 300)])
def test_fp8_matmul_split_k_matches_torch(n, k):
    """Explicit configs at each decode bucket: no split, splits that divide k's blocks, uneven splits (the last
    shorter; with k = 300 the last holds only the partial block), with and without accumulation."""
    gen = torch.Generator(device="cuda").manual_seed(n * k)
    w, s = _weight(n, k, gen)
    blocks = -(-k // 128)
    splits = sorted({1, 2, 3, 5, blocks})
    for m, tiles in (
        (1, (16, 64)),
        (7, (16, 128)),
        (16, (16, 32)),
        (29, (32, 64)),
        (64, (64, 128)),
        (64, (32, 64)),
    ):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = fp8_linear_torch(x, w, s)
        for split in splits:
            cfg = config(*tiles, split, 4, 4)
            _close(fp8_matmul(x, w, s, config=cfg), want)
            out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            want_sum = fp8_linear_torch(x, w, s, out=out.clone())
            got = fp8_matmul(x, w, s, out=out, config=cfg)
            assert got.data_ptr() == out.data_ptr()
            _close(got, want_sum)
    with pytest.raises(ValueError, match="block_n dividing 128"):
        fp8_matmul(x, w, s, config=config(16, 256, 1, 4, 4))


@requires_gpus(1)
@pytest.mark.gpu
def test_fp8_matmul_past_2_31_input_elements():
    """m * k = 2**31 + 16384: the last rows' offsets need 64 bits (rows are independent: compare those)."""
    m, k, n = (1 << 31) // 16384 + 1, 16384, 160
    gen = torch.Generator(device="cuda").manual_seed(3)
    w, s = _weight(n, k, gen)
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    x[-64:] = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[:-64] = 0.5
    got = fp8_matmul(x, w, s)
    _close(got[-64:], fp8_linear_torch(x[-64:], w, s))
    _close(got[:64], fp8_linear_torch(x[:64], w, s))


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_matmul_in_a_cuda_graph(m):
    """At (2816, 6144) the table splits k (x_proj at decode): the partials and their sum replay too,
    and the fixed-order sum makes the replay bit-equal to an eager call."""
    from spmoe.layers.quantization.fp8_kernels import matmul_config

    assert matmul_config(m, 2816, 6144).split_k > 1
    gen = torch.Generator(device="cuda").manual_seed(4)
    w, s = _weight(2816, 6144, gen)
    x = torch.randn(m, 6144, device="cuda", dtype=torch.bfloat16, generator=gen)
    eager = fp8_matmul(x, w, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_matmul(x, w, s)
    x.copy_(torch.randn(m, 6144, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    assert not torch.equal(captured, eager)
    torch.testing.assert_close(captured, fp8_matmul(x, w, s), rtol=0, atol=0)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 8, 3])
def test_fp8_head_matmul_matches_torch(heads):
    nope, v, c = 192, 256, 512
    gen = torch.Generator(device="cuda").manual_seed(heads)
    w, s = _weight(heads * (nope + v), c, gen)
    for n in (1, 4, 16, 17, 300):
        x = torch.randn(n, heads, nope, device="cuda", dtype=torch.bfloat16, generator=gen)
        _close(
            fp8_head_matmul(x, w, s, nope + v, 0, c, True),
            fp8_head_matmul_torch(x, w, s, nope + v, 0, c, True),
        )
        y = torch.randn(n, heads, c, device="cuda", dtype=torch.bfloat16, generator=gen)
        _close(
            fp8_head_matmul(y, w, s, nope + v, nope, v, False),
            fp8_head_matmul_torch(y, w, s, nope + v, nope, v, False),
        )


@requires_gpus(1)
@pytest.mark.gpu
def test_fp8_head_matmul_past_2_31_input_elements():
    """W_UV^T over 65537 tokens of 64 heads x 512: x holds 2**31 + 32768 elements, so the last tokens' offsets
    need 64 bits (tokens are independent: compare the last and the first)."""
    heads, nope, v, c = 64, 192, 256, 512
    n = (1 << 31) // (heads * c) + 1
    gen = torch.Generator(device="cuda").manual_seed(5)
    w, s = _weight(heads * (nope + v), c, gen)
    y = torch.empty(n, heads, c, device="cuda", dtype=torch.bfloat16)
    y[:-16] = 0.25
    y[-16:] = torch.randn(16, heads, c, device="cuda", dtype=torch.bfloat16, generator=gen)
    got = fp8_head_matmul(y, w, s, nope + v, nope, v, False)
    _close(got[-16:], fp8_head_matmul_torch(y[-16:], w, s, nope + v, nope, v, False))
    _close(got[:16], fp8_head_matmul_torch(y[:16], w, s, nope + v, nope, v, False))
