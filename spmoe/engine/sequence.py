"""A request inside the engine (`Sequence`) and the two records a step passes between the scheduler and the
model runner: `ScheduledBatch` (what runs) and `StepResult` (what the forward chose).

One step is `Scheduler.schedule() -> ScheduledBatch`, `ModelRunner.run(batch) -> StepResult`,
`Scheduler.update(batch, result) -> list[RequestOutput]`. The runner only reads sequences; `update` is the one
place that changes them after a forward.
"""

from dataclasses import dataclass, field

import torch

from spmoe.engine.request import Request, TokenLogprobs
from spmoe.engine.sampling.grammar import SequenceGrammar


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: its cache room, what the next forwards feed, what it generated. Compared by
    identity: each is one request's life in the engine (and the scheduler's list lookups stay cheap: a
    field-by-field comparison cost 32k dataclass comparisons a step at 256 sequences)."""

    request: Request
    record_logits: bool = False  # keep the logits row `[V]` behind every generated token
    grammar: SequenceGrammar | None = (
        None  # structured output: where the sequence is in its grammar
    )
    cache_id: int = -1  # its slot (slot cache) or block-table id (paged cache); -1: no room
    sample_row: int = -1  # its row of the engine's Sampler while it runs; -1: none
    cached: int = 0  # tokens of this sequence in the target's KV cache
    pending: list[int] = field(default_factory=list)  # what the next target forwards feed
    drafts: list[int] = field(default_factory=list)  # the tail of `pending` that MTP drafted
    prefilling: bool = (
        False  # `pending` is (the rest of) a prompt, fed in chunks; it samples after the last
    )
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(
        default_factory=list
    )  # `[V]` per committed token, when recorded
    finish_reason: str | None = None
    error: str | None = None  # why it finished with finish_reason "error"
    preemptions: int = 0
    # the prefix cache's chained hashes of its first blocks, as far as computed (its tokens are only appended
    # to, so they stay valid for its life: each block is hashed once, however often it is looked up)
    block_hashes: list[bytes] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(
        default_factory=list
    )  # gathered chunk by chunk
    prompt_logprobs_sent: bool = (
        False  # they went out with its first tokens: a recompute needs none
    )

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt rows it feeds now need their logits (asked for, and not yet sent)."""
        return self.request.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def until_stop(self, candidates: list[int]) -> tuple[list[int], str | None]:
        """The tokens it would commit next -> those it does commit: up to and including the first eos id
        (finish reason "stop") or the token that reaches `max_new_tokens` ("length"); None: it goes on."""
        request = self.request
        for j, token in enumerate(candidates):
            if token in request.eos_token_ids:
                return candidates[: j + 1], "stop"
            if len(self.output) + j + 1 == request.max_new_tokens:
                return candidates[: j + 1], "length"
        return candidates, None


@dataclass
class ScheduledBatch:
    """The sequences one step runs, in admission order, and for each: how many tokens it feeds from the head
    of its `pending`, from which position (`starts`, its cached length), into which cache room (`locations`:
    a slot of the slot cache, a block table of the paged one), and whether it samples (it feeds all it has
    pending; a prompt chunk before the last does not). `decode`: every sequence feeds one decode token after
    its prefix (no prompt chunk), so a captured CUDA graph can run it. `step`: the step's number since the
    statistics were reset, for error messages. `admissions`: which waiting sequences joined this step and with
    how many cached tokens (`scheduler.FORKED`: as a fork). No sequences: an empty step that keeps the DP ranks
    in step.

    `forks`: sequences that feed nothing and draw their first token from the logits row of another one's last
    prompt token (the n choices of a request: the prompt is computed once), as (the fork, the index in `seqs`
    of the sequence whose prompt completes this step). Each draws with its own sampling row, seed and output
    index 0, as it would from its own forward; it holds the full blocks of that prompt from here on."""

    seqs: list[Sequence]
    num_tokens: list[int]
    starts: list[int]
    locations: list
    samples: list[bool]
    decode: bool
    step: int
    # the waiting sequences this step admitted: (request id, prompt tokens it reuses from the prefix cache), as
    # the deciding rank sends them to the others (`serving_loop`)
    admissions: list[tuple[str, int]] = field(default_factory=list)
    forks: list[tuple[Sequence, int]] = field(default_factory=list)

    def tokens(self) -> list[list[int]]:
        """What each sequence feeds this step."""
        return [seq.pending[:n] for seq, n in zip(self.seqs, self.num_tokens)]


@dataclass
class StepResult:
    """What one forward chose, per scheduled sequence (in the batch's order), then per fork (`batch.forks`'s
    order) for `token_ids`, `accepted`, `finite`, `logit_rows` and `logprobs`.

    `token_ids`: the tokens it commits (none for a prompt chunk that does not sample, or when its logits were
    not finite), already cut at its first eos id or its token limit; `accepted`: how many of its drafts the
    target accepted; `finite`: whether every logits row it commits from was finite (False: it has no next
    token and finishes with an error); `drafts`: its next MTP drafts when speculating ([] if it finishes or
    does not sample), else None; `logit_rows`: `[V]` float32 rows on the host behind each committed token,
    for a sequence that records its logits, else None; `logprobs`: per committed token (its logprob, its
    most likely tokens) for a sequence whose request asks for logprobs, else None; `prompt_logprobs`: for the
    prompt tokens this step fed, each but the prompt's first one's (logprob, most likely tokens) under the
    model's distribution at the position before it (the first prompt token gets None), for a sequence whose
    request asks for them, else None."""

    token_ids: list[list[int]]
    accepted: list[int]
    finite: list[bool]
    drafts: list[list[int]] | None = None
    logit_rows: list[list[torch.Tensor] | None] | None = None
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: list[list[TokenLogprobs | None] | None] | None = None
