"""The MTP layer's part of the draft step, after the step's commits (`speculator.py` runs the step).

Per sequence and step:

    target forward over [t, d1 .. dk] at positions p .. p+k
        -> the target's draws y0 .. yk (`rejection.py`)
    accept d1 .. da while d_j == y_(j-1); commit d1 .. da and y_a (a + 1 tokens)
    MTP catch-up over the a + 1 verified positions, fed (next token, target post-norm hidden)
        -> draft d1'
    k - 1 more MTP steps, each fed (the last slot's draft, its own post-norm hidden)
        -> d2' .. dk'

A slot's draft is the MTP layer's own choice unless the context lookup leads it (`forced`): the
chain then goes on from the lookup's token, so MTP's drafts extend the lookup's.

A step whose drafts the context lookup makes alone (`speculator.py`) runs no MTP forward: the MTP
rows of the positions it verified are owed to each sequence (`Owed`: the tokens after them and the
target's hidden there, kept on the device), and written by one catch-up forward over all of them
before the MTP layer next drafts for it, or when it ends, so that its next draft reads the same rows
as if it had drafted every step (and its blocks join the prefix cache whole: `Sequence.written`).
The rows owed in a step stay within the engine's token budget (`max_owed`), beyond which the MTP
layer drafts that step.

Rejected positions need no rollback: a sequence's cached length only advances over verified tokens,
and later writes overwrite the stale cache rows. Drafts are greedy (the drafter's q is one-hot); a
sequence with a grammar drafts among the tokens its grammar allows (its grammar walks the drafts,
then rolls back). After a replayed decode step without grammars (on every DP rank:
`StepShape.draft_graph`) the drafter's CUDA graph runs; otherwise the eager drafter. Under DP every
rank runs the draft step, even an empty one, and no rows are owed (the ranks would have to agree on
skipping the MTP layer).
"""

import torch

from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.runner.graphs import StepGraphs
from spmoe.engine.runner.model_runner import Forward
from spmoe.engine.sampling.grammar import SequenceGrammar, mask_allowed
from spmoe.engine.sequence import Batch, Owed, PartResult, Role, Sequence, Status
from spmoe.engine.stats import StepStats
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


