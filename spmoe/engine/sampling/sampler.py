"""Choosing the next token for a whole batch at once: each row's logits processed by its request's
settings, then greedy rows take the argmax and sampled rows one batched seeded draw;
logprobs on request.

Per-row state lives on the device, in `Sampler`: each sequence holds a row (`add` / `release`) with
its parameters as tensors and the count of every token it generated (`commit` adds the tokens a step
committed by a scatter, so the penalties never rebuild anything from Python lists).
`sample(logits, rows, generated)` processes and chooses for every row of a step in one pass: no
Python loop over rows or the vocabulary, and one host transfer (the chosen ids and finite flags,
with the logprobs when a row asked for them).

**Reproducible draws without per-row generators.** A sampled row draws its token by an exponential
race: token = argmax_i p_i / E_i with E_i ~ Exp(1) independent, which picks token i with probability
exactly p_i. The E_i are not read from a stateful generator but computed from (the request's seed,
the index of the token being chosen in its output, i) by an integer hash (`exponential_noise`). So a
request's tokens depend on its seed and logits only: not on the other rows of the batch, not on how
many steps it waited or was preempted, and every TP rank, holding the same logits, draws the same
token without communicating. The same noise at the same index also serves a verification step that
chooses several tokens of one sequence at once. On CUDA one Triton kernel hashes the noise in
registers and races in the same pass (`draw_tokens`), the same draw without the `[rows, V]` noise.

**Greedy is exact:** a greedy row (temperature 0) takes the argmax of its logits after the
processors that change which token is best (grammar mask, min_tokens, logit_bias, penalties); with
none of them set it is `logits.argmax(-1)` of the model's logits, bit for bit.

**Logprobs** are those of the distribution the token is drawn from: log_softmax of the logits after
every processor (grammar mask, min_tokens, logit_bias, penalties, temperature, min_p, top_k, top_p);
a greedy row's are computed the same way with temperature 1. Tokens the processors excluded have
logprob -inf. A request with default settings (temperature 1, nothing else) thus gets the model's
own log-probabilities. Prompt logprobs (`prompt_logprobs`) are the model's raw log-probabilities of
the prompt's tokens: no processor applies to tokens that were given rather than generated.

A logits row with a NaN or an infinity has no next token (torch's argmax would answer the first
NaN's index). Every choice comes with a per-row finite flag, read back in the same host transfer as
the token ids; a row whose processors exclude every token (a grammar that allows nothing) is
flagged the same way.
"""

from dataclasses import dataclass

import torch

from spmoe.engine.request import SamplingParams
from spmoe.engine.sampling.noise import draw_tokens, seed_keys
from spmoe.engine.sampling.processors import (
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    scale_by_temperature,
    suppress_tokens,
)

# -- the batched sampler -------------------------------------------------------------------------


