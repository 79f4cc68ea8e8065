"""The target model's side of a step: `forward(batch)` (one forward over every fed part's tokens,
laid end to end, eager or replayed from a CUDA graph: `graphs.py`) and `choose(batch, forward)`
(every row a part draws from through the batched `Sampler` at once, after its grammar's mask; the
lossless acceptance of drafts, `rejection.py`; a fork draws from a copy of its source's last row;
prompt logprobs when asked). It reads the sequences and changes none of them: each commits its
`PartResult` (`Sequence.commit`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.runner.graphs import CapturedStep, StepGraphs, StepNeeds, StepShape
from spmoe.engine.sampling.grammar import apply_bitmask, fill_bitmask
from spmoe.engine.sampling.rejection import accept_drafts
from spmoe.engine.sampling.sampler import Sampler, prompt_logprobs
from spmoe.engine.sequence import Batch, Part, PartResult, Role
from spmoe.engine.stats import Phase, StepStats
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

PROMPT_LOGPROB_ROWS = 256  # prompt rows turned into logits at once: bounds the `[rows, V]` buffer


@dataclass(kw_only=True)
class Forward:
    """What the target forward gave: `logits` `[R, V]` float32 of the R rows the step draws from
    (the last 1 + drafts rows of each fed part that draws), `hidden` the FULL post-norm hidden
    `[N, H]` of the N fed tokens (a replayed graph's has pad rows after them), `replayed` the CUDA
    graph that ran or None, `phase` the statistics it was counted in, `draft_graph` whether the
    drafter's graph follows (as every DP rank agreed, `StepShape`)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    replayed: CapturedStep | None
    phase: Phase
    draft_graph: bool = False


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        max_num_seqs: int,
        stats: StepStats,
        sampler: Sampler,
        agree: Callable[[StepNeeds], StepNeeds],
        num_speculative_tokens: int = 0,
        cuda_graphs: bool = False,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 0,
        log=None,
    ):
        """`stats`: where the forwards are counted; `sampler`: the sequences' sampling rows (the
        scheduler takes and frees them); `agree`: this rank's graph needs of a step -> every DP
        rank's; `max_model_len`: the most positions a sequence takes (the width of the graphs' block
        tables); `max_num_batched_tokens`: the step's token budget (the largest mixed-step graph);
        `log(line)`: progress while capturing graphs."""
        self.model, self.cache, self.stats, self.sampler = model, cache, stats, sampler
        on_capture = None
        if log is not None:

            def on_capture(kind: str, size: int, index: int, count: int) -> None:
                step = (
                    f"the decode step for batch {size}"
                    if kind == "decode"
                    else f"a step of up to {size} tokens"
                )
                log(f"warming up: capturing the CUDA graph of {step} ({index}/{count})")

        self.agree = agree
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

    @torch.no_grad()
    def forward(self, batch: Batch) -> Forward:
        """The target forward over every fed part (see `Forward`). No parts: an empty forward (a DP
        rank that must keep in step)."""
        phase = self.stats.target_phase(batch)
        with phase.measure():
            shape = self.shape(batch)
            logits, hidden, replayed = self._forward(batch.fed, shape, phase)
        phase.replays += replayed is not None
        phase.forwards += 1
        phase.tokens_fed += sum(len(part.tokens) for part in batch.fed)
        draft_graph = shape is not None and shape.draft_graph
        return Forward(
            logits=logits, hidden=hidden, replayed=replayed, phase=phase, draft_graph=draft_graph
        )

    def shape(self, batch: Batch) -> StepShape | None:
        """The graph every DP rank replays this step, as they agree on it before any replay (None:
        no graphs)."""
        if self.graphs is None:
            return None
        lens = [len(part.tokens) for part in batch.fed]
        grammars = any(part.seq.grammar is not None for part in batch.fed)
        return self.graphs.shape(self.agree(self.graphs.needs(lens, batch.decode, grammars)))

    def _forward(
        self, fed: list[Part], shape: StepShape | None, phase: Phase
    ) -> tuple[torch.Tensor, torch.Tensor, CapturedStep | None]:
        tokens, graphs = [part.tokens for part in fed], self.graphs
        locations, starts = [part.location for part in fed], [part.start for part in fed]
        lens = [len(t) for t in tokens]
        kind = shape.kind if shape is not None else "eager"
        if kind == "decode":
            logits = graphs.step(tokens, locations, starts, phase.collectives, shape.size)
            return logits, graphs.replayed.hidden, graphs.replayed
        replayed = None
        if kind == "mixed":
            hidden = graphs.mixed_step(tokens, locations, starts, phase.collectives, shape.size)
            replayed = graphs.replayed
        else:  # the largest DP batch: as agreed, or (no graphs) asked in the forward
            max_tokens = shape.size if shape is not None else None
            view = self.cache.view(locations, starts, lens)
            ids = torch.tensor(
                [t for seq in tokens for t in seq], dtype=torch.long, device=view.positions.device
            )
            hidden = self.model.forward_hidden(ids, view.positions, lens, view, max_tokens)
        drawn_rows = [1 + len(part.drafts) if part.draws else 0 for part in fed]
        rows = [r for end, m in zip(accumulate(lens), drawn_rows) for r in range(end - m, end)]
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden, index), hidden, replayed

    @torch.no_grad()
    def choose(self, batch: Batch, forward: Forward) -> list[PartResult]:
        """-> each part's result. Every row goes through the sampler in one call: row j of a part
        that fed d drafts chooses its sequence's (len(output) + j)-th token, after the first j
        drafts; a fork chooses its first token from a copy of its source's row (a grammar masks
        the copy only)."""
        with forward.phase.measure():
            return self._choose(batch, forward)

    def _choose(self, batch: Batch, forward: Forward) -> list[PartResult]:
        logits, rows, generated, preceding, spans = forward.logits, [], [], [], {}
        fork_rows = []
        for part in batch.parts:
            # its source ends its prompt: its one row is the last token's
            if part.role is Role.FORK:
                fork_rows.append(spans[part.source].start)
                drafts = []
            else:
                drafts = part.drafts if part.draws else None
            first = len(rows)
            for j in range(1 + len(drafts) if drafts is not None else 0):
                rows.append(part.seq.sample_row)
                generated.append(len(part.seq.output) + j)
                preceding.append(drafts[:j])
            spans[part] = slice(first, len(rows))
        if fork_rows:
            logits = torch.cat([logits, logits[fork_rows]])
        drawing = [part for part in batch.parts if part.draws]
        most_tokens = dict(zip(drawing, mask_by_grammars(drawing, logits)))
        chosen = self.sampler.sample(logits, rows, generated, preceding if any(preceding) else None)
        accepted = self._accepted(drawing, chosen.token_ids, spans) if any(preceding) else {}
        results = []
        for part in batch.parts:
            result = PartResult(part=part)
            if part.draws:
                span = spans[part]
                count = min(accepted.get(part, 0) + 1, most_tokens[part])
                result.tokens = chosen.token_ids[span][:count]
                # its grammar ended at a draft: none is kept after it
                result.accepted = min(accepted.get(part, 0), count)
                result.finite = all(chosen.finite[span][:count])
                if result.finite and part.seq.record_logits:
                    result.logit_rows = [
                        logits[j].cpu() for j in range(span.start, span.start + count)
                    ]
                if result.finite and part.seq.request.sampling.logprobs is not None:
                    pairs = zip(chosen.logprobs[span], chosen.top_logprobs[span])
                    result.logprobs = list(pairs)[:count]
            if part.role is not Role.FORK and part.seq.wants_prompt_logprobs:
                result.prompt_logprobs = self.prompt_logprobs(batch, part, forward.hidden)
            results.append(result)
        return results

    @staticmethod
    def _accepted(drawing: list[Part], choices: list[int], spans: dict) -> dict[Part, int]:
        """The step's choices (row j of a part: the target's draw after its first j drafts) -> per
        part that fed drafts the number it keeps (`rejection.accept_drafts`, for the
        batch at once)."""
        verifying = [part for part in drawing if part.drafts]
        width = max(len(part.drafts) for part in verifying)
        draft_ids = [p.drafts + [-1] * (width - len(p.drafts)) for p in verifying]  # -1: padding
        draws = [choices[spans[p]] + [-1] * (width + 1 - len(choices[spans[p]])) for p in verifying]
        accepted = accept_drafts(
            torch.tensor(draft_ids, dtype=torch.int64),
            torch.tensor([len(p.drafts) for p in verifying]),
            torch.tensor(draws, dtype=torch.int64),
        )
        return dict(zip(verifying, accepted.tolist()))

    def prompt_logprobs(self, batch: Batch, part: Part, hidden: torch.Tensor) -> list | None:
        """The hidden `[N, H]` of every fed token -> the logprobs of the prompt tokens `part` fed
        (see `PartResult.prompt_logprobs`), or None when it fed none."""
        prompt, start, n = part.seq.request.prompt, part.start, len(part.tokens)
        if start >= len(prompt):
            return None
        fed = 0
        for other in batch.fed:
            if other is part:
                break
            fed += len(other.tokens)
        count = min(n, len(prompt) - start)  # prompt tokens fed this step
        got = [None] if start == 0 else []
        # row i (position start + i) predicts prompt[start + i + 1]; the prompt's last row predicts
        # an output token: it is no prompt token's
        predicting = min(count, len(prompt) - 1 - start)
        for first in range(0, predicting, PROMPT_LOGPROB_ROWS):
            size = min(PROMPT_LOGPROB_ROWS, predicting - first)
            index = torch.arange(fed + first, fed + first + size, device=hidden.device)
            logits = self.model.compute_logits(hidden, index)
            following = torch.tensor(
                prompt[start + first + 1 : start + first + 1 + size], device=hidden.device
            )
            got += prompt_logprobs(logits, following, part.seq.request.sampling.prompt_logprobs)
        return got


def mask_by_grammars(drawing: list[Part], logits: torch.Tensor) -> list[int]:
    """logits `[R, V]`, 1 + len(drafts) rows per drawing part -> in place, the tokens each
    sequence's grammar does not allow at each row (row j: after its first j drafts,
    `grammar.fill_bitmask`) at the dtype's lowest finite value (not -inf: the non-finite check is
    for the model's NaN / inf). Rows without a grammar are untouched. -> per part the most rows it
    can draw from (fewer than 1 + its drafts when its grammar ends at one of them: the rows after
    are not masked)."""
    drafts = [part.drafts if part.role is not Role.FORK else [] for part in drawing]
    masks = fill_bitmask([p.seq.grammar for p in drawing], logits.shape[-1], drafts)
    if masks is None:
        return [1 + len(d) for d in drafts]
    apply_bitmask(logits, masks.bitmask, masks.rows)
    logits[masks.rows] = logits[masks.rows].clamp(min=torch.finfo(logits.dtype).min)
    return masks.most_tokens
