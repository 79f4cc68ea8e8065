"""The KV caches as room for tokens, through one small interface the scheduler asks (`fits`,
`cached_prefix`, `can_allocate`, `allocate`, `can_grow`, `grow`, `forks`, `can_fork`, `fork`,
`cache_written`, `free`, `location`, `usage`, `prefix_cache_counts`): `SlotRoom` over the slot
`KVCache` (the dense reference), `BlockRoom` over the paged cache's blocks (`cache/blocks.py`:
reference counts, the prefix cache's hash chain, forks sharing a prompt's full blocks).
"""

from spmoe.engine.cache.blocks import BlockManager
from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.sequence import Sequence


class SlotRoom:
    """The slot KV cache as room for tokens: a sequence gets one slot of `max_len` positions
    for its life."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.max_num_seqs = cache.max_seqs

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens can ever be held (the cache empty)."""
        return num_tokens <= self.cache.max_len

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.cache.max_len

    def cached_prefix(self, seq: Sequence) -> int:
        """The slot cache keeps nothing past a sequence's life: no token is ever cached
        for a new one."""
        return 0

    @property
    def shared_block(self) -> int | None:
        """No prefix cache: nothing is shared."""
        return None

    # a slot holds one sequence's rows: the n choices of a request compute their prompts each
    forks = False

    def can_allocate(self, num_tokens: int, seq: Sequence) -> bool:
        """Whether a new sequence of up to `num_tokens` tokens can get room now."""
        return self.cache.free_slots > 0 and self.fits(num_tokens)

    def allocate(self, seq: Sequence, num_tokens: int, reuse: int | None = None) -> int:
        """A slot for `seq` (`reuse`: what the deciding rank found cached, 0 here). -> 0: nothing of
        it is cached."""
        if reuse:
            raise ValueError(
                f"the slot cache keeps no prefix; the deciding rank reuses {reuse} tokens"
            )
        seq.cache_id = self.cache.allocate()
        return 0

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens in all (a slot holds `max_len`
        from the start)."""
        return self.fits(num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def cache_written(self, seq: Sequence, num_written: int) -> None:
        """Nothing to keep: a slot is released whole."""

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found): none without one."""
        return 0, 0

    def free(self, seq: Sequence) -> None:
        self.cache.release(seq.cache_id)
        seq.cache_id = -1

    def location(self, seq: Sequence) -> int:
        """What the cache's `view` takes for `seq`: its slot."""
        return seq.cache_id

    def usage(self) -> float:
        """The share of the cache held by sequences (0..1)."""
        return 1 - self.cache.free_slots / self.cache.max_seqs

    def request_tables(self) -> dict[str, int]:
        """Per-sequence entries: the slots held."""
        return {"kv_slots": self.cache.max_seqs - self.cache.free_slots}

    def stats(self) -> dict:
        return {
            "kind": "slots",
            "bytes_per_token": self.cache.bytes_per_token,
            "slots": self.cache.max_seqs,
            "max_len": self.cache.max_len,
        }