@dataclass
class SampledTokens:
    """What `Sampler.sample` chose for each of its m rows, on the host. `logprobs[r]` (the chosen
    token's) and `top_logprobs[r]` (the row's `params.logprobs` most likely (token id, logprob),
    most likely first) are None for a row that did not ask. `token_ids` of a row that is not finite
    mean nothing."""

    token_ids: list[int]
    finite: list[bool]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """The sampling state of up to `max_rows` sequences on `device`, and the batched choice of
    their tokens."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str = "cpu"):
        if max_rows < 1 or vocab_size < 1:
            raise ValueError(
                f"the sampler needs max_rows >= 1 and vocab_size >= 1, got {max_rows}, {vocab_size}"
            )
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, torch.device(device)
        # host copy: decides which processors run
        self.params: list[SamplingParams | None] = [None] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))

        def column(value: float, dtype=torch.float32) -> torch.Tensor:
            return torch.full((max_rows,), value, dtype=dtype, device=self.device)

        self.temperature, self.top_p, self.min_p = column(0.0), column(1.0), column(0.0)
        self.top_k, self.min_tokens = column(0, torch.int64), column(0, torch.int64)
        self.presence, self.frequency, self.repetition = column(0.0), column(0.0), column(1.0)
        self.keys = torch.zeros(max_rows, 2, dtype=torch.int64, device=self.device)
        # sparse per-row id lists, widened when a request needs more room: -1 pads
        self.bias_ids = torch.full((max_rows, 0), -1, dtype=torch.int64, device=self.device)
        self.bias_values = torch.zeros(max_rows, 0, device=self.device)
        self.stop_ids = torch.full((max_rows, 0), -1, dtype=torch.int64, device=self.device)
        # `[max_rows, V]`, made when the first request with a penalty arrives (most servers never
        # need them)
        self.output_counts: torch.Tensor | None = None  # int32: times each token was generated
        # bool: the token is in the prompt (repetition penalty)
        self.prompt_mask: torch.Tensor | None = None

    # -- rows -------------------------------------------------------------------------------------

    def add(
        self,
        params: SamplingParams,
        prompt: list[int],
        stop_ids: tuple[int, ...] = (),
        output: list[int] = (),
    ) -> int:
        """Take a row for a sequence with these settings. `stop_ids`: the ids `min_tokens` holds
        back (its eos and stop token ids); `output`: the tokens it already generated (a preempted
        sequence coming back).
        -> the row."""
        if not self._free:
            raise RuntimeError(f"the sampler's {self.max_rows} rows are all taken")
        row = self._free.pop()
        self.params[row] = params
        for column, value in (
            (self.temperature, 0.0 if params.greedy else params.temperature),
            (self.top_p, params.top_p),
            (self.min_p, params.min_p),
            (
                self.top_k,
                min(params.top_k, self.vocab_size),
            ),  # more is all of them; any int fits int64 so
            (self.min_tokens, min(params.min_tokens, 2**62)),  # no client's value fails the write
            (self.presence, params.presence_penalty),
            (self.frequency, params.frequency_penalty),
            (self.repetition, params.repetition_penalty),
        ):
            column[row] = value
        self.keys[row] = torch.tensor(seed_keys(params.seed))
        self.bias_ids, self.bias_values = (
            self._widen(self.bias_ids, len(params.logit_bias)),
            self._widen(self.bias_values, len(params.logit_bias), 0.0),
        )
        self._set_list(self.bias_ids, row, [token for token, _ in params.logit_bias])
        self.bias_values[row] = 0.0
        self.bias_values[row, : len(params.logit_bias)] = torch.tensor(
            [b for _, b in params.logit_bias]
        )
        self.stop_ids = self._widen(self.stop_ids, len(stop_ids) if params.min_tokens else 0)
        self._set_list(self.stop_ids, row, list(stop_ids) if params.min_tokens else [])
        if params.penalised and self.output_counts is None:
            self.output_counts = torch.zeros(
                self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device
            )
            self.prompt_mask = torch.zeros(
                self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device
            )
        if self.output_counts is not None:
            self.output_counts[row] = 0
            self.prompt_mask[row] = False
            if params.penalised:
                self.prompt_mask[row, torch.tensor(prompt, dtype=torch.int64)] = True
                if output:
                    self.commit([row] * len(output), list(output))
        return row

    def release(self, row: int) -> None:
        if self.params[row] is None:
            raise ValueError(f"sampler row {row} is not taken")
        self.params[row] = None
        self._free.append(row)

    def commit(self, rows: list[int], tokens: list[int]) -> None:
        """Sequences committed tokens: `tokens[j]` to row `rows[j]` (a row may repeat: accepted
        drafts). Counts them for the penalties (a scatter on the device; nothing to do while no row
        has a penalty)."""
        if self.output_counts is None or not rows:
            return
        index = torch.tensor([rows, tokens], dtype=torch.int64).to(self.device, non_blocking=True)
        ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    # -- choosing ---------------------------------------------------------------------------------

    def process(
        self,
        logits: torch.Tensor,
        rows: list[int],
        generated: list[int],
        preceding: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits `[m, V]`: row j chooses a token for the sequence in sampler row `rows[j]`, which
        had generated `generated[j]` tokens before it, the last `len(preceding[j])` of them (drafts
        being verified) not yet committed. (A grammar's mask is applied to `logits` before:
        `model_runner.mask_by_grammars`.)

        -> (the processed logits `[m, V]` float32 before temperature: what greedy rows take the
        argmax of, the processed logits after temperature, min_p, top_k and top_p: what sampled rows
        draw from and logprobs are computed from, and `finite` `[m]` bool). Rows that are not finite
        are processed as zeros. The second tensor is the first one when no row
        changes it further."""
        params = self._params_of(rows)
        index = torch.tensor([rows, generated], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        row, done = index[0], index[1]
        raw_finite = torch.isfinite(logits).all(-1)
        # a copy: the caller's stays
        out = torch.where(raw_finite[:, None], logits.to(torch.float32), 0.0)
        if any(p.min_tokens > g for p, g in zip(params, generated)):
            suppress_tokens(out, self.stop_ids[row], done < self.min_tokens[row])
        if any(p.logit_bias for p in params):
            add_logit_bias(out, self.bias_ids[row], self.bias_values[row])
        if any(p.penalised for p in params):
            counts = self.output_counts[row]
            if preceding is not None and any(preceding):
                width = max(len(d) for d in preceding)
                drafts = torch.tensor(
                    [d + [-1] * (width - len(d)) for d in preceding], dtype=torch.int64
                )
                drafts = drafts.to(self.device, non_blocking=True)
                counts = counts.scatter_add(1, drafts.clamp(min=0), (drafts >= 0).to(counts.dtype))
            repeats = any(p.repetition_penalty != 1 for p in params)
            prompt_mask = self.prompt_mask[row] if repeats else None
            apply_penalties(
                out,
                counts,
                prompt_mask,
                self.presence[row],
                self.frequency[row],
                self.repetition[row],
            )
        finite = raw_finite & (out > float("-inf")).any(-1)
        if all(p.greedy or p.temperature == 1 for p in params) and not any(
            p.min_p or p.truncated for p in params
        ):
            return out, out, finite
        drawn = scale_by_temperature(out.clone(), self.temperature[row])
        if any(p.min_p for p in params):
            apply_min_p(drawn, self.min_p[row])
        if any(p.truncated for p in params):
            apply_top_k_top_p(drawn, self.top_k[row], self.top_p[row])
        return out, drawn, finite

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[int],
        generated: list[int],
        preceding: list[list[int]] | None = None,
    ) -> SampledTokens:
        """Choose a token for each row of `logits` `[m, V]` (the arguments as for `process`). -> the
        choices, read back to the host in one transfer."""
        params = self._params_of(rows)
        if len(rows) != logits.shape[0] or len(generated) != len(rows):
            raise ValueError(
                f"{logits.shape[0]} logits rows need as many sampler rows and counts, got "
                f"{len(rows)} and {len(generated)}"
            )
        plain = all(p.greedy and p.logprobs is None for p in params)
        if plain and not any(
            p.min_tokens > g or p.logit_bias or p.penalised for p, g in zip(params, generated)
        ):
            # what greedy always was
            return _without_logprobs(logits.argmax(-1), torch.isfinite(logits).all(-1))
        best, drawn, finite = self.process(logits, rows, generated, preceding)
        ids = best.argmax(-1)
        sampled = [j for j, p in enumerate(params) if not p.greedy]
        # the sampled rows only: the reference's noise, `[rows, V]`, is the step's largest temporary
        if sampled:
            # one transfer; each list padded to an even length, so that every one starts 16-byte
            # aligned whatever the count (Triton compiles a kernel per alignment of its pointers: no
            # new compile after warm-up)
            pad = [0] * (len(sampled) % 2)
            picked = [
                sampled + pad,
                [generated[j] for j in sampled] + pad,
                [rows[j] for j in sampled] + pad,
            ]
            picked = torch.tensor(picked, dtype=torch.int64).to(self.device, non_blocking=True)
            at, index, row = picked[:, : len(sampled)]
            ids = ids.index_copy(0, at, draw_tokens(drawn, at, self.keys[row], index))
        asked = [j for j, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return _without_logprobs(ids, finite)
        m, a, width = len(params), len(asked), max(params[j].logprobs for j in asked)
        source, chosen_ids = drawn, ids
        # the rows that asked only: log_softmax and topk are per row, the others' would be dropped
        if a < m:
            where = torch.tensor(asked, dtype=torch.int64).to(self.device, non_blocking=True)
            source, chosen_ids = drawn[where], ids[where]
        logprobs = torch.log_softmax(source, dim=-1)  # [a, V]
        parts = [
            ids.double(),
            finite.double(),
            logprobs.gather(1, chosen_ids[:, None])[:, 0].double(),
        ]
        if width:
            top = logprobs.topk(width, dim=-1)  # [a, width]
            parts += [top.indices.flatten().double(), top.values.flatten().double()]
        # the one host transfer: ids, flags, then the asking rows' logprobs
        flat = torch.cat(parts).tolist()
        chosen, tops = [None] * m, [None] * m
        top_ids, top_values = flat[2 * m + a : 2 * m + a + a * width], flat[2 * m + a + a * width :]
        for n, j in enumerate(asked):
            k, first = params[j].logprobs, n * width
            chosen[j] = flat[2 * m + n]
            tops[j] = [
                (int(t), v)
                for t, v in zip(top_ids[first : first + k], top_values[first : first + k])
            ]
        return SampledTokens(
            [int(t) for t in flat[:m]], [bool(f) for f in flat[m : 2 * m]], chosen, tops
        )

    # -- helpers ----------------------------------------------------------------------------------

    def _params_of(self, rows: list[int]) -> list[SamplingParams]:
        bad = [r for r in rows if not 0 <= r < self.max_rows or self.params[r] is None]
        if bad:
            raise ValueError(f"sampler rows {bad} are not taken")
        return [self.params[r] for r in rows]

    def _widen(self, table: torch.Tensor, width: int, pad: float = -1) -> torch.Tensor:
        if width <= table.shape[1]:
            return table
        extra = torch.full(
            (self.max_rows, width - table.shape[1]), pad, dtype=table.dtype, device=self.device
        )
        return torch.cat([table, extra], dim=1)

    @staticmethod
    def _set_list(table: torch.Tensor, row: int, ids: list[int]) -> None:
        table[row] = -1
        if ids:
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)


def _without_logprobs(ids: torch.Tensor, finite: torch.Tensor) -> SampledTokens:
    """Chosen ids and finite flags `[m]` -> the choices without logprobs, in one host transfer."""
    picked = torch.stack([ids, finite.long()]).tolist()
    none = [None] * len(picked[0])
    return SampledTokens(picked[0], [bool(f) for f in picked[1]], none, none)


def prompt_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, k: int
) -> list[tuple[float, list]]:
    """logits `[n, V]` at n prompt positions, next_ids `[n]` the prompt token that follows each ->
    per position (logprob of that token, its k most likely (token id, logprob)), the model's raw
    distribution, in one host transfer."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    columns = [logprobs.gather(1, next_ids[:, None]).double()]
    if k:
        top = logprobs.topk(k, dim=-1)
        columns += [top.indices.double(), top.values.double()]
    table = torch.cat(columns, dim=1).tolist()
    return [
        (line[0], [(int(t), v) for t, v in zip(line[1 : 1 + k], line[1 + k :])]) for line in table
    ]
