"""Kernels for tests alone: the hash bits and the noise that `seeded_race_triton`'s own helpers compute for
every token of each row, written out `[s, V]` to compare with `sampling.noise_bits` / `exponential_noise`, and
the noise of given bits (`sampling.exponential_of`). Imported only where triton is installed."""

import torch
import triton
import triton.language as tl

from spmoe.engine.sampling.seeded_race_triton import exponential, noise_bits, row_keys


@triton.jit
def _probe_kernel(keys_ptr, index_ptr, bits_ptr, noise_ptr, vocab, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    a, b = row_keys(keys_ptr, index_ptr, j)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        bits = noise_bits(a, b, ids)
        inside = ids < vocab
        tl.store(bits_ptr + j * vocab + ids, bits.to(tl.int64), mask=inside)
        tl.store(noise_ptr + j * vocab + ids, exponential(bits), mask=inside)


def kernel_noise(
    keys: torch.Tensor, index: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys `[s, 2]`, index `[s]` int64 -> (bits `[s, V]` int64, noise `[s, V]` float32) as the race kernel
    hashes them."""
    s = index.shape[0]
    bits = torch.empty(s, vocab, dtype=torch.int64, device=keys.device)
    noise = torch.empty(s, vocab, dtype=torch.float32, device=keys.device)
    _probe_kernel[(s,)](keys.contiguous(), index.contiguous(), bits, noise, vocab, BLOCK=1024)
    return bits, noise


@triton.jit
def _exponential_kernel(bits_ptr, noise_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + at, mask=at < n, other=0).to(tl.uint32)
    tl.store(noise_ptr + at, exponential(bits), mask=at < n)


def kernel_exponential(bits: torch.Tensor) -> torch.Tensor:
    """bits `[n]` int64 in [0, 2**32) -> `[n]` float32: the race kernel's noise of each."""
    noise = torch.empty(bits.shape, dtype=torch.float32, device=bits.device)
    block = 1 << 16
    _exponential_kernel[(triton.cdiv(bits.numel(), block),)](
        bits.contiguous(), noise, bits.numel(), BLOCK=block
    )
    return noise
