"""The threshold of `logits_processors.apply_top_k_top_p` without a sort: one Triton kernel, one
program per row.

The rule's result is a threshold: every token whose logit is at least the last kept logit stays
(ties included), everything else goes. Both halves of the rule are "the largest value v of the row
such that the tokens >= v weigh at least a target": top_k counts tokens (target k), top_p sums exp(x
- row max) over the tokens top_k left (target top_p x their sum). That weight only falls as v rises,
so the largest passing v is found by bisection over the int32 bit patterns of the float32 values,
whose integer order is the float order once the negative ones have their 31 low bits flipped
(`_order_key`; both zeros share key 0).

A search step reads the row once (620 KB at 154880 tokens, from L2) and tallies, for its pivot t,
the weight and the count of the tokens >= t, the smallest of them and the largest token below t. The
next interval's ends are those two tokens, not the pivot: the interval is always bounded by values
of the row, so a step whose pivot falls in a gap between two values ends the search at once. Each
step at least halves the interval of keys (at most 32 full steps); once at most `CAP` tokens lie in
it, one more pass gathers them into a scratch row and the search ends in registers, over those
tokens only. The steps before the search: one pass for the row's max and min, and for top_p one pass
for the sum the target is a fraction of.

Masses: each token's weight is exp(x - row max) in float32 (the softmax's own terms, each a few
float32 roundings off the exact value: relative 1e-7 x (1 + |x - max|) or so), the weights are added
in float64 (four at a time in float32 first), and the target is top_p x the weight of the tokens
top_k left, in float64 too. The kept set is thus the rule's up to the rounding of the weights alone;
the sort path adds the float32 rounding of a cumulative sum over the sorted row. Where the mass of
the tokens above the crossing one lies within those roundings of top_p, the two paths can keep one
group of equal tokens more or less; elsewhere they keep the same tokens.

Rows must hold no NaN and no +inf (`Sampler.process` zeroes rows that are not finite; -inf from
masks is fine). On such a row the threshold means nothing, but the search still ends and writes only
inside its own rows. Nothing is read back to the host.
"""

import torch
import triton
import triton.language as tl

# constexpr globals: the kernel's functions read them as compile-time constants
# tokens a full pass reads per step: 8 a thread at 16 warps (8192 spills registers)
BLOCK = tl.constexpr(4096)
STAGES = tl.constexpr(3)  # a full pass's loads are pipelined this deep (the row streams from L2)
# weights added in float32 four at a time, then in float64 (one conversion per four)
GROUP = tl.constexpr(4)
# at most this many tokens left in the interval: gathered once, the search ends in registers
CAP = tl.constexpr(4096)
NUM_WARPS = 16


@triton.jit
def _order_key(x):
    """float32 -> int64 in the same order (-0.0 and +0.0 both 0, so that equal values
    share a key)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 of an `_order_key` key (key 0 is +0.0)."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _extremes(row_ptr, vocab):
    """The row's largest and smallest value."""
    cols = tl.arange(0, BLOCK)
    largest = tl.full([BLOCK], float("-inf"), tl.float32)
    smallest = tl.full([BLOCK], float("inf"), tl.float32)
    for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        valid = start + cols < vocab
        x = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf"))
        largest = tl.maximum(largest, x)
        smallest = tl.minimum(smallest, tl.where(valid, x, float("inf")))
    return tl.max(largest), tl.min(smallest)


