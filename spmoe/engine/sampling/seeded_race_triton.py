"""The seeded exponential race of `Sampler.sample` in one Triton kernel, one program per drawing
row: the noise is hashed in registers, so no `[m, V]` temporary is made (the torch reference,
`sampling.exponential_noise` then `sampling.race` over the softmax, makes about a dozen int64 ones,
317 MB each at 256 rows of 154880 tokens).

What it computes, for a drawing row with processed logits x `[V]`: token = argmax_i exp(x_i - M) /
E_i, M the row's max, E_i its Exp(1) noise. E_i comes from the same 32 hash bits as
`sampling.noise_bits` (the uint32 arithmetic wraps where the reference masks with 2**32 - 1: the
bits are identical) and the same exact uniform u as `sampling.exponential_of`, E = -log(u). The
reference takes argmax softmax(x)_i / E_i = argmax (exp(x_i - M) / S) / E_i, S = sum exp(x - M) > 0:
dividing every ratio of a row by the same positive S does not change which one is largest, so both
pick the same token in exact arithmetic. In float32 they differ by rounding alone (the reference's
division by S; Triton's exp, ex2.approx of (x - M) log2(e) on NVIDIA, and its log against torch's):
up to about 1e-6 of a ratio over the range of x - M that can win, so only where the two largest
ratios of a row lie that close (a near-tie) may the kernel pick the other one. Exact ties go to the
first token, as torch's argmax.

Excluded tokens (-inf, or a grammar mask's float32 lowest below the row's max) have exp(x - M) = 0,
ratio 0; the max token's is at least 1 / 16.7 (E < 16.7): they are never drawn. A row that is all
-inf (`Sampler.process` flags it not finite) draws token 0, as the reference's argmax over its
NaN ratios does.

Two passes over the row (the max, then the race), each streaming it in blocks; nothing is read
back to the host.
"""

import torch
import triton
import triton.language as tl

BLOCK = tl.constexpr(4096)  # tokens a pass reads per step: 8 a thread at 16 warps
STAGES = tl.constexpr(3)  # the loads are pipelined this deep
NUM_WARPS = 16


@triton.jit
def _mix32(x):
    """`sampling.mix32` on uint32: the products wrap modulo 2**32, as the reference masks them."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def row_keys(keys_ptr, index_ptr, j):
    """Drawing row j's two uint32 hash keys: `sampling.noise_bits`' a and b of its keys and
    output index."""
    index = tl.load(index_ptr + j).to(tl.uint32)  # int64 -> uint32 keeps the low 32 bits
    first = tl.load(keys_ptr + 2 * j).to(tl.uint32)
    second = tl.load(keys_ptr + 2 * j + 1).to(tl.uint32)
    return _mix32(first ^ index), _mix32(second + index)


@triton.jit
def noise_bits(a, b, ids):
    """Token ids (int32) -> their uint32 hash bits under the row keys a, b:
    `sampling.noise_bits`."""
    return _mix32(_mix32(ids.to(tl.uint32) + a) ^ b)


@triton.jit
def exponential(bits):
    """uint32 hash bits -> float32 Exp(1) noise: `sampling.exponential_of` (u exact, -log(u)
    in (0, 16.7))."""
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return -tl.log(uniform)


@triton.jit
def _race_kernel(logits_ptr, stride_row, at_ptr, keys_ptr, index_ptr, out_ptr, vocab):
    j = tl.program_id(0)
    row_ptr = logits_ptr + tl.load(at_ptr + j) * stride_row
    a, b = row_keys(keys_ptr, index_ptr, j)
    cols = tl.arange(0, BLOCK)
    largest = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        x = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf"))
        largest = tl.maximum(largest, x)
    row_max = tl.max(largest)
    # per lane the largest ratio so far and its token; a lane meets its tokens in increasing order
    # and keeps the first of equal ratios. Every real ratio is >= 0 > -1; an all -inf row's are NaN
    # and keep -1 (token 0).
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        ids = start + cols
        x = tl.load(row_ptr + ids, mask=ids < vocab, other=float("-inf"))
        # IEEE division, as torch's
        ratio = tl.div_rn(tl.exp(x - row_max), exponential(noise_bits(a, b, ids)))
        better = ratio > best
        best = tl.where(better, ratio, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best)
    # the first of the largest
    tl.store(out_ptr + j, tl.min(tl.where(best == top, best_id, vocab)).to(tl.int64))


def seeded_race(
    logits: torch.Tensor, at: torch.Tensor, keys: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """logits `[m, V]` float32 (rows may be strided, tokens contiguous); at `[s]` int64: the rows
    that draw; keys `[s, 2]` int64 (`sampling.seed_keys` of each drawing row's seed); index `[s]`
    int64 (the output index of the token it draws) -> `[s]` int64: the token each drawing row draws
    from softmax(logits[at[j]])."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"seeded_race takes float32 logits [m, V] with contiguous rows, got {logits.dtype} "
            f"{tuple(logits.shape)} strides {logits.stride()}"
        )
    s = at.shape[0]
    if at.shape != (s,) or keys.shape != (s, 2) or index.shape != (s,):
        raise ValueError(
            f"seeded_race needs at [s], keys [s, 2] and index [s], got {tuple(at.shape)}, "
            f"{tuple(keys.shape)} and {tuple(index.shape)}"
        )
    out = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s:
        _race_kernel[(s,)](
            logits,
            logits.stride(0),
            at.to(torch.int64).contiguous(),
            keys.to(torch.int64).contiguous(),
            index.to(torch.int64).contiguous(),
            out,
            logits.shape[1],
            num_warps=NUM_WARPS,
        )
    return out
