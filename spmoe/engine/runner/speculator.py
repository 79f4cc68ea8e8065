"""The draft step: which source drafts each sequence's next slots, and the drafts
(after the commits).

Sources: the MTP layer (`drafter.py`) and a lookup in the context (`lookup.py`: vLLM's `ngram` or
`suffix`). `Speculation` says which, and k, the draft slots a sequence verifies per step:

- MTP alone: k MTP drafts, every sequence, every step.
- a lookup alone: its proposal, up to k drafts (none without a match).
- both, the hybrid: per sequence, the lookup leads when it has a proposal and has lately been right
  at least as often per draft as MTP (`SourceChoice`: a tie goes to the lookup, which costs no GPU
  time). Its L drafts fill the first slots; MTP's chain is fed them and fills the other k - L (MTP's
  drafts extend the lookup's). Otherwise MTP fills all k. Every sequence thus has k drafts, whatever
  their sources, and one target forward verifies them all (the decode and drafter CUDA graphs run
  it). When the lookup leads every sequence of the step with all k slots, the MTP layer runs no
  forward that step (`MtpDrafter.defer`: the rows it owes are written before it next drafts): the
  step costs what the lookup alone costs.

Every draft is a deterministic proposal, so the one-hot rule keeps the output lossless whatever the
source (`sampling/rejection.py`), and every rank drafts the same from the same committed tokens.
"""

import weakref

import torch

from spmoe.engine.runner.drafter import MtpDrafter
from spmoe.engine.runner.lookup import NgramLookup, SuffixLookup
from spmoe.engine.runner.model_runner import Forward
from spmoe.engine.sequence import Batch, Draft, PartResult, Role, Sequence, Status
from spmoe.engine.speculation import NgramConfig, Speculation
from spmoe.engine.stats import StepStats

DECAY = 0.9  # a step's weight in a sequence's acceptance rates, against the steps before
# (hits, tries) the rates start from: a match in the sequence's own context is evidence, so the
# lookup starts ahead (0.75 against 0.5) and leads until it misses
PRIORS = {"lookup": (1.5, 2.0), "mtp": (1.0, 2.0)}


class SourceChoice:
    """Per sequence, whether the lookup leads its next draft. Each step where the lookup proposed,
    both sources are scored against the committed tokens, slot by slot, where their proposal was
    made under the committed prefix: MTP's own choice at slot i while the drafts before it were
    accepted (its chain was fed them), the lookup's token at slot i while its tokens before it were
    right. A rate is hits / tries, each step's counts added to the earlier ones decayed by DECAY,
    from PRIORS; a step where the MTP layer did not draft (the lookup filled every slot) scores the
    lookup alone. The lookup leads when its rate is at least MTP's: with per-draft rates a >= b, a
    draft of L lookup tokens then MTP's expects at least as many accepted tokens as MTP's alone, for
    every L, at less GPU time."""

    def __init__(self):
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def lookup_leads(self, seq: Sequence) -> bool:
        state = self._state(seq)
        return _rate(state["lookup"]) >= _rate(state["mtp"])

    def remember(self, seq: Sequence, lookup: list[int], mtp: list[int]) -> None:
        """The proposals behind `seq`'s next draft: the lookup's (may be empty), MTP's own choices
        (empty: the MTP layer did not draft)."""
        self._state(seq)["proposed"] = (lookup, mtp)

    def _state(self, seq: Sequence) -> dict:
        if seq not in self.state:
            self.state[seq] = {source: list(prior) for source, prior in PRIORS.items()}
        return self.state[seq]

    def observe(self, result: PartResult) -> None:
        """Score the proposals behind the drafts `result` verified against the tokens it drew."""
        state = self.state.get(result.part.seq)
        proposed = state.pop("proposed", None) if state is not None else None
        if not result.part.drafts or proposed is None or not proposed[0]:
            return
        lookup, mtp = proposed
        drawn, accepted = result.tokens, result.accepted
        if mtp:
            seen = [(mtp[i] == drawn[i]) for i in range(min(len(mtp), len(drawn), accepted + 1))]
            _add(state["mtp"], seen)
        seen = []
        for i in range(min(len(lookup), len(drawn))):
            seen.append(lookup[i] == drawn[i])
            if not seen[-1]:
                break
        _add(state["lookup"], seen)


