"""What goes into the engine and what comes out of it: a request, its per-step output, the engine's counters.

These are plain host objects (no tensors): the server builds requests from HTTP bodies, rank 0 sends them to
the other ranks, and the outputs travel back to the asyncio side.
"""

from dataclasses import dataclass, field, fields

from spmoe.engine.sampling.grammar import GrammarSpec
from spmoe.engine.sampling.sampler import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")

# a token's log-probability and the most likely tokens at its position, most likely first: (logprob,
# [(id, logprob)])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class Request:
    """One generation: up to `max_new_tokens` tokens after `prompt` (token ids), stopping early at any of
    `eos_token_ids`, sampled with `sampling` (its own seed: the tokens do not depend on the other requests in
    the batch). The engine validates it on `add_request`. With a `grammar` (structured output), every token
    follows it, from the first one or from the one after `grammar_start_after` (the tokens that end the
    reasoning); the request ends when the grammar is complete."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None
    grammar_start_after: tuple[int, ...] = ()


@dataclass
class RequestOutput:
    """What one step did to one request: the tokens it committed (one, or several when drafts were
    accepted), and `finish_reason` once it ended ("stop": an eos or stop id, which `stop_token` names, or
    its grammar complete; "length": max_new_tokens, "abort", "error" with `error` saying why).
    `prompt_tokens` is the prompt's length. When the request's sampling asks for them: `logprobs`, one per
    new token; `prompt_logprobs`, one per prompt token (None for the first), with the first output that
    has tokens. With the first output that has tokens, the engine's own seconds (durations: the
    front end's clock differs): `queue_s` from adding the request to first scheduling it,
    `prefill_s` from then to this first token."""

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


@dataclass
class EngineMetrics:
    """A snapshot of the engine: requests running (holding cache) and waiting (queued), the share of the KV
    cache in use (0..1), and counters since start: generated tokens, drafts proposed and accepted (MTP), the
    prefix cache's queries and hits in tokens (prompt tokens looked up when a sequence is admitted, and of
    those the ones found cached), running sequences preempted (their cache freed, to be recomputed) when the
    cache ran out, and for MTP the verifications (`drafts`: a sequence's drafts checked by one target forward)
    and the accepted drafts per position (`accepted_per_position[j]`: verifications that accepted draft j + 1)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0  # engine steps run
    steps_compiling: int = (
        0  # of those, steps in which a kernel compiled or a CUDA graph was captured
    )
    kernel_compiles: int = (
        0  # Triton kernel variants loaded in the process (`stats.KernelCompiles`)
    )
    graph_captures: int = 0  # CUDA graphs captured
    compiles_after_ready: int = 0  # kernel compiles and graph captures since the engine was warm
    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def combine(cls, parts: list["EngineMetrics"]) -> "EngineMetrics":
        """The metrics of several engines (one per DP group) as one: counts add up, cache usage averages
        (each group has a cache of the same size)."""
        counts = [f.name for f in fields(cls) if f.type is int]
        return cls(
            **{name: sum(getattr(m, name) for m in parts) for name in counts},
            kv_cache_usage=sum(m.kv_cache_usage for m in parts) / len(parts),
            accepted_per_position=[sum(c) for c in zip(*(m.accepted_per_position for m in parts))],
        )
