"""A request inside the engine (`Sequence`, with its one `commit`) and the records of a step, keyed
by sequence: `Part` (what one sequence does in a step, its `Role`), `Draft` (its next drafts),
`Admission` (a waiting sequence that joins), `Batch` (the step's parts), `PartResult` (what the
forward drew for one part); and `Owed`, the MTP rows a sequence's drafter has deferred.

A step is `Scheduler.schedule -> Batch`, `ModelRunner.forward` and `choose -> PartResult` per part,
`Sequence.commit` per part, `Speculator.draft`, `Scheduler.update` (docs/architecture.md).
"""

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from spmoe.engine.request import Request, RequestOutput, TokenLogprobs
from spmoe.engine.sampling.grammar import SequenceGrammar


class Status(Enum):
    """Where a sequence is; a finished one's value is its finish reason."""

    WAITING = "waiting"  # queued (or preempted): no cache room, no sampler row
    RUNNING = "running"
    STOPPED = "stop"  # an eos or stop id, or its grammar complete
    LENGTH = "length"  # max_new_tokens
    ABORTED = "abort"
    # non-finite logits, or a token its grammar refuses (`Sequence.error` says which)
    ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (Status.WAITING, Status.RUNNING)


class Role(Enum):
    """What one sequence's part of a step is."""

    # a chunk of its prompt (after a preemption: prompt and output); no draw
    PROMPT_CHUNK = "prompt chunk"
    PROMPT_END = "prompt end"  # the rest of it; draws its next token from the last row
    DECODE = "decode"  # its last token and its drafts: verifies them, draws after the last it keeps
    FORK = "fork"  # feeds nothing: draws its first token from `source`'s last prompt row


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: its cache room, what the next forwards feed, what it generated,
    its status. Compared by identity (one request's life in the engine; list lookups stay cheap)."""

    request: Request
    record_logits: bool = False  # keep the logits row `[V]` behind every generated token
    grammar: SequenceGrammar | None = None  # structured output: where it is in its grammar
    status: Status = Status.WAITING
    cache_id: int = -1  # its slot (slot cache) or block-table id (paged cache); -1: no room
    sample_row: int = -1  # its row of the engine's Sampler while it runs; -1: none
    cached: int = 0  # tokens of this sequence in the target's KV cache
    pending: list[int] = field(default_factory=list)  # what the next target forwards feed
    drafts: list[int] = field(default_factory=list)  # the tail of `pending` that was drafted
    lookup_drafts: int = 0  # of its drafts, the leading ones the context lookup proposed
    owed: "Owed | None" = None  # the MTP rows its drafter deferred (`drafter.py`); None: none
    prefilling: bool = False  # `pending` is (the rest of) a prompt, fed in chunks
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # `[V]` per token, when recorded
    error: str | None = None  # why it finished with status ERROR
    preemptions: int = 0
    # the prefix cache's chained hashes of its first blocks, as far as computed (its tokens are only
    # appended to: each block is hashed once, however often it is looked up)
    block_hashes: list[bytes] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # chunk by chunk
    # they went out with its first tokens: a recompute needs none
    prompt_logprobs_sent: bool = False
    added_s: float = field(default_factory=time.perf_counter)  # when it entered the engine
    scheduled_s: float | None = None  # when it was first scheduled (`Scheduler._start`)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def written(self) -> int:
        """Its first positions whose rows are all in the cache: the target's, and the MTP layer's up
        to the first row the drafter owes it."""
        return self.cached if self.owed is None else self.owed.start

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt rows it feeds now need their logits (asked for, and not yet sent)."""
        return self.request.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def commit(self, result: "PartResult", step: int) -> None:
        """Commit what step number `step` drew for this sequence's part: the one place where its eos
        and stop ids, its length, its grammar's end and a non-finite row are decided
        (`decide_stop`), and the one place its grammar walks committed tokens. Sets `result.output`
        (None for a prompt chunk), with its queue and prefill seconds when it brings the
        first tokens."""
        part = result.part
        if result.prompt_logprobs is not None:
            self.prompt_logprobs += result.prompt_logprobs
        if part.role is Role.PROMPT_CHUNK:
            self.cached += len(part.tokens)
            self.pending = self.pending[len(part.tokens) :]
            return
        if not result.finite:
            self.error = (
                f"non-finite logits (NaN or inf) at step {step} "
                f"({'decode' if self.cached else 'prefill'}) for request {self.request_id!r} "
                f"after {len(self.output)} generated tokens: no token can be chosen (check the "
                "checkpoint for NaN / inf weights)"
            )
            self.status = Status.ERROR
            result.output = self._output([])
            return
        first = not self.output
        tokens, self.status, stop_token = self.decide_stop(result.tokens)
        self.output += tokens
        if self.record_logits:
            self.logits += result.logit_rows[: len(tokens)]
        # the fed positions whose rows stay valid: all but the rejected drafts'
        self.cached += len(part.tokens) - (len(part.drafts) - result.accepted)
        # a fork feeds next the rest of its prompt that it does not share, then its first token
        self.pending = self.request.prompt[self.cached :] + [tokens[-1]]
        self.drafts, self.lookup_drafts = [], 0
        self.prefilling = self.cached < len(self.request.prompt)
        output = self._output(tokens, stop_token)
        if first:
            output.queue_s = self.scheduled_s - self.added_s
            output.prefill_s = time.perf_counter() - self.scheduled_s
        if result.logprobs is not None:
            output.logprobs = result.logprobs[: len(tokens)]
        if self.wants_prompt_logprobs:
            output.prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        result.output = output

    def decide_stop(self, candidates: list[int]) -> tuple[list[int], Status, int | None]:
        """The tokens drawn for it, in order -> (those it commits, its status after them, the eos or
        stop id that ended it or None). Walks its grammar over the committed tokens."""
        request, grammar = self.request, self.grammar
        for j, token in enumerate(candidates):
            kept = candidates[: j + 1]
            if grammar is not None and not grammar.accept(token):
                self.error = (
                    f"request {self.request_id!r}: token {token} does not follow its grammar"
                )
                return kept, Status.ERROR, None
            if token in request.eos_token_ids:
                return kept, Status.STOPPED, token
            if len(self.output) + j + 1 == request.max_new_tokens:
                return kept, Status.LENGTH, None
            if grammar is not None and grammar.finished:
                return kept, Status.STOPPED, None
        return candidates, Status.RUNNING, None

    def _output(self, tokens: list[int], stop_token: int | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=tokens,
            finish_reason=self.finish_reason,
            error=self.error,
            prompt_tokens=len(self.request.prompt),
            stop_token=stop_token,
        )


@dataclass(eq=False, kw_only=True)
class Part:
    """One sequence's part of a step: it feeds `tokens` (the head of its `pending`) from position
    `start` (its cached length) into its cache room `location` (a slot, or a block table); `drafts`:
    the drafts among them (their tail), the first `lookup_drafts` of them the context lookup's, the
    rest MTP's. A fork feeds nothing and draws from `source`'s last row."""

    seq: Sequence
    role: Role
    tokens: list[int] = field(default_factory=list)
    start: int = 0
    location: int | list[int] | None = None
    drafts: list[int] = field(default_factory=list)
    lookup_drafts: int = 0
    source: "Part | None" = None

    @property
    def draws(self) -> bool:
        """Whether it draws tokens this step (all but a prompt chunk)."""
        return self.role is not Role.PROMPT_CHUNK


@dataclass(kw_only=True)
class Draft:
    """A sequence's next drafts: `tokens`, the first `from_lookup` of them proposed by the context
    lookup (`runner/lookup.py`), the rest by the MTP layer."""

    tokens: list[int]
    from_lookup: int = 0


@dataclass(kw_only=True)
class Owed:
    """The MTP layer's rows of a sequence's verified positions `start` ..
    `start + len(next_ids) - 1`, not written yet (steps whose drafts the lookup made alone,
    `drafter.py`): per position the token after it and, per such step, the target's post-norm hidden
    `[n, H]` of its positions."""

    start: int
    next_ids: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)


@dataclass(kw_only=True)
class Admission:
    """A waiting sequence that joins a step, as the deciding rank sends it to the others: with the
    prompt tokens it reuses from the prefix cache, or as a fork of the sequence
    computing its prompt."""

    request_id: str
    cached: int = 0
    fork: bool = False


@dataclass(kw_only=True)
class Batch:
    """A step: its parts (the sequences that feed, in admission order, then the forks), its number
    since the statistics were reset (for error messages), and the admissions it made. No parts: an
    empty step that keeps the DP ranks in step."""

    parts: list[Part]
    step: int
    admissions: list[Admission] = field(default_factory=list)

    @property
    def fed(self) -> list[Part]:
        """The parts that feed tokens, laid end to end in the forward (all but the forks)."""
        return [part for part in self.parts if part.role is not Role.FORK]

    @property
    def decode(self) -> bool:
        """Every part decodes (no prompt): a captured CUDA graph can run the step."""
        return all(part.role is Role.DECODE for part in self.parts)


@dataclass(kw_only=True)
class PartResult:
    """What the forward drew for one part. `tokens`: the accepted drafts and the target's draw after
    them (before the stop decision; none for a prompt chunk); `accepted`: the drafts the target
    kept; `finite`: every row it draws from was finite; `logit_rows`: `[V]` float32 on the host
    behind each token, when its sequence records them; `logprobs`: per token, when asked;
    `prompt_logprobs`: for the prompt tokens it fed, each but the prompt's first one's under the
    model at the position before (the first: None), when asked. `output`: what its commit made (None
    for a prompt chunk)."""

    part: Part
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    finite: bool = True
    logit_rows: list[torch.Tensor] | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    output: RequestOutput | None = None