def _rate(counts: list[float]) -> float:
    return counts[0] / counts[1]


def _add(counts: list[float], seen: list[bool]) -> None:
    counts[0] = counts[0] * DECAY + sum(seen)
    counts[1] = counts[1] * DECAY + len(seen)


class Speculator:
    """The draft step of an engine speculating as `speculation` says (see the module); `drafter`:
    the MTP layer's (None when it does not draft); `stats`: where the chosen sources are counted."""

    def __init__(self, speculation: Speculation, drafter: MtpDrafter | None, stats: StepStats):
        self.k, self.drafter, self.stats = speculation.num_speculative_tokens, drafter, stats
        lookup = speculation.lookup
        self.lookup = None
        if lookup is not None:
            built = NgramLookup if isinstance(lookup, NgramConfig) else SuffixLookup
            self.lookup = built(lookup)
        self.choice = SourceChoice()

    @torch.no_grad()
    def draft(
        self, batch: Batch, forward: Forward, results: list[PartResult]
    ) -> dict[Sequence, Draft]:
        """-> the next drafts of each sequence that drew this step and goes on (the MTP layer also
        catches up on what the others fed, `MtpDrafter.draft`, or owes it, `MtpDrafter.defer`)."""
        if not self.k:
            return {}
        for result in results:
            self.choice.observe(result)
            if result.part.seq.status.finished and self.lookup is not None:
                self.lookup.finished(result.part.seq)
        going_on = [
            r.part.seq
            for r in results
            if r.part.role is not Role.FORK and r.part.draws and r.part.seq.status is Status.RUNNING
        ]
        proposals = {}
        if self.lookup is not None:
            proposals = {seq: self.lookup.propose(seq, self.k) for seq in going_on}
        if self.drafter is None:
            drafts = {seq: Draft(tokens=p, from_lookup=len(p)) for seq, p in proposals.items()}
            self.stats.count_choices(drafts.values())
            return drafts
        leads = self.leads(proposals)
        if self.lookup_fills(going_on, leads) and self.drafter.can_defer(results):
            self.drafter.defer(forward, results)
            own = {seq: [] for seq in going_on}
        else:
            own = self.drafter.draft(batch, forward, results, leads)
        drafts = {seq: self.merged(seq, leads, proposals, mine) for seq, mine in own.items()}
        self.stats.count_choices(drafts.values())
        return drafts

    def lookup_fills(self, seqs: list[Sequence], leads: dict[Sequence, list[int]]) -> bool:
        """Whether the lookup leads every one of `seqs` (some) with all k slots: the MTP layer's
        drafts would go unused."""
        return bool(seqs) and all(len(leads.get(seq, ())) == self.k for seq in seqs)

    def leads(self, proposals: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
        """The lookup's proposals that lead their sequence's next draft."""
        return {seq: p for seq, p in proposals.items() if p and self.choice.lookup_leads(seq)}

    def merged(
        self,
        seq: Sequence,
        leads: dict[Sequence, list[int]],
        proposals: dict[Sequence, list[int]],
        own: list[int],
    ) -> Draft:
        """`seq`'s draft: the lookup's lead, then MTP's own choices for the other slots (`own`: one
        per slot, fed the lead; empty when the lead fills them all and MTP did not draft); both
        proposals are kept to score them once verified."""
        lead = leads.get(seq, [])
        self.choice.remember(seq, proposals.get(seq, []), own)
        return Draft(tokens=lead + own[len(lead) :], from_lookup=len(lead))
