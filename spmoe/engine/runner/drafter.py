"""Speculative decoding with MTP: draft k tokens per sequence, let the target verify them in one forward.

Per sequence and step:

    target forward over [t, d1 .. dk] at positions p .. p+k  -> the target's draws y0 .. yk (`rejection.py`:
                                                                the argmax of a greedy request, a seeded draw
                                                                from the processed distribution otherwise)
    accept d1 .. da while d_j == y_(j-1); commit d1 .. da and y_a (a + 1 tokens)
    MTP catch-up over the a + 1 verified positions, fed (next token, target post-norm hidden) -> draft d1'
    k - 1 more MTP steps, each fed (its last draft, its own post-norm hidden)           -> d2' .. dk'

Rejected positions need no rollback: the engine only advances a sequence's cached length over verified
tokens, and later writes overwrite the stale cache rows. A sequence with a grammar (structured output) drafts
among the tokens its grammar allows (`grammar.DraftGrammars`): a draft the grammar forbids would be rejected.
"""

import torch

from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.sampling.grammar import DraftGrammars
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


class MtpDrafter:
    """Drafts `k` tokens per sequence with the model's MTP layer, greedily (its q is one-hot). Its KV cache rows
    live in the engine's cache, under the MTP layer's index, in the same slots (or blocks) as the target's."""

    def __init__(self, model: DeepseekV32ForCausalLM, cache: KVCache | PagedKVCache, k: int):
        self.model, self.cache, self.k = model, cache, k

    def propose(
        self,
        locations: list,
        starts: list[int],
        next_ids: list[list[int]],
        hidden: torch.Tensor,
        grammars: DraftGrammars | None = None,
    ) -> list[list[int]]:
        """Catch up on the verified positions of each sequence, then draft.

        Sequence i (cache room `locations[i]`: a slot, or a block table) has `len(next_ids[i])` verified
        positions from `starts[i]` on; `next_ids[i]` holds the token after each of them and `hidden`
        `[sum of lengths, H]` the target's post-norm hidden at each. `grammars`: the sequences' grammars, when
        one has a grammar: each draft is then chosen among the tokens its grammar allows. Returns k drafts per
        sequence.
        """
        device, lens = hidden.device, [len(ids) for ids in next_ids]
        view = self.cache.view(locations, starts, lens)
        ids = torch.tensor([t for seq in next_ids for t in seq], dtype=torch.long, device=device)
        last_rows = torch.tensor(lens, dtype=torch.long, device=device).cumsum(0) - 1
        h = self.model.forward_draft_hidden(ids, view.positions, hidden, lens, view)[
            last_rows
        ]  # [S, H]
        tokens = self.best(h, grammars)  # [S]
        drafts = [tokens]
        positions, ones = [s + n for s, n in zip(starts, lens)], [1] * len(locations)
        for _ in range(self.k - 1):
            view = self.cache.view(locations, positions, ones)
            h = self.model.forward_draft_hidden(
                tokens, view.positions, h, ones, view
            )  # recycle the post-norm hidden
            tokens = self.best(h, grammars)
            drafts.append(tokens)
            positions = [p + 1 for p in positions]
        return torch.stack(drafts, dim=1).tolist()  # [S, k]: read back once

    def best(self, h: torch.Tensor, grammars: DraftGrammars | None) -> torch.Tensor:
        """MTP post-norm hidden `[S, H]` -> each sequence's next draft `[S]`: the argmax of its draft logits, among
        the tokens its grammar allows when it has one (then read back, for the grammars to walk on)."""
        logits = self.model.compute_draft_logits(h)
        if grammars is None:
            return logits.argmax(-1)
        grammars.mask(logits)
        tokens = logits.argmax(-1)
        grammars.advance(tokens.tolist())
        return tokens
