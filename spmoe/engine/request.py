"""What goes into the engine and what comes out of it, as plain records (`msgspec.Struct`, no
torch): a request with its sampling parameters and grammar spec, its per-step output, the engine's
counters.

The server's front end builds requests from HTTP bodies and sends them over the wire to rank 0's
engine process, which hands them to the other ranks; the outputs travel back. Both processes import
these records, which import nothing of torch. On the engine's side the sampler
(`sampling/sampler.py`) builds its device rows from `SamplingParams`, and the grammar compiler
(`sampling/grammar.py`) its compiled grammars from `GrammarSpec`.
"""

import math
from itertools import zip_longest

import msgspec

FINISH_REASONS = ("stop", "length", "abort", "error")
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "tool_calls")
# the most top logprobs a row may ask for (OpenAI's limit)
MAX_LOGPROBS = 20
# |bias| per token, as OpenAI bounds it
MAX_LOGIT_BIAS = 100.0
# temperatures below this are greedy: dividing logits by less overflows float32 (vLLM draws the same
# line)
GREEDY_BELOW = 1e-5
# repetition_penalty's range: a logit is divided or multiplied by it, so outside it a row overflows
# to inf
REPETITION_PENALTY_RANGE = (1e-3, 1e3)

# a token's log-probability and the most likely tokens at its position, most likely first:
# (logprob, [(id, logprob)])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class SamplingParams(msgspec.Struct, frozen=True):
    """How one request chooses its tokens. Every field's default leaves the logits unchanged.

    `logit_bias`: (token id, bias) pairs; `min_tokens`: the eos and stop ids are excluded until this
    many tokens were generated; `logprobs`: None, or how many most likely tokens to report beside
    the chosen one's logprob (0..20); `prompt_logprobs`: the same for the prompt's tokens (the
    server's `echo`). Where a request is read, `check` refuses values out of range; the engine takes
    them as they come."""

    # 0 (below `GREEDY_BELOW`): greedy
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # 0: off
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def check(self) -> None:
        """Raise a one-line ValueError naming the first field out of its range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        # NaN too
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), "
                f"got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {bias}"
                )
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1


class GrammarSpec(msgspec.Struct, frozen=True):
    """A grammar as plain text, so that it travels with its request and every rank compiles the same
    one. `kind`: "json_schema" (`text`: the schema's JSON), "json_object" (any JSON object; `text`
    ""), "regex", "choice" (`text`: a JSON list of the allowed strings), "ebnf" (xgrammar's EBNF,
    rule `root`) or "tool_calls" (`text`: a `ToolCalls`' JSON; GLM's tool-call layout)."""

    kind: str
    text: str = ""


class ToolCalls(msgspec.Struct, frozen=True):
    """The text of a "tool_calls" grammar (`spec_text`): which calls the output may hold. `tools`:
    (name, its parameters' JSON schema) in the client's order; `free_text`: text around the calls
    (`tool_choice` `auto`), else the output is the calls; `several`: more than one call may come."""

    tools: list[tuple[str, dict]]
    free_text: bool
    several: bool

    def spec_text(self) -> str:
        """Compact JSON, each schema's keys in the client's order."""
        return msgspec.json.encode(self).decode()


class Request(msgspec.Struct, frozen=True):
    """One generation: up to `max_new_tokens` tokens after `prompt` (token ids), stopping early at
    any of `eos_token_ids`, sampled with `sampling` (its own seed: the tokens do not depend on the
    other requests in the batch). The engine validates it on `add_request`. With a `grammar`
    (structured output), every token follows it, from the first one or from the one after
    `grammar_start_after` (the tokens that end the reasoning); the request ends when the grammar is
    complete."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None
    grammar_start_after: tuple[int, ...] = ()


class RequestOutput(msgspec.Struct):
    """What one step did to one request: the tokens it committed (one, or several when drafts were
    accepted), and `finish_reason` once it ended ("stop": an eos or stop id, which `stop_token`
    names, or its grammar complete; "length": max_new_tokens, "abort", "error" with `error` saying
    why). `prompt_tokens` is the prompt's length. When the request's sampling asks for them:
    `logprobs`, one per new token; `prompt_logprobs`, one per prompt token (None for the first),
    with the first output that has tokens. With the first output that has tokens, the engine's own
    seconds (durations: the front end's clock differs): `queue_s` from adding the request to first
    scheduling it, `prefill_s` from then to this first token."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    prompt_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_token: int | None = None
    queue_s: float | None = None
    prefill_s: float | None = None


class DraftCounts(msgspec.Struct):
    """One draft source's speculation counters since start: `drafts`, verifications whose first
    draft it proposed; `proposed` and `accepted`, its draft tokens; `accepted_per_position[j]`, its
    drafts accepted at position j (0: the first draft); `chosen`, the (sequence, step) drafts it
    led."""

    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = []
    chosen: int = 0

    def add(self, other: "DraftCounts") -> None:
        self.drafts += other.drafts
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.chosen += other.chosen
        pairs = zip_longest(self.accepted_per_position, other.accepted_per_position, fillvalue=0)
        self.accepted_per_position = [a + b for a, b in pairs]


class EngineMetrics(msgspec.Struct):
    """A snapshot of the engine: requests running (holding cache) and waiting (queued), the share of
    the KV cache in use (0..1), and counters since start: generated tokens, drafts proposed and
    accepted, the prefix cache's queries and hits in tokens (prompt tokens looked up when a sequence
    is admitted, and of those the ones found cached), running sequences preempted (their cache
    freed, to be recomputed) when the cache ran out; engine steps run, and of those the steps in
    which a kernel compiled or a CUDA graph was captured; Triton kernel variants loaded in the
    process (`stats.KernelCompiles`); CUDA graphs captured; kernel compiles and graph captures since
    the engine was warm; and with speculation the verifications (`drafts`: a sequence's drafts
    checked by one target forward) and the accepted drafts per position (`accepted_per_position[j]`:
    verifications that accepted draft j + 1), in all and by draft source (`by_source`).
    `request_tables`: the entries of each table kept per request or sequence (the scheduler's
    requests, the KV room's block tables, ...), every one 0 once the engine is idle."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    steps_compiling: int = 0
    kernel_compiles: int = 0
    graph_captures: int = 0
    compiles_after_ready: int = 0
    drafts: int = 0
    accepted_per_position: list[int] = []
    # the same by draft source ("mtp", "ngram", "suffix"), and per source the drafts it led; "none":
    # the steps a drawing sequence had no draft (a lookup alone without a match)
    by_source: dict[str, DraftCounts] = {}
    request_tables: dict[str, int] = {}

    @classmethod
    def combine(cls, parts: list["EngineMetrics"]) -> "EngineMetrics":
        """The metrics of several engines (one per DP group) as one: counts add up, cache usage
        averages (each group has a cache of the same size)."""
        counts = [f.name for f in msgspec.structs.fields(cls) if f.type is int]
        by_source: dict[str, DraftCounts] = {}
        tables: dict[str, int] = {}
        for m in parts:
            for source, part in m.by_source.items():
                by_source.setdefault(source, DraftCounts()).add(part)
            for table, entries in m.request_tables.items():
                tables[table] = tables.get(table, 0) + entries
        return cls(
            **{name: sum(getattr(m, name) for m in parts) for name in counts},
            kv_cache_usage=sum(m.kv_cache_usage for m in parts) / len(parts),
            accepted_per_position=[sum(c) for c in zip(*(m.accepted_per_position for m in parts))],
            by_source=by_source,
            request_tables=tables,
        )