class MtpDrafter:
    """Drafts `k` tokens per sequence with the model's MTP layer.
    Its KV cache rows live in the engine's cache, under the MTP layer's index, in the same slots (or
    blocks) as the target's. `graphs`: the engine's CUDA graphs (None: eager only); `keep_in_step`:
    run the draft step even with nothing to draft (DP); `max_owed`: the most MTP rows the sequences
    of a step may be owed (`defer`; 0: none)."""

    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        k: int,
        stats: StepStats | None = None,
        graphs: StepGraphs | None = None,
        keep_in_step: bool = False,
        max_owed: int = 0,
    ):
        self.model, self.cache, self.k = model, cache, k
        self.stats, self.graphs, self.keep_in_step = stats, graphs, keep_in_step
        self.max_owed = max_owed

    @torch.no_grad()
    def draft(
        self,
        batch: Batch,
        forward: Forward,
        results: list[PartResult],
        forced: dict[Sequence, list[int]],
    ) -> dict[Sequence, list[int]]:
        """The MTP layer catches up on every position the target fed and kept: a prompt chunk only
        fills its cache rows; a sequence that committed tokens and goes on gets its next drafts; one
        that ended in the step its forks took its prompt's blocks fills the rows of its prompt (but
        the last token's). `forced`: per sequence the lookup's drafts that lead its first slots. ->
        per sequence that goes on (a fork: after it has fed), the MTP layer's own choice at each of
        its k slots. The rows owed to the sequences that fed are written first."""
        fed = [r for r in results if r.part.role is not Role.FORK]
        self._pay(fed)
        if forward.draft_graph:
            return self._replayed(fed, forced)
        sources = {r.part.source for r in results if r.part.role is Role.FORK}
        to_draft, row = [], 0  # (result, the token after each fed position, the hidden there)
        for result in fed:
            part, n = result.part, len(result.part.tokens)
            if part.role is Role.PROMPT_CHUNK:  # its sequence's pending starts with the next token
                to_draft.append((result, part.tokens[1:] + part.seq.pending[:1], row, n))
            elif part.seq.status is Status.RUNNING:
                next_ids = _verified(result)
                to_draft.append((result, next_ids, row, len(next_ids)))
            elif part in sources and n > 1:  # it ends, but its forks hold its prompt's blocks
                to_draft.append((result, part.tokens[1:n], row, n - 1))
            row += n
        if not to_draft and not self.keep_in_step:
            return {}
        phase = self.stats.phases["draft"]
        with phase.measure():
            hidden = [forward.hidden[start : start + count] for *_, start, count in to_draft]
            hidden = hidden or [
                torch.zeros(
                    0, self.model.cfg.hidden_size, dtype=self.cache.dtype, device=self.cache.device
                )
            ]
            grammars = [self._walks(result) for result, *_ in to_draft]
            proposed = self.propose(
                [result.part.location for result, *_ in to_draft],
                [result.part.start for result, *_ in to_draft],
                [next_ids for _, next_ids, *_ in to_draft],
                torch.cat(hidden),
                grammars if any(g is not None for g in grammars) else None,
                [forced.get(result.part.seq, []) for result, *_ in to_draft],
            )
        phase.forwards += self.k
        phase.tokens_fed += sum(len(ids) for _, ids, *_ in to_draft) + (self.k - 1) * len(to_draft)
        return {
            result.part.seq: new
            for (result, *_), new in zip(to_draft, proposed)
            if result.part.seq.status is Status.RUNNING and result.part.draws
        }

    def can_defer(self, results: list[PartResult]) -> bool:
        """Whether the MTP rows of this step's verified positions may be owed (`defer`): every part
        decodes, and the rows owed after it stay within `max_owed`."""
        if not all(r.part.role is Role.DECODE for r in results):
            return False
        owed = [r.part.seq.owed for r in results if r.part.seq.owed is not None]
        rows = sum(len(r.part.tokens) for r in results) + sum(len(o.next_ids) for o in owed)
        return rows <= self.max_owed

    def defer(self, forward: Forward, results: list[PartResult]) -> None:
        """The step's drafts are the lookup's alone (`can_defer`): no MTP forward, but the rows of
        the positions each sequence that goes on verified are owed to it (`Owed`, its hidden rows
        copied out of `forward`); a sequence that ends is paid what it was owed before this step."""
        row = 0
        for result in results:
            seq = result.part.seq
            if seq.status is Status.RUNNING:
                next_ids = _verified(result)
                seq.owed = seq.owed or Owed(start=result.part.start)
                seq.owed.next_ids += next_ids
                seq.owed.hidden.append(forward.hidden[row : row + len(next_ids)].clone())
            row += len(result.part.tokens)
        self._pay([r for r in results if r.part.seq.status.finished])

    def _pay(self, results: list[PartResult]) -> None:
        """Write the MTP rows owed to the sequences of `results` (one forward over all of them)."""
        owing = [r for r in results if r.part.seq.owed is not None]
        if not owing:
            return
        owed = [r.part.seq.owed for r in owing]
        phase = self.stats.phases["draft"]
        with phase.measure():
            self._fed(
                [r.part.location for r in owing],
                [o.start for o in owed],
                [o.next_ids for o in owed],
                torch.cat([h for o in owed for h in o.hidden]),
            )
        phase.forwards += 1
        phase.tokens_fed += sum(len(o.next_ids) for o in owed)
        for result in owing:
            result.part.seq.owed = None

    @staticmethod
    def _walks(result: PartResult) -> SequenceGrammar | None:
        """The grammar that masks a sequence's drafts: that of one that drew and goes on,
        if it has one."""
        seq = result.part.seq
        drafting = result.part.draws and seq.status is Status.RUNNING
        return seq.grammar if drafting and seq.grammar is not None else None

    def _replayed(
        self, fed: list[PartResult], forced: dict[Sequence, list[int]]
    ) -> dict[Sequence, list[int]]:
        """The draft step after a replayed target step: the drafter's graph catches up on every fed
        position (a sequence's committed tokens are the tokens after its verified ones) and drafts
        from its last verified one; a sequence that stops gets none (its steps write the
        scratch room)."""
        k, per_seq = self.k, 1 + self.k
        next_ids, last, starts = [], [], []
        for result in fed:
            tokens = result.output.new_token_ids
            goes_on = result.part.seq.status is Status.RUNNING
            next_ids.append((tokens + [0] * per_seq)[:per_seq])
            last.append(max(len(tokens) - 1, 0))
            starts.append(result.part.start + len(tokens) if goes_on else None)
        phase = self.stats.phases["draft"]
        locations = [result.part.location for result in fed]
        with phase.measure():
            leads = [forced.get(result.part.seq, []) for result in fed]
            proposed = self.graphs.draft(
                next_ids, last, starts, locations, phase.collectives, leads
            )
        phase.forwards += k
        phase.replays += 1
        phase.tokens_fed += len(fed) * (per_seq + k - 1)
        return {
            result.part.seq: new
            for result, new, start in zip(fed, proposed, starts)
            if start is not None
        }

    def propose(
        self,
        locations: list,
        starts: list[int],
        next_ids: list[list[int]],
        hidden: torch.Tensor,
        grammars: list[SequenceGrammar | None] | None = None,
        forced: list[list[int]] | None = None,
    ) -> list[list[int]]:
        """Catch up on the verified positions of each sequence, then draft.

        Sequence i (cache room `locations[i]`: a slot, or a block table) has `len(next_ids[i])`
        verified positions from `starts[i]` on; `next_ids[i]` holds the token after each of them and
        `hidden` `[sum of lengths, H]` the target's post-norm hidden at each. `grammars`: per
        sequence the grammar its drafts follow, or None (each grammar walks the drafts and is rolled
        back); `forced`: per sequence the drafts of its first slots that the lookup leads (None:
        none). -> the MTP layer's own choice at each of the k slots of each sequence."""
        walk = _DraftWalk(grammars) if grammars is not None else None
        leads = torch.full((len(next_ids), self.k), -1, dtype=torch.long)
        for i, tokens in enumerate(forced or []):
            leads[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        try:
            return self._propose(locations, starts, next_ids, hidden, walk, leads)
        finally:
            if walk is not None:
                walk.rewind()

    def _fed(self, locations, starts, next_ids, hidden) -> torch.Tensor:
        """The MTP layer's forward over verified positions (`propose`'s arguments) -> its post-norm
        hidden `[sum of lengths, H]`; writes their MTP rows."""
        lens = [len(ids) for ids in next_ids]
        view = self.cache.view(locations, starts, lens)
        flat = [t for seq in next_ids for t in seq]
        ids = torch.tensor(flat, dtype=torch.long, device=hidden.device)
        return self.model.forward_draft_hidden(ids, view.positions, hidden, lens, view)

    def _propose(self, locations, starts, next_ids, hidden, walk, leads) -> list[list[int]]:
        device, lens = hidden.device, [len(ids) for ids in next_ids]
        leads = leads.to(device)
        last_rows = torch.tensor(lens, dtype=torch.long, device=device).cumsum(0) - 1
        h = self._fed(locations, starts, next_ids, hidden)[last_rows]
        own = [self.best(h, walk)]  # [S] per slot
        positions, ones = [s + n for s, n in zip(starts, lens)], [1] * len(locations)
        for slot in range(self.k - 1):
            tokens = self._chosen(own[-1], leads[:, slot], walk)
            view = self.cache.view(locations, positions, ones)
            # recycle the post-norm hidden `[S, H]`
            h = self.model.forward_draft_hidden(tokens, view.positions, h, ones, view)
            own.append(self.best(h, walk))
            positions = [p + 1 for p in positions]
        return torch.stack(own, dim=1).tolist()  # [S, k]: read back once

    def best(self, h: torch.Tensor, walk: "_DraftWalk | None") -> torch.Tensor:
        """MTP post-norm hidden `[S, H]` -> each sequence's own choice `[S]`: the argmax of its
        draft logits, among the tokens its grammar allows when it has one."""
        logits = self.model.compute_draft_logits(h)
        if walk is not None:
            walk.mask(logits)
        return logits.argmax(-1)

    @staticmethod
    def _chosen(own: torch.Tensor, leads: torch.Tensor, walk: "_DraftWalk | None") -> torch.Tensor:
        """A slot's drafts `[S]`: the lookup's where it leads (`leads` >= 0), else MTP's own choice;
        the grammars walk over them."""
        tokens = torch.where(leads >= 0, leads, own)
        if walk is not None:
            walk.advance(tokens.tolist())
        return tokens


def _verified(result: PartResult) -> list[int]:
    """A decode part's verified positions (its last token and the drafts kept) -> the token after
    each: the next fed one, then the token the target drew after the last."""
    part = result.part
    verified = len(part.tokens) - (len(part.drafts) - result.accepted)
    return part.tokens[1:verified] + [result.output.new_token_ids[-1]]


class _DraftWalk:
    """The grammars of the drafted sequences (None: no grammar) walked over each new draft, so that
    every draft is the drafter's best among the tokens its grammar allows; `rewind` puts them back.
    A grammar that refuses a draft (its row allowed nothing) or ends with one stops walking."""

    def __init__(self, grammars: list[SequenceGrammar | None]):
        self.grammars = grammars
        self.before = {i: g.position() for i, g in enumerate(grammars) if g is not None}
        self.walking = [i for i in self.before if not grammars[i].finished]

    def mask(self, logits: torch.Tensor) -> None:
        mask_allowed(
            logits,
            [self.grammars[i] if i in self.walking else None for i in range(len(self.grammars))],
        )

    def advance(self, drafts: list[int]) -> None:
        self.walking = [i for i in self.walking if self.grammars[i].accept(drafts[i])]
        self.walking = [i for i in self.walking if not self.grammars[i].finished]

    def rewind(self) -> None:
        for i, position in self.before.items():
            self.grammars[i].rewind(position)