@triton.jit
def _tally_row(row_ptr, vocab, t, row_max, BY_MASS: tl.constexpr):
    """Of the row's tokens >= t: (their weight, float64: exp(x - row_max) each when BY_MASS, else 1
    each; their count; the smallest of them) and the largest token < t (+inf / -inf where
    there is none)."""
    cols = tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    weight = tl.zeros([BLOCK // GROUP], tl.float64)
    count = tl.zeros([BLOCK // GROUP, GROUP], tl.int32)
    above = tl.full([BLOCK // GROUP, GROUP], float("inf"), tl.float32)
    below = tl.full([BLOCK // GROUP, GROUP], float("-inf"), tl.float32)
    for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        valid = start + cols < vocab
        x = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf"))
        at_or_above = valid & (x >= t)
        count += at_or_above.to(tl.int32)
        above = tl.minimum(above, tl.where(at_or_above, x, float("inf")))
        below = tl.maximum(below, tl.where(valid & (x < t), x, float("-inf")))
        if BY_MASS:
            weight += tl.sum(tl.where(at_or_above, tl.exp(x - row_max), 0.0), 1).to(tl.float64)
    n = tl.sum(count)
    if BY_MASS:
        total = tl.sum(weight)
    else:
        total = n.to(tl.float64)
    return total, n, tl.min(above), tl.max(below)


@triton.jit
def _largest_passing(
    row_ptr,
    scratch_ptr,
    vocab,
    lo_value,
    hi_value,
    count_from_lo,
    target,
    row_max,
    BY_MASS: tl.constexpr,
):
    """The largest value v of the row in [lo_value, hi_value] (both values of the row, hi_value its
    max) whose tokens >= v weigh at least `target` (those >= lo_value do;
    `count_from_lo` of them)."""
    lo = _order_key(lo_value)
    hi = _order_key(hi_value)
    count_lo = count_from_lo.to(tl.int32)  # tokens >= lo
    count_above_hi = tl.full([], 0, tl.int32)  # tokens > hi
    weight_above_hi = tl.full([], 0.0, tl.float64)  # their weight
    while (lo < hi) & (count_lo - count_above_hi > CAP):
        mid = lo + (hi - lo + 1) // 2
        total, n, above, below = _tally_row(row_ptr, vocab, _key_value(mid), row_max, BY_MASS)
        passes = total >= target
        lo = tl.where(passes, _order_key(above), lo)
        count_lo = tl.where(passes, n, count_lo)
        hi = tl.where(passes, hi, _order_key(below))
        count_above_hi = tl.where(passes, count_above_hi, n)
        weight_above_hi = tl.where(passes, weight_above_hi, total)
    if lo < hi:
        # the tokens in [lo, hi], at most CAP of them, into this row's scratch, in row order
        low = _key_value(lo)
        high = _key_value(hi)
        cols = tl.arange(0, BLOCK)
        filled = tl.full([], 0, tl.int32)
        for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            valid = start + cols < vocab
            x = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf"))
            inside = (valid & (x >= low) & (x <= high)).to(tl.int32)
            slot = filled + tl.cumsum(inside, 0) - 1
            # slot < CAP: NaN rows stay inside
            tl.store(scratch_ptr + slot, x, mask=(inside > 0) & (slot < CAP))
            filled += tl.sum(inside)
        # the gathered tokens, written by every thread, read back by every thread
        tl.debug_barrier()
        index = tl.arange(0, CAP)
        held = index < count_lo - count_above_hi
        tokens = tl.load(scratch_ptr + index, mask=held, other=float("-inf"))
        if BY_MASS:
            weights = tl.where(held, tl.exp(tokens - row_max), 0.0).to(tl.float64)
        else:
            weights = held.to(tl.float64)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            t = _key_value(mid)
            at_or_above = held & (tokens >= t)
            passes = weight_above_hi + tl.sum(tl.where(at_or_above, weights, 0.0)) >= target
            above = tl.min(tl.where(at_or_above, tokens, float("inf")))
            below = tl.max(tl.where(held & (tokens < t), tokens, float("-inf")))
            lo = tl.where(passes, _order_key(above), lo)
            hi = tl.where(passes, hi, _order_key(below))
    return _key_value(lo)


@triton.jit
def _threshold_kernel(
    logits_ptr,
    stride_row,
    top_k_ptr,
    top_p_ptr,
    out_ptr,
    scratch_ptr,
    vocab,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    scratch_ptr += row * CAP
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    by_k = (k > 0) & (k < vocab)
    by_p = p < 1.0
    threshold = tl.full([], float("-inf"), tl.float32)  # neither: keep all
    if by_k | by_p:
        row_max, row_min = _extremes(row_ptr, vocab)
        threshold = row_min
        if by_k:  # the k-th largest value: the largest v with at least k tokens >= v
            threshold = _largest_passing(
                row_ptr,
                scratch_ptr,
                vocab,
                row_min,
                row_max,
                vocab,
                k.to(tl.float64),
                row_max,
                False,
            )
        # of the tokens >= that, the largest v whose tokens >= v hold top_p
        if by_p & (row_max > float("-inf")):
            kept, count, _, _ = _tally_row(row_ptr, vocab, threshold, row_max, True)
            target = p.to(tl.float64) * kept
            threshold = _largest_passing(
                row_ptr, scratch_ptr, vocab, threshold, row_max, count, target, row_max, True
            )
    tl.store(out_ptr + row, threshold)


def top_k_top_p_threshold(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits `[m, V]` float32 (rows may be strided, tokens contiguous); top_k `[m]` (0: off); top_p
    `[m]` in (0, 1] (1: off) -> `[m, 1]` float32: per row the smallest logit `apply_top_k_top_p`
    keeps (-inf where the row keeps everything)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            "top_k_top_p_threshold takes float32 logits [m, V] with contiguous rows, got "
            f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}"
        )
    m, vocab = logits.shape
    top_k = top_k.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    if top_k.shape != (m,) or top_p.shape != (m,):
        raise ValueError(
            f"top_k and top_p need {m} values each, got {tuple(top_k.shape)} and "
            f"{tuple(top_p.shape)}"
        )
    out = torch.empty(m, 1, dtype=torch.float32, device=logits.device)
    if m:
        scratch = torch.empty(m, CAP.value, dtype=torch.float32, device=logits.device)
        _threshold_kernel[(m,)](
            logits,
            logits.stride(0),
            top_k,
            top_p,
            out,
            scratch,
            vocab,
            num_warps=NUM_WARPS,
        )
    return out
