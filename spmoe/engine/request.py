"""What goes into the engine and what comes out of it: a request, its per-step output, the engine's counters.

These are plain host objects (no tensors): the server builds requests from HTTP bodies, rank 0 sends them to
the other ranks, and the outputs travel back to the asyncio side.
"""

from dataclasses import dataclass, field

from spmoe.engine.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class Request:
    """One generation: up to `max_new_tokens` tokens after `prompt` (token ids), stopping early at any of
    `eos_token_ids`, sampled with `sampling` (its own seed: the tokens do not depend on the other requests in
    the batch). The engine validates it on `add_request`."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class RequestOutput:
    """What one step did to one request: the tokens it committed (one, or several when drafts were accepted),
    and `finish_reason` once it ended ("stop": an eos id, "length": max_new_tokens, "abort", "error" with
    `error` saying why). `prompt_tokens` is the prompt's length."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    prompt_tokens: int = 0


@dataclass
class EngineMetrics:
    """A snapshot of the engine: requests running (holding cache) and waiting (queued), the share of the KV
    cache in use (0..1), and counters since start: generated tokens, and for MTP the draft tokens proposed and
    accepted, the verifications (`drafts`: a sequence's drafts checked by one target forward) and the accepted
    drafts per position (`accepted_per_position[j]`: verifications that accepted draft j + 1)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def combine(cls, parts: list["EngineMetrics"]) -> "EngineMetrics":
        """The metrics of several engines (one per DP group) as one: counts add up, cache usage averages
        (each group has a cache of the same size)."""
        return cls(
            sum(m.running for m in parts),
            sum(m.waiting for m in parts),
            sum(m.kv_cache_usage for m in parts) / len(parts),
            sum(m.generated_tokens for m in parts),
            sum(m.draft_proposed for m in parts),
            sum(m.draft_accepted for m in parts),
            sum(m.drafts for m in parts),
            [sum(counts) for counts in zip(*(m.accepted_per_position for m in parts))],
        )
