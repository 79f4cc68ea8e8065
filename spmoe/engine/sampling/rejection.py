"""Lossless speculative sampling: which drafts the target keeps, so that the tokens follow the
target's own distribution exactly, whatever the drafts were. Vectorised over sequences, positions
and the vocabulary.

A sequence fed its last token and k drafts x_1 .. x_k; the target's forward gives its distribution
p_j at each of the k + 1 positions (p_j after the drafts before it, processed by `Sampler.process`
exactly as without speculation: grammar mask, min_tokens, logit_bias, penalties counting the drafts
before it, temperature, min_p, top_k, top_p; `ModelRunner.choose` passes every row of the step
through `Sampler.sample`). The rule, for a drafter with distribution q_j at position j:
- x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), while every draft before it was;
- at the first rejection the token is drawn from the residual max(0, p_j - q_j), normalised;
- after k accepted drafts one more token (the bonus) is drawn from p_k.

Every draw is an exponential race on seeded noise (of the request's seed, the output index of the
token being chosen and the token id; `sampling.draw_tokens`: on CUDA one kernel, elsewhere
`exponential_noise` and `race`): token = argmax_i p_i / E_i, E_i ~ Exp(1), picks i with probability
p_i. So a request's tokens depend on its seed and the logits only, and every TP rank
draws the same ones.

The MTP drafter is greedy: q_j is one-hot at x_j. Then the rule reads: accept x_j with probability
p_j(x_j), else draw from p_j with x_j removed, renormalised. `accept_drafts` realises it by racing
p_j itself and accepting x_j exactly when the race picks x_j (probability p_j(x_j)); when it picks
another token, that token is distributed as p_j without x_j, renormalised: the residual. The
committed tokens are then exactly the tokens the target would have drawn one at a time from the same
seed, and a greedy row (p one-hot at the argmax) accepts exactly the drafts equal to the target's
argmax: bit for bit the target's greedy output.

`rejection_sample` is the rule for a drafter with a general q (one that samples its drafts): its
uniform for the acceptance test is exp(-E_j(x_j)), the race noise at the draft token. On a rejection
p_j(x_j) < q_j(x_j), so the residual is 0 at x_j and the residual race never looks at that noise:
the two draws are independent.
"""

import torch

from spmoe.engine.sampling.noise import race


def accept_drafts(
    draft_ids: torch.Tensor, num_drafts: torch.Tensor, choices: torch.Tensor
) -> torch.Tensor:
    """The one-hot drafter's rule. draft_ids `[S, K]` int64 (row i's first `num_drafts[i]` are real,
    the rest padding), choices `[S, K + 1]` int64: the target's own draw at each fed position
    (`race`, or the argmax of a greedy row) -> accepted `[S]` int64: the leading drafts equal to the
    target's draw before them.

    Row i then commits `choices[i, : accepted[i] + 1]`: the accepted drafts (equal to the draws) and
    the target's draw after them (the correction at the first rejection, or the bonus)."""
    real = torch.arange(draft_ids.shape[1], device=draft_ids.device) < num_drafts[:, None]
    matches = (draft_ids == choices[:, :-1]) & real
    return matches.long().cumprod(1).sum(1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for a general drafter. target_probs `[S, K + 1, V]` (p at each fed position),
    draft_ids `[S, K]` int64, draft_probs `[S, K, V]` (q_j, the distribution x_j was drawn from),
    noise `[S, K + 1, V]` Exp(1)
    -> (accepted `[S]` int64, tokens `[S, K + 1]` int64): row i commits
    `tokens[i, : accepted[i] + 1]`, its accepted drafts and then the residual draw at the first
    rejection, or the bonus draw from p_K."""
    k = draft_ids.shape[1]
    at_draft = draft_ids[..., None]
    p_x = target_probs[:, :k].gather(-1, at_draft).squeeze(-1)
    q_x = draft_probs.gather(-1, at_draft).squeeze(-1)
    uniform = torch.exp(-noise[:, :k].gather(-1, at_draft).squeeze(-1))  # in (0, 1)
    matches = uniform * q_x < p_x  # u < p / q without dividing by a zero q
    accepted = matches.long().cumprod(1).sum(1)
    residual = (target_probs[:, :k] - draft_probs).clamp(min=0)
    # rounding can leave a rejection with no residual mass (p == q up to an ulp): draw from p there
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[:, :k])
    corrections = race(residual, noise[:, :k])
    bonus = race(target_probs[:, k], noise[:, k])
    position = torch.arange(k + 1, device=draft_ids.device)
    drafts_then_correction = torch.cat([draft_ids, bonus[:, None]], dim=1)
    corrections = torch.cat([corrections, bonus[:, None]], dim=1)
    tokens = torch.where(position < accepted[:, None], drafts_then_correction, corrections)
    return accepted, tokens
