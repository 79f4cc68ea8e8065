"""The torch references of FP8 linears (`quantization.fp8_linear`) against plain float32 math on the
dequantised weights, on CPU: block quantisation round trip, the linear (activations quantised per token and 128
channels), and absorbed MLA's per-head products with heads that straddle weight blocks."""

import torch
import torch.nn.functional as F

from spmoe.layers.quantization.fp8 import quantize_fp8_groups
from spmoe.layers.quantization.fp8_linear import (
    dequantize_blocks,
    fp8_head_matmul_torch,
    fp8_linear_torch,
    quantize_blocks,
)
from spmoe.layers.sparse_attention import head_matmul_torch


def test_block_quantisation_round_trips_within_e4m3_rounding():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (3, 2)
    back = dequantize_blocks(q, scale)
    # half an e4m3 step, or subnormal
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()
    assert (back - w).abs().max() > 0  # it did quantise


def test_fp8_linear_reference_is_the_linear_of_the_quantised_operands():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 200, generator=gen), torch.randn(70, 200, generator=gen)
    q, scale = quantize_blocks(w)
    # the last group zero-padded, as the kernels see it
    xq, xs = quantize_fp8_groups(F.pad(x, (0, 56)))
    xq = xq[:, :200]
    # blocks of 1 x 128
    want = F.linear(dequantize_blocks(xq, xs, (1, 128)), dequantize_blocks(q, scale))
    torch.testing.assert_close(fp8_linear_torch(x, q, scale), want)
    out = torch.ones(5, 70)
    torch.testing.assert_close(fp8_linear_torch(x, q, scale, out=out), want + 1)
    assert out.sub(1).sub(want).abs().max() < 1e-5  # in place
    # the quantisation error is small
    assert (F.linear(x, w) - want).abs().max() < 0.1 * want.abs().max()


def test_fp8_head_matmul_reference_is_the_per_head_product_of_the_dequantised_weight():
    """GLM's kv_b layout at a small width: per head 96 rows (32 W_UK, 64 W_UV), so heads start mid-block."""
    gen = torch.Generator().manual_seed(2)
    heads, nope, v, c = 5, 32, 64, 192
    q, scale = quantize_blocks(torch.randn(heads * (nope + v), c, generator=gen))
    w_uk, w_uv = dequantize_blocks(q, scale).view(heads, nope + v, c).split([nope, v], dim=1)
    x = torch.randn(3, heads, nope, generator=gen)
    torch.testing.assert_close(
        fp8_head_matmul_torch(x, q, scale, nope + v, 0, c, True), head_matmul_torch(x, w_uk)
    )
    y = torch.randn(3, heads, c, generator=gen)
    got = fp8_head_matmul_torch(y, q, scale, nope + v, nope, v, False)
    torch.testing.assert_close(got, head_matmul_torch(y, w_uv.transpose(1, 2)))
