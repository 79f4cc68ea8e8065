"""What a request's sampling parameters do to its logits, as batched tensor operations.

Every function takes logits `[m, V]` float32 (m rows, one per token being chosen; rows of different
requests with different settings side by side) and per-row parameters as tensors `[m]` or `[m, K]`,
and changes the logits in place. No Python loop over rows or over the vocabulary. A row whose
parameter is neutral (penalty 0, repetition 1, top_k 0, top_p 1, min_p 0, an empty id list) is left
exactly as it was.

The order `Sampler` applies them in, and why (a grammar's mask comes before all of them, in
`model_runner.mask_by_grammars`, at the dtype's lowest value, which nothing below can revive):
1. `suppress_tokens`: `min_tokens` keeps the eos and stop ids out until enough tokens are out;
2. `add_logit_bias`: the client's additive bias;
3. `apply_penalties`: repetition, frequency and presence penalties from the tokens
   already generated;
4. `scale_by_temperature`; 5. `apply_min_p`; 6. `apply_top_k_top_p` (truncation of the
   distribution drawn from).
"""

import torch

from spmoe.layers.fused import use_fused

NEG_INF = float("-inf")


def suppress_tokens(logits: torch.Tensor, ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """logits `[m, V]`; ids `[m, S]` int64 token ids per row, -1 for padding; active `[m]` bool. The
    listed tokens of the active rows get -inf (`min_tokens`: the eos and stop ids before the minimum
    is reached)."""
    hit = active[:, None] & (ids >= 0)
    add = torch.zeros(ids.shape, dtype=logits.dtype, device=logits.device).masked_fill_(
        hit, NEG_INF
    )
    return logits.scatter_add_(1, ids.clamp(min=0), add)


def add_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """logits `[m, V]`; ids `[m, B]` int64 (-1: padding) and values `[m, B]` float32:
    logits[r, ids[r, j]] += values[r, j] (a sparse add; padding adds 0 to token 0)."""
    return logits.scatter_add_(1, ids.clamp(min=0), values.masked_fill(ids < 0, 0.0))


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits `[m, V]`; output_counts `[m, V]` (how often each token was generated so far);
    prompt_mask `[m, V]` bool (the token occurs in the prompt; None when no row has a repetition
    penalty); presence, frequency, repetition `[m]` float32.

    - repetition (1: off): a token seen in the prompt or the output has its logit divided by the
      penalty when positive, multiplied by it when negative (either way less likely for
      a penalty > 1);
    - frequency: the logit minus frequency x the token's output count;
    - presence: the logit minus presence once the token occurs in the output.
    """
    counts = output_counts.to(logits.dtype)
    generated = counts > 0
    if prompt_mask is not None:
        seen = generated | prompt_mask
        r = repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits, out=logits)
    logits -= frequency[:, None] * counts
    logits -= presence[:, None] * generated.to(logits.dtype)
    return logits


def scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits `[m, V]` divided by temperature `[m]`; a row at temperature 0 (greedy) is
    left as it is."""
    return logits.div_(torch.where(temperature > 0, temperature, 1.0)[:, None])


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits `[m, V]`; min_p `[m]` in [0, 1]. A token whose probability is below min_p x the most
    likely token's gets -inf. The ratio of two probabilities is exp of the difference of their
    logits, so no softmax is needed: drop where logit < max logit + log(min_p) (log 0 = -inf:
    nothing dropped)."""
    floor = logits.amax(-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill_(logits < floor, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits `[m, V]`; top_k `[m]` int64 (0: off); top_p `[m]` in (0, 1] (1: off).

    - top_k keeps the tokens whose logit is at least the k-th largest (ties at the k-th value all
      stay; k >= V keeps all);
    - top_p then keeps, of the distribution that top_k left (renormalised), the smallest set of most
      likely tokens whose mass reaches top_p, the token that crosses top_p included, and every token
      tied with it (whatever order a sort would put ties in); top_p 1 keeps all.
    Everything else gets -inf. What is kept is every token at or above one threshold per row: the
    logit of the last token kept. On CUDA with triton it comes from one Triton kernel, a bisection
    that sums the mass in float64 (`top_k_top_p_triton`); elsewhere from a full sort, whose mass is
    a float32 cumulative sum (`top_k_top_p_threshold_by_sort`, the reference). Where the mass above
    the crossing token lies within float32 rounding of top_p, the two may keep one group of equal
    tokens more or less; elsewhere they keep the same."""
    if use_fused(logits):
        from spmoe.engine.sampling.top_k_top_p_triton import top_k_top_p_threshold

        threshold = top_k_top_p_threshold(logits, top_k, top_p)
    else:
        threshold = top_k_top_p_threshold_by_sort(logits, top_k, top_p)
    return logits.masked_fill_(logits < threshold, NEG_INF)


def top_k_top_p_threshold_by_sort(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`apply_top_k_top_p`'s threshold from one full sort of every row (the arguments as there) ->
    `[m, 1]`: the logit of the last token each row keeps."""
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [m, 1]
    sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
    # top_p 1: keep all (no rounding losses)
    drop_sorted = (before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop_sorted |= sorted_logits == NEG_INF
    return sorted_logits.gather(1, ((~drop_sorted).sum(-1, keepdim=True) - 1).clamp(min=0))
