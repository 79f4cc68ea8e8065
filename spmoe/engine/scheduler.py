"""Which sequences run each step: a waiting queue, a running batch, and admission while the KV cache has room.

A request becomes a `Sequence` when it is added and waits in arrival order. At the start of every step the
scheduler admits waiting sequences, first come first served, while the cache can hold them; every running
sequence then takes part in the step (its whole prompt on its first step, then its last token and any
drafts). A finished or aborted sequence leaves the batch and frees its room at once, so the next step can
admit another.

The scheduler asks the cache about room in tokens, through `SlotRoom`'s small interface (`fits`,
`can_allocate`, `allocate`, `free`, `usage`), never about slots, so a paged cache can stand in for it.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from spmoe.engine.kv_cache import KVCache
from spmoe.engine.request import Request
from spmoe.engine.sampling import Sampler


@dataclass
class Sequence:
    """A request inside the engine: its cache room, what the next forward feeds, what it generated."""

    request: Request
    sampler: Sampler
    record_logits: bool = False  # keep the logits row `[V]` behind every generated token
    slot: int = -1  # where its cache rows live (-1: none yet)
    cached: int = 0  # tokens of this sequence in the target's KV cache
    pending: list[int] = field(default_factory=list)  # what the next target forward feeds
    drafts: list[int] = field(default_factory=list)  # the tail of `pending` that MTP drafted
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # `[V]` per committed token, when recorded
    finish_reason: str | None = None
    error: str | None = None  # why it finished with finish_reason "error"

    @property
    def request_id(self) -> str:
        return self.request.request_id


class SlotRoom:
    """The slot KV cache as room for tokens: a sequence gets one slot of `max_len` positions for its life."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens can ever be held (the cache empty)."""
        return num_tokens <= self.cache.max_len

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.cache.max_len

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of up to `num_tokens` tokens can get room now."""
        return self.cache.free_slots > 0 and self.fits(num_tokens)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        seq.slot = self.cache.allocate()

    def free(self, seq: Sequence) -> None:
        self.cache.release(seq.slot)
        seq.slot = -1

    def usage(self) -> float:
        """The share of the cache held by sequences (0..1)."""
        return 1 - self.cache.free_slots / self.cache.max_seqs


class Scheduler:
    def __init__(self, room: SlotRoom, reserve_tokens: int = 0):
        """`reserve_tokens`: room a sequence needs beyond its prompt and `max_new_tokens` (the drafts fed on
        its last step)."""
        self.room, self.reserve_tokens = room, reserve_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def tokens_needed(self, request: Request) -> int:
        """The most cache positions the request can occupy."""
        return len(request.prompt) + request.max_new_tokens + self.reserve_tokens

    def holds(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.waiting, *self.running))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences while the cache has room -> the sequences that run this step."""
        while self.waiting and self.room.can_allocate(self.tokens_needed(self.waiting[0].request)):
            seq = self.waiting.popleft()
            self.room.allocate(seq, self.tokens_needed(seq.request))
            seq.pending = list(seq.request.prompt)
            self.running.append(seq)
        return list(self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a running sequence out of the batch and free its room."""
        seq.finish_reason = reason
        self.running.remove(seq)
        self.room.free(seq)

    def abort(self, request_id: str) -> bool:
        """Drop the sequence wherever it is, freeing its room. -> whether it was there."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
