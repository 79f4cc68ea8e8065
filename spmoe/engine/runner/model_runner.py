"""One step on the model: `run(batch) -> StepResult`.

1. One target forward over every scheduled sequence's tokens, laid end to end: run eagerly or, for a decode
   step (one token per sequence, or with speculation its token and its k drafts) and, paged, for any other
   step of up to 512 tokens, replayed from a CUDA graph (`cuda_graphs.py`); the logits of the rows the step
   commits from.
2. The choice: every row the step commits from goes through the batched `Sampler` at once (each row with
   its request's settings); a sequence takes the token of its last row, or, when it fed drafts, the drafts
   the target keeps and the target's next draw, by the lossless rule of `rejection.py` (each row's draw is
   the one it would make without drafts: greedy and sampled requests alike, the same seeded noise, the same
   logprobs); the tokens are cut at its first eos id or its token limit. A fork (the n choices of a prompt,
   `ScheduledBatch.forks`) draws its first token from a copy of the row of the prompt's last token, with its
   own settings. A row that is not finite gives no token. A sequence whose request asks for prompt logprobs
   also gets the logprobs of the prompt tokens it fed (`prompt_logprobs`), from the hidden states, a slice of
   rows at a time. A sequence with a grammar (structured output, `grammar.py`) first has the tokens its
   grammar does not allow next masked out of its row (each row of a sequence that fed drafts: by its grammar
   after the drafts before it), for the whole batch at once.
3. When speculating, the MTP drafter catches up on the fed positions and proposes each sequence's next
   drafts (`speculative.py`; a sequence with a grammar among the tokens its grammar allows). After a replayed
   decode step the drafter's graph of the same batch size runs, unless a sequence has a grammar: the eager
   drafter then masks each draft step (from the graph's hidden states). Under DP every rank runs the draft
   step, even an empty one.

It reads the sequences and changes none of them (grammars walk over drafts and are rolled back):
`Scheduler.update` commits what it returns.
"""

from itertools import accumulate

import torch

from spmoe.distributed import CommStats
from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.runner.drafter import MtpDrafter
from spmoe.engine.runner.graphs import CapturedStep, StepGraphs
from spmoe.engine.sampling.grammar import DraftGrammars, apply_bitmask, fill_bitmask
from spmoe.engine.sampling.rejection import accept_drafts
from spmoe.engine.sampling.sampler import Sampler, prompt_logprobs
from spmoe.engine.sequence import ScheduledBatch, Sequence, StepResult
from spmoe.engine.stats import StepStats
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