class BlockRoom:
    """The paged KV cache's blocks as room for tokens: a sequence holds blocks for what it has fed
    (and its reserve), and grows them as it goes; up to `max_num_seqs` sequences at once, each of up
    to `max_model_len` tokens (None: the whole cache). `enable_prefix_caching`: full blocks stay
    cached for later sequences; `lookahead`: the tokens past a block that its rows depend on (1 when
    the engine drafts with MTP, whose row at a position embeds the next token)."""

    def __init__(
        self,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        lookahead: int = 0,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.cache, self.max_num_seqs = cache, max_num_seqs
        self.blocks = BlockManager(
            cache.num_blocks, cache.block_size, enable_prefix_caching, lookahead
        )
        self.max_model_len = min(
            max_model_len or self.blocks.capacity_tokens, self.blocks.capacity_tokens
        )
        self.peak_blocks = 0  # the most blocks in use at once
        self._next_id = 0

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.max_model_len

    def cached_prefix(self, seq: Sequence) -> int:
        """Tokens at the head of what a waiting sequence feeds (`pending`) that cached
        blocks hold."""
        return self.blocks.cached_prefix(self._lookup(seq), seq.block_hashes)

    @property
    def shared_block(self) -> int | None:
        """The tokens of a block sequences can share through the prefix cache (None:
        caching off)."""
        return self.blocks.block_size if self.blocks.enable_caching else None

    def can_allocate(self, num_tokens: int, seq: Sequence) -> bool:
        """Whether waiting `seq` fits now with room for `num_tokens` tokens in all, its cached
        prefix included."""
        return self.blocks.can_allocate(num_tokens, self._lookup(seq), seq.block_hashes)

    # sequences with the same prompt share its full blocks (`fork`), with prefix caching or not
    forks = True

    def can_fork(self, seq: Sequence) -> bool:
        """Whether waiting `seq` can fork from a sequence with its prompt now (the blocks it
        needs are free)."""
        return self.blocks.can_fork(len(seq.request.prompt))

    def fork(self, source: Sequence, seq: Sequence) -> int:
        """Room for waiting `seq`'s prompt, which running `source` has (or writes this step): it
        shares the source's full blocks (`BlockManager.fork`). -> the prompt tokens shared: it
        computes the rest."""
        seq.cache_id, self._next_id = self._next_id, self._next_id + 1
        shared = self.blocks.fork(source.cache_id, seq.cache_id, len(seq.request.prompt))
        self._note_peak()
        return shared

    @staticmethod
    def _lookup(seq: Sequence) -> list[int]:
        """What to look up in the prefix cache for `seq`: what it feeds, or nothing when it wants
        its prompt's logprobs (they come from the forward over the prompt: a cached block
        would skip them)."""
        return [] if seq.wants_prompt_logprobs else seq.pending

    def allocate(self, seq: Sequence, num_tokens: int, reuse: int | None = None) -> int:
        """Room for `num_tokens` tokens of a new sequence, its cached prefix included: the longest
        one cached, or the `reuse` tokens the deciding rank found (RuntimeError if this cache lacks
        them). -> the tokens of what it feeds (`pending`) already cached."""
        seq.cache_id, self._next_id = self._next_id, self._next_id + 1
        cached = self.blocks.allocate(
            seq.cache_id, num_tokens, self._lookup(seq), seq.block_hashes, reuse
        )
        self._note_peak()
        return cached

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks.can_grow(
            seq.cache_id, max(0, num_tokens - self.blocks.reserved(seq.cache_id))
        )

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for `num_tokens` tokens of `seq` in all."""
        self.blocks.grow(seq.cache_id, max(0, num_tokens - self.blocks.reserved(seq.cache_id)))
        self._note_peak()

    def cache_written(self, seq: Sequence, num_written: int) -> None:
        """`seq`'s first `num_written` positions hold all their rows: its full blocks among them
        become cached. The token list is built only when a block may be completed (once per block,
        not per step)."""
        known = len(seq.request.prompt) + len(seq.output)
        if self.blocks.would_cache(seq.cache_id, num_written, known):
            self.blocks.cache_blocks(seq.cache_id, seq.request.prompt + seq.output, num_written)

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found cached) since start."""
        return self.blocks.queries, self.blocks.hits

    def free(self, seq: Sequence) -> None:
        self.blocks.free(seq.cache_id)
        seq.cache_id = -1

    def location(self, seq: Sequence) -> list[int]:
        """What the cache's `view` takes for `seq`: its block table."""
        return self.blocks.block_table(seq.cache_id)

    def usage(self) -> float:
        """The share of the blocks held by sequences (0..1; cached blocks nobody holds are free)."""
        return self.blocks.usage

    def request_tables(self) -> dict[str, int]:
        return self.blocks.request_tables()

    def stats(self) -> dict:
        return {
            "kind": "paged",
            "kv_cache_dtype": "fp8" if self.cache.fp8 else "auto",
            "bytes_per_token": self.cache.bytes_per_token,
            "block_size": self.cache.block_size,
            "num_blocks": self.blocks.num_blocks,
            "capacity_tokens": self.blocks.capacity_tokens,
            "blocks_in_use": self.blocks.num_used_blocks,
            "peak_blocks_in_use": self.peak_blocks,
            "prefix_caching": self.blocks.enable_caching,
            "cached_blocks": self.blocks.num_cached_blocks,
            "prefix_cache_queries": self.blocks.queries,
            "prefix_cache_hits": self.blocks.hits,
        }

    def _note_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_used_blocks)
