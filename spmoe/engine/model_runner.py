"""One step on the model: `run(batch) -> StepResult`.

1. One target forward over every scheduled sequence's tokens, laid end to end: run eagerly or, for a plain
   decode step, replayed from a CUDA graph (`cuda_graphs.py`); the logits of the rows the step commits from.
2. The choice: without speculation a sequence that samples takes its own sampler's token from its last row;
   when speculating, every sequence that samples keeps the drafts the target accepts and the target's next
   draw, by the lossless rule of `rejection.py` (greedy and sampled requests in one batch, each with its own
   settings and seed); the tokens are cut at its first eos id or its token limit. A row that is not finite
   gives no token. A sequence with a grammar (structured output, `grammar.py`; not with speculation) first
   has the tokens its grammar does not allow next masked out of its row, for the whole batch at once.
3. When speculating, the MTP drafter catches up on the fed positions and proposes each sequence's next
   drafts (`speculative.py`). Under DP every rank runs the draft step, even an empty one.

It reads the sequences and changes none of them: `Scheduler.update` commits what it returns.
"""

from itertools import accumulate

import torch

from spmoe.distributed import CommStats
from spmoe.engine.cuda_graphs import DecodeGraphs, graph_sizes
from spmoe.engine.grammar import apply_bitmask, fill_bitmask
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import PagedKVCache
from spmoe.engine.rejection import accept_drafts, race
from spmoe.engine.sampling import SamplingParams, exponential_noise, greedy, sampling_probs, seed_keys
from spmoe.engine.sequence import ScheduledBatch, Sequence, StepResult
from spmoe.engine.speculative import MtpDrafter
from spmoe.engine.stats import StepStats
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        max_num_seqs: int,
        stats: StepStats,
        num_speculative_tokens: int = 0,
        cuda_graphs: bool = False,
        keep_in_step: bool = False,
        max_model_len: int | None = None,
        log=None,
    ):
        """`stats`: where the forwards are counted; `keep_in_step`: run the draft step even with nothing to
        draft (under DP, where every rank runs every step); `max_model_len`: the most positions a sequence
        takes (the width of the graphs' block tables); `log(line)`: progress while capturing graphs."""
        self.model, self.cache, self.stats, self.keep_in_step = model, cache, stats, keep_in_step
        on_capture = None
        if log is not None:
            sizes = graph_sizes(max_num_seqs)
            on_capture = lambda size: log(  # noqa: E731
                f"warming up: capturing the decode step's CUDA graph for batch {size} "
                f"({len(sizes) - sorted(sizes).index(size)}/{len(sizes)})"
            )
        self.graphs = DecodeGraphs(model, cache, max_num_seqs, max_model_len, on_capture) if cuda_graphs else None
        self.drafter = MtpDrafter(model, cache, num_speculative_tokens) if num_speculative_tokens else None

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> StepResult:
        phase = self.stats.target_phase(batch)
        with phase.measure():
            logits, hidden = self.forward(batch, phase.collectives)
            result = self.choose(batch, logits)
        phase.forwards += 1
        phase.tokens_fed += sum(batch.num_tokens)
        phase.tokens_committed += sum(map(len, result.token_ids))
        if self.drafter is not None:
            result.drafts = self.draft(batch, result, hidden)
        return result

    def forward(self, batch: ScheduledBatch, collectives: CommStats) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target forward -> (logits `[R, V]` float32 of the R rows the step commits from: the last
        1 + drafts rows of each sequence that samples, the FULL post-norm hidden `[N, H]` of all N fed tokens,
        or None when a CUDA graph ran). No sequences: an empty forward (a DP rank that must keep in step).
        Replayed collectives are added to `collectives`."""
        tokens = batch.tokens()
        if self.graphs is not None and batch.decode:
            return self.graphs.step([t[0] for t in tokens], batch.locations, batch.starts, collectives), None
        lens = [len(t) for t in tokens]
        view = self.cache.view(batch.locations, batch.starts, lens)
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=view.positions.device)
        hidden = self.model.forward_hidden(ids, view.positions, lens, view)  # FULL [N, H]
        logit_rows = [1 + len(s.drafts) if last else 0 for s, last in zip(batch.seqs, batch.samples)]
        rows = [r for end, m in zip(accumulate(lens), logit_rows) for r in range(end - m, end)]
        return self.model.compute_logits(hidden, torch.tensor(rows, dtype=torch.long, device=hidden.device)), hidden

    def choose(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepResult:
        """logits `[R, V]` (see `forward`) -> each sequence's committed tokens, accepted drafts, finite flag."""
        committing = [s for s, last in zip(batch.seqs, batch.samples) if last]
        mask_by_grammars(committing, logits)
        choose = self._verify if self.drafter is not None else self._sample
        chosen = iter(zip(*choose(committing, logits))) if committing else iter(())
        result = StepResult([], [], [], logit_rows=[])
        row = 0
        for seq, last in zip(batch.seqs, batch.samples):
            tokens, accepted, finite, recorded = [], 0, True, None
            if last:
                accepted, candidates, finite = next(chosen)
                if finite:
                    tokens, _ = seq.until_stop(candidates)
                    if seq.record_logits:
                        recorded = [logits[j].cpu() for j in range(row, row + len(tokens))]
                row += 1 + len(seq.drafts)
            result.token_ids.append(tokens)
            result.accepted.append(accepted)
            result.finite.append(finite)
            result.logit_rows.append(recorded)
        return result

    @staticmethod
    def _sample(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[list[int]], list[bool]]:
        """No speculation: one logits row per sequence `[S, V]` -> (0 accepted drafts, its token, whether its
        row is finite) per sequence: every greedy choice in one host transfer, a sampled row by its sampler."""
        greedy_rows = greedy(logits) if any(s.sampler.params.greedy for s in seqs) else None
        candidates, finite = [], []
        for j, seq in enumerate(seqs):
            ids, flags = (
                (g[j : j + 1] for g in greedy_rows) if seq.sampler.params.greedy else seq.sampler(logits[j : j + 1])
            )
            candidates.append(ids)
            finite.append(flags[0])
        return [0] * len(seqs), candidates, finite

    @staticmethod
    def _verify(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[list[int]], list[bool]]:
        """Speculation: sequence i has 1 + d_i logits rows (its last token, then its d_i drafts), laid end to
        end in `logits` `[R, V]` -> per sequence (drafts accepted, the tokens it would commit, whether every
        row they come from is finite), by the lossless rule of `rejection.py`, in one pass over the batch and
        one host transfer.

        The target's draw at row j of sequence i is the token it would choose there without drafts: the
        argmax for a greedy request, else a race over its processed distribution (`_processed_probs`) with
        the noise of (its seed, output index len(output) + j). The logprobs of a committed token would be
        read from the same rows' processed distribution (`StepResult.logprobs`, not filled until the sampler
        computes logprobs)."""
        device, vocab = logits.device, logits.shape[1]
        counts = [1 + len(s.drafts) for s in seqs]
        finite = torch.isfinite(logits).all(-1)
        choices = logits.argmax(-1)  # every greedy row's token, bit for bit
        sampled = [(s.request.sampling, len(s.output) + j) for s, n in zip(seqs, counts) for j in range(n)]
        rows = [r for r, (params, _) in enumerate(sampled) if not params.greedy]
        if rows:
            params = [sampled[r][0] for r in rows]
            picked = torch.tensor(rows, device=device)
            clean = torch.where(finite[picked, None], logits[picked], 0.0)  # a row that is not finite is not used
            keys = torch.tensor([seed_keys(p.seed) for p in params], dtype=torch.int64, device=device)
            index = torch.tensor([sampled[r][1] for r in rows], dtype=torch.int64, device=device)
            noise = exponential_noise(keys, index, vocab)
            choices[picked] = race(ModelRunner._processed_probs(clean, params), noise)
        # pad to [S, K + 1]: sequence i's rows from its first, repeating its last past 1 + d_i
        width = max(counts)
        starts = torch.tensor([0, *accumulate(counts)][:-1], device=device)
        position = torch.arange(width, device=device)
        at = starts[:, None] + torch.minimum(position, torch.tensor(counts, device=device)[:, None] - 1)
        draft_ids = [s.drafts + [-1] * (width - n) for s, n in zip(seqs, counts)]  # [S, K], -1: padding
        draft_ids = torch.tensor(draft_ids, dtype=torch.int64, device=device)
        num_drafts = torch.tensor([n - 1 for n in counts], device=device)
        accepted = accept_drafts(draft_ids, num_drafts, choices[at])
        table = torch.cat([accepted[:, None], choices[at], finite[at].long()], dim=1).tolist()  # one transfer
        out = [(line[0], line[1 : 2 + line[0]], all(line[1 + width : 2 + width + line[0]])) for line in table]
        return [a for a, _, _ in out], [c for _, c, _ in out], [bool(f) for _, _, f in out]

    @staticmethod
    def _processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each sampled row draws from, processed as its request asked: logits `[m, V]`
        (finite), `params[j]` row j's settings -> `[m, V]` float32, the same computation the sampler draws
        from without speculation."""
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        return sampling_probs(logits, temperature, top_p)

    def draft(self, batch: ScheduledBatch, result: StepResult, hidden: torch.Tensor) -> list[list[int]]:
        """The MTP layer catches up on every position the target fed and kept: a prompt chunk before the last
        only fills its cache rows; a sequence that committed tokens and goes on gets its next drafts.
        -> the drafts per scheduled sequence ([] for the others)."""
        to_draft, fed = [], 0  # (its index, first fed position, the token after each, the target's hidden there)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            tokens = result.token_ids[i]
            if not batch.samples[i]:
                to_draft.append((i, seq.cached, seq.pending[1 : n + 1], hidden[fed : fed + n]))
            elif tokens and seq.until_stop(tokens)[1] is None:
                verified = n - (len(seq.drafts) - result.accepted[i])
                to_draft.append((i, seq.cached, seq.pending[1:verified] + [tokens[-1]], hidden[fed : fed + verified]))
            fed += n
        drafts = [[] for _ in batch.seqs]
        if not to_draft and not self.keep_in_step:
            return drafts
        phase, k = self.stats.phases["draft"], self.drafter.k
        with phase.measure():
            hidden_fed = [h for *_, h in to_draft] or [
                torch.zeros(0, self.model.cfg.hidden_size, dtype=self.cache.dtype, device=self.cache.device)
            ]
            proposed = self.drafter.propose(
                [batch.locations[i] for i, *_ in to_draft],
                [start for _, start, *_ in to_draft],
                [ids for _, _, ids, _ in to_draft],
                torch.cat(hidden_fed),
            )
        for (i, *_), new in zip(to_draft, proposed):
            if batch.samples[i]:
                drafts[i] = new
        phase.forwards += k
        phase.tokens_fed += sum(len(ids) for _, _, ids, _ in to_draft) + (k - 1) * len(to_draft)
        return drafts


def mask_by_grammars(committing: list[Sequence], logits: torch.Tensor) -> None:
    """logits `[m, V]`, one row per committing sequence (a grammar comes without drafts) -> in place, the tokens
    each sequence's grammar does not allow next at the dtype's lowest finite value (not -inf: the non-finite
    check that follows is for the model's NaN / inf). Rows of sequences without a grammar are untouched."""
    masks = fill_bitmask([s.grammar for s in committing], logits.shape[-1])
    if masks is None:
        return
    bitmask, rows = masks
    apply_bitmask(logits, bitmask, rows)
    logits[rows] = logits[rows].clamp(min=torch.finfo(logits.dtype).min)