PROMPT_LOGPROB_ROWS = (
    256  # prompt rows turned into logits at once: bounds the `[rows, V]` float32 buffer
)


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        max_num_seqs: int,
        stats: StepStats,
        sampler: Sampler,
        num_speculative_tokens: int = 0,
        cuda_graphs: bool = False,
        keep_in_step: bool = False,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 0,
        log=None,
    ):
        """`stats`: where the forwards are counted; `sampler`: the sequences' sampling rows (the scheduler
        takes and frees them); `keep_in_step`: run the draft step even with nothing to
        draft (under DP, where every rank runs every step); `max_model_len`: the most positions a sequence
        takes (the width of the graphs' block tables); `max_num_batched_tokens`: the step's token budget (the
        largest mixed-step graph); `log(line)`: progress while capturing graphs."""
        self.model, self.cache, self.stats, self.keep_in_step = model, cache, stats, keep_in_step
        self.sampler = sampler
        on_capture = None
        if log is not None:

            def on_capture(kind: str, size: int, index: int, count: int) -> None:
                step = (
                    f"the decode step for batch {size}"
                    if kind == "decode"
                    else f"a step of up to {size} tokens"
                )
                log(f"warming up: capturing the CUDA graph of {step} ({index}/{count})")

        self.graphs = None
        if cuda_graphs:
            self.graphs = StepGraphs(
                model,
                cache,
                max_num_seqs,
                max_model_len,
                on_capture,
                num_speculative_tokens,
                max_num_batched_tokens,
            )
        self.drafter = (
            MtpDrafter(model, cache, num_speculative_tokens) if num_speculative_tokens else None
        )

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> StepResult:
        phase = self.stats.target_phase(batch)
        with phase.measure():
            logits, hidden, replayed = self.forward(batch, phase.collectives)
            phase.replays += replayed is not None
            result = self.choose(batch, logits)
            if any(s.wants_prompt_logprobs for s in batch.seqs):
                result.prompt_logprobs = self.prompt_logprobs(batch, hidden)
        phase.forwards += 1
        phase.tokens_fed += sum(batch.num_tokens)
        phase.tokens_committed += sum(map(len, result.token_ids))
        if self.drafter is not None:
            result.drafts = self.draft(batch, result, hidden, replayed)
        return result

    def forward(
        self, batch: ScheduledBatch, collectives: CommStats
    ) -> tuple[torch.Tensor, torch.Tensor, CapturedStep | None]:
        """The target forward -> (logits `[R, V]` float32 of the R rows the step commits from: the last
        1 + drafts rows of each sequence that samples, the FULL post-norm hidden of the N fed tokens (`[N, H]`;
        a replayed graph's has pad rows after them), the CUDA graph that ran or None). No sequences: an empty
        forward (a DP rank that must keep in step). Replayed collectives are added to `collectives`."""
        tokens, graphs = batch.tokens(), self.graphs
        if graphs is not None and batch.decode and graphs.fits(batch.num_tokens):
            logits = graphs.step(tokens, batch.locations, batch.starts, collectives)
            return logits, graphs.replayed.hidden, graphs.replayed
        lens, replayed = [len(t) for t in tokens], None
        if graphs is not None and graphs.fits_mixed(lens):
            hidden, replayed = (
                graphs.mixed_step(tokens, batch.locations, batch.starts, collectives),
                graphs.replayed,
            )
        else:
            view = self.cache.view(batch.locations, batch.starts, lens)
            ids = torch.tensor(
                [t for seq in tokens for t in seq], dtype=torch.long, device=view.positions.device
            )
            hidden = self.model.forward_hidden(ids, view.positions, lens, view)  # FULL [N, H]
        logit_rows = [
            1 + len(s.drafts) if last else 0 for s, last in zip(batch.seqs, batch.samples)
        ]
        rows = [r for end, m in zip(accumulate(lens), logit_rows) for r in range(end - m, end)]
        return (
            self.model.compute_logits(
                hidden, torch.tensor(rows, dtype=torch.long, device=hidden.device)
            ),
            hidden,
            replayed,
        )

    def choose(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepResult:
        """logits `[R, V]` (see `forward`) -> each sequence's committed tokens, accepted drafts, finite flag and,
        when asked, logprobs, then each fork's. Every row goes through the sampler in one call: row j of a
        sequence that fed d drafts chooses its (len(output) + j)-th token, after the first j drafts; a fork
        chooses its first token from a copy of its source's row (a grammar masks the copy only)."""
        rows, generated, preceding, spans = [], [], [], []
        for seq, last in zip(batch.seqs, batch.samples):
            first = len(rows)
            if last:
                for j in range(1 + len(seq.drafts)):
                    rows.append(seq.sample_row)
                    generated.append(len(seq.output) + j)
                    preceding.append(seq.drafts[:j])
            spans.append(slice(first, len(rows)))
        committing = list(zip(batch.seqs, batch.samples))
        if batch.forks:
            # a source's prompt completes this step: it has no drafts, its one row is its last prompt token's
            logits = torch.cat([logits, logits[[spans[source].start for _, source in batch.forks]]])
            for seq, _ in batch.forks:
                spans.append(slice(len(rows), len(rows) + 1))
                rows.append(seq.sample_row)
                generated.append(len(seq.output))
                preceding.append([])
                committing.append((seq, True))
        most_tokens = iter(mask_by_grammars([s for s, last in committing if last], logits))
        chosen = self.sampler.sample(logits, rows, generated, preceding if any(preceding) else None)
        accepted_of = (
            self._accepted(batch, chosen.token_ids, spans[: len(batch.seqs)])
            if any(preceding)
            else None
        )
        wants_logprobs = any(s.request.sampling.logprobs is not None for s, _ in committing)
        result = StepResult([], [], [], logit_rows=[], logprobs=[] if wants_logprobs else None)
        for (seq, last), span in zip(committing, spans):
            tokens, accepted, finite, recorded, logprobs = [], 0, True, None, None
            if last:
                choices = chosen.token_ids[span]
                if seq.drafts:
                    accepted = accepted_of[len(result.token_ids)]
                candidates = choices[: min(accepted + 1, next(most_tokens))]
                accepted = min(
                    accepted, len(candidates)
                )  # its grammar ended at a draft: none kept after it
                finite = all(chosen.finite[span][: len(candidates)])
                if finite:
                    tokens, _ = seq.until_stop(candidates)
                    if seq.record_logits:
                        recorded = [
                            logits[j].cpu() for j in range(span.start, span.start + len(tokens))
                        ]
                    if seq.request.sampling.logprobs is not None:
                        logprobs = list(zip(chosen.logprobs[span], chosen.top_logprobs[span]))[
                            : len(tokens)
                        ]
            result.token_ids.append(tokens)
            result.accepted.append(accepted)
            result.finite.append(finite)
            result.logit_rows.append(recorded)
            if wants_logprobs:
                result.logprobs.append(logprobs)
        return result

    @staticmethod
    def _accepted(batch: ScheduledBatch, choices: list[int], spans: list[slice]) -> list[int]:
        """The step's choices (row j of a sequence: the target's draw after its first j drafts) -> per scheduled
        sequence the number of its drafts it keeps (`rejection.accept_drafts`, for the whole batch at once)."""
        width = max(len(s.drafts) for s in batch.seqs)
        draft_ids = [s.drafts + [-1] * (width - len(s.drafts)) for s in batch.seqs]  # -1: padding
        draws = [choices[span] + [-1] * (width + 1 - len(choices[span])) for span in spans]
        accepted = accept_drafts(
            torch.tensor(draft_ids, dtype=torch.int64),
            torch.tensor([len(s.drafts) for s in batch.seqs]),
            torch.tensor(draws, dtype=torch.int64),
        )
        return accepted.tolist()

    def prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> list[list | None]:
        """The hidden `[N, H]` of every fed token -> per sequence that wants them, the logprobs of the prompt
        tokens it fed this step (see `StepResult.prompt_logprobs`); None for the others."""
        out, fed = [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            prompt, start, got = seq.request.prompt, seq.cached, None
            if seq.wants_prompt_logprobs and start < len(prompt):
                count = min(n, len(prompt) - start)  # prompt tokens fed this step
                got = [None] if start == 0 else []
                # row i (position start + i) predicts prompt[start + i + 1]; the prompt's last row predicts an
                # output token: it is no prompt token's
                predicting = min(count, len(prompt) - 1 - start)
                for first in range(0, predicting, PROMPT_LOGPROB_ROWS):
                    size = min(PROMPT_LOGPROB_ROWS, predicting - first)
                    index = torch.arange(fed + first, fed + first + size, device=hidden.device)
                    logits = self.model.compute_logits(hidden, index)
                    following = torch.tensor(
                        prompt[start + first + 1 : start + first + 1 + size], device=hidden.device
                    )
                    got += prompt_logprobs(logits, following, seq.request.sampling.prompt_logprobs)
            out.append(got)
            fed += n
        return out

    def draft(
        self,
        batch: ScheduledBatch,
        result: StepResult,
        hidden: torch.Tensor,
        replayed: CapturedStep | None,
    ) -> list[list[int]]:
        """The MTP layer catches up on every position the target fed and kept: a prompt chunk before the last
        only fills its cache rows; a sequence that committed tokens and goes on gets its next drafts; one that
        ends in the step its forks took its prompt's blocks fills the rows of its prompt (but the last token's).
        `hidden`, `replayed`: the target's (`forward`); after a replayed decode step the drafter's graph
        follows, unless a sequence has a grammar (the eager drafter masks each draft step by the grammars).
        -> the drafts per scheduled sequence ([] for the others; a fork gets its first drafts after it fed)."""
        if (
            replayed is not None
            and replayed.draft is not None
            and all(seq.grammar is None for seq in batch.seqs)
        ):
            return self.draft_replayed(batch, result)
        to_draft, fed = (
            [],
            0,
        )  # (its index, first fed position, the token after each, the target's hidden there)
        sources = {source for _, source in batch.forks}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            tokens = result.token_ids[i]
            if not batch.samples[i]:
                to_draft.append((i, seq.cached, seq.pending[1 : n + 1], hidden[fed : fed + n]))
            elif tokens and seq.until_stop(tokens)[1] is None:
                verified = n - (len(seq.drafts) - result.accepted[i])
                to_draft.append(
                    (
                        i,
                        seq.cached,
                        seq.pending[1:verified] + [tokens[-1]],
                        hidden[fed : fed + verified],
                    )
                )
            elif (
                i in sources and n > 1
            ):  # it ends here, but its forks hold its prompt's blocks: their rows too
                to_draft.append((i, seq.cached, seq.pending[1:n], hidden[fed : fed + n - 1]))
            fed += n
        drafts = [[] for _ in batch.seqs]
        if not to_draft and not self.keep_in_step:
            return drafts
        phase, k = self.stats.phases["draft"], self.drafter.k
        with phase.measure():
            hidden_fed = [h for *_, h in to_draft] or [
                torch.zeros(
                    0, self.model.cfg.hidden_size, dtype=self.cache.dtype, device=self.cache.device
                )
            ]
            grammars = None
            if any(batch.seqs[i].grammar is not None and batch.samples[i] for i, *_ in to_draft):
                grammars = DraftGrammars(
                    [batch.seqs[i].grammar if batch.samples[i] else None for i, *_ in to_draft],
                    [result.token_ids[i] for i, *_ in to_draft],
                )
            try:
                proposed = self.drafter.propose(
                    [batch.locations[i] for i, *_ in to_draft],
                    [start for _, start, *_ in to_draft],
                    [ids for _, _, ids, _ in to_draft],
                    torch.cat(hidden_fed),
                    grammars,
                )
            finally:
                if grammars is not None:
                    grammars.rewind()  # the committed tokens advance them in `Scheduler.update`
        for (i, *_), new in zip(to_draft, proposed):
            if batch.samples[i]:
                drafts[i] = new
        phase.forwards += k
        phase.tokens_fed += sum(len(ids) for _, _, ids, _ in to_draft) + (k - 1) * len(to_draft)
        return drafts

    def draft_replayed(self, batch: ScheduledBatch, result: StepResult) -> list[list[int]]:
        """`draft` after a replayed target step: the drafter's graph catches up on every fed position (each
        sequence's committed tokens are the tokens after its verified ones) and drafts from its last verified
        one; a sequence that stops gets none."""
        k, per_seq = self.drafter.k, 1 + self.drafter.k
        next_ids, last, starts = [], [], []
        for tokens, seq, start in zip(result.token_ids, batch.seqs, batch.starts):
            goes_on = bool(tokens) and seq.until_stop(tokens)[1] is None
            next_ids.append((tokens + [0] * per_seq)[:per_seq])
            last.append(max(len(tokens) - 1, 0))
            starts.append(start + len(tokens) if goes_on else None)
        phase = self.stats.phases["draft"]
        with phase.measure():
            proposed = self.graphs.draft(next_ids, last, starts, batch.locations, phase.collectives)
        phase.forwards += k
        phase.replays += 1
        phase.tokens_fed += len(batch.seqs) * (per_seq + k - 1)
        return [new if start is not None else [] for new, start in zip(proposed, starts)]


def mask_by_grammars(committing: list[Sequence], logits: torch.Tensor) -> list[int]:
    """logits `[R, V]`, 1 + len(drafts) rows per committing sequence (see `forward`) -> in place, the tokens each
    sequence's grammar does not allow at each row (row j: after its first j drafts, `grammar.fill_bitmask`) at
    the dtype's lowest finite value (not -inf: the non-finite check that follows is for the model's NaN / inf).
    Rows of sequences without a grammar are untouched. -> per committing sequence, the most tokens it can
    commit (fewer than 1 + its drafts when its grammar ends at one of them)."""
    masks = fill_bitmask(
        [s.grammar for s in committing], logits.shape[-1], [s.drafts for s in committing]
    )
    if masks is None:
        return [1 + len(s.drafts) for s in committing]
    apply_bitmask(logits, masks.bitmask, masks.rows)
    logits[masks.rows] = logits[masks.rows].clamp(min=torch.finfo(logits.dtype).min)
    return masks.most_tokens
