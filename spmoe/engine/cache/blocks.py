"""Accounting for the paged KV cache's blocks: which blocks are free, each sequence's block table,
and the prefix cache (full blocks kept after their sequence ends, found again by a hash of
everything before them).

The cache is a pool of `num_blocks` blocks of `block_size` tokens, shared by all sequences. Sequence
`seq_id` owns a block table: its logical block i (positions
`[i * block_size, (i + 1) * block_size)`) lives in physical block `table[i]`. A sequence holds room
for `reserved(seq_id)` tokens, always within its blocks.

The scheduler asks before it acts: `can_allocate(n, tokens)` before admitting a prompt (else it
waits), `can_grow(seq_id, n)` before a running sequence takes n more tokens (else one is preempted:
`free` gives back its blocks, and it is recomputed later). Pure Python, no tensors: the engine turns
the tables into the step's device tensors.

Prefix caching (`enable_caching`). A block holds, for each of its positions, every row the forward
writes there: on every attention layer (the MTP layer's included) the latent, the rope key and the
indexer key, on every rank. Those rows are a function of the token ids up to the position, plus
`lookahead` more: the MTP layer's row at position p embeds the token at p + 1, so an engine that
drafts with MTP builds its manager with `lookahead=1`. Nothing else enters them: the model, its
weights and the cache dtype are fixed for the life of an engine, and so of its manager.

- Once a sequence has written the rows of a full block and the `lookahead` tokens after it are known
  (`cache_blocks`), the block gets a hash chained over its parent's hash, its token ids and those
  lookahead tokens (`block_hash`): equal hashes mean equal token ids from position 0 to the block's
  end (+ lookahead), hence equal rows.
- Blocks are reference-counted: several sequences may hold the same cached block. Nobody writes a
  cached block again (a sequence only writes positions past its cached prefix, which lie in its
  own fresh blocks).
- When the last holder frees a cached block, the block stays cached but unreferenced; it is evicted,
  least recently used first, only when a new block is needed and no uncached free block is left.
- `allocate` with a prompt's token ids takes the longest chain of cached blocks that matches its
  first tokens and returns how many tokens that covers: never the whole prompt, since the last
  prompt token must be computed for its logits.
- `fork` gives a new sequence another's full blocks for a shared prompt (`n` > 1 choices), copying
  nothing: with caching on or off (the blocks are reference-counted either way).

Every call is deterministic (no clocks, no randomness, hashes by SHA-256 of the token ids). Which
blocks a new sequence reuses is decided by one rank's lookup; the other ranks pass that decision to
`allocate` (`reuse`), take the blocks of that many tokens from their own caches by the same hashes,
and raise if they lack one (their caches diverged).
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block whose parent block (the one before it) hashes to `parent` (None: the
    first block) and whose rows depend on `token_ids` (its own tokens, then its lookahead tokens)
    -> 32 bytes."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False, lookahead: int = 0
    ):
        """`enable_caching`: keep full blocks for later sequences (see the module docstring);
        `lookahead`: the tokens past a block's end that its rows depend on (1 when the engine
        drafts with MTP)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the block manager needs num_blocks >= 1 and block_size >= 1, got {num_blocks} "
                f"and {block_size}"
            )
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 tokens, got {lookahead}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching, self.lookahead = enable_caching, lookahead
        # uncached, unreferenced; popped from the end: 0 first
        self._free = list(range(num_blocks - 1, -1, -1))
        # cached, unreferenced; least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks  # sequences holding each block
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> cached block
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}
        # sequence -> the hashes of its leading blocks (memo)
        self._chains: dict[int, list[bytes]] = {}
        # sequence -> its leading blocks full, written and done by cache_blocks
        self._written: dict[int, int] = {}
        self.queries = 0  # prompt tokens looked up in the prefix cache, since start
        self.hits = 0  # of those, tokens found cached

    # -- queries ----------------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: uncached free ones, and cached ones nobody holds
        (evicted first)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash (held or not)."""
        return len(self._hash_of)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1 (cached blocks nobody holds count as free)."""
        return self.num_used_blocks / self.num_blocks

    def request_tables(self) -> dict[str, int]:
        """Entries of the per-sequence tables: block tables, reservations, the memos of hashes and
        written blocks (each empties when its sequences are freed)."""
        return {
            "block_tables": len(self._tables),
            "block_reservations": len(self._reserved),
            "block_hash_chains": len(self._chains),
            "blocks_written": len(self._written),
        }

    def cached_prefix(self, token_ids: Sequence[int], hashes: list[bytes] | None = None) -> int:
        """Tokens at the head of a prompt `token_ids` whose rows the cache holds: whole blocks,
        fewer than `len(token_ids)` (0 with caching off). `hashes`: the chain hashes of the prompt's
        first blocks as far as known, extended here as needed (a memo the caller keeps with its
        token ids; see `allocate`)."""
        return len(self._hit_blocks(token_ids, hashes)) * self.block_size

    def can_allocate(
        self, num_tokens: int, token_ids: Sequence[int] = (), hashes: list[bytes] | None = None
    ) -> bool:
        """Whether a new sequence with room for `num_tokens` tokens, whose prompt is `token_ids`
        (for its cached prefix), fits now."""
        hit = self._hit_blocks(token_ids, hashes)
        return self.blocks_for(num_tokens) - len(hit) <= self.num_free_blocks - self._unheld(hit)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        """Whether sequence `seq_id` can take `num_tokens` more tokens (its last block's room,
        then free ones)."""
        return self._extra_blocks(seq_id, num_tokens) <= self.num_free_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block of each logical block of `seq_id`."""
        return self._tables[self._check(seq_id)]

    def reserved(self, seq_id: int) -> int:
        """Tokens `seq_id` has room for."""
        return self._reserved[self._check(seq_id)]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    # -- changes ----------------------------------------------------------------------------------

    def allocate(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Sequence[int] = (),
        hashes: list[bytes] | None = None,
        reuse: int | None = None,
    ) -> int:
        """Room for a new sequence's first `num_tokens` tokens, its prompt being `token_ids` (empty:
        nothing to look up). Its leading blocks are the longest cached chain matching the prompt,
        the rest fresh blocks.
        -> the tokens already cached (a multiple of the block size, fewer than the prompt and than
        `num_tokens`): the sequence computes from there.

        `reuse`: the cached tokens another rank decided this sequence reuses (its own lookup found
        them): this manager takes exactly the blocks of that many tokens, found by their chain
        hashes, instead of looking the prompt up; RuntimeError if it does not hold them all (the
        ranks' caches diverged).

        `hashes` (optional): a list the caller keeps for the sequence's life, holding the chain
        hashes of its first blocks as far as they were computed (empty at first). Its tokens are
        only ever appended to, so the hashes stay valid; the manager extends the list (lookups,
        `cache_blocks`) and so hashes each block of a sequence once, even when it waits for room
        over many steps or comes back after a preemption."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds {len(self._tables[seq_id])} blocks")
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least 1 token, got {num_tokens}")
        chain = [] if hashes is None else hashes
        hit = (
            self._hit_blocks(token_ids, chain)
            if reuse is None
            else self._reused_blocks(token_ids, chain, reuse)
        )
        cached = len(hit) * self.block_size
        if num_tokens <= cached:
            raise ValueError(
                f"sequence {seq_id} finds {cached} prompt tokens cached and must compute the next "
                f"one: room for more than {cached} tokens expected, got {num_tokens}"
            )
        fresh = self.blocks_for(num_tokens) - len(hit)
        if fresh > self.num_free_blocks - self._unheld(hit):
            raise ValueError(
                f"a new sequence of {num_tokens} tokens ({cached} cached) needs {fresh} KV cache "
                f"blocks, {self.num_free_blocks - self._unheld(hit)} of {self.num_blocks} are free"
            )
        for block in hit:
            self._hold(block)
        self._tables[seq_id] = hit + [self._take_block() for _ in range(fresh)]
        self._reserved[seq_id] = num_tokens
        self._chains[seq_id], self._written[seq_id] = chain, len(hit)
        if self.enable_caching and token_ids:
            self.queries += len(token_ids)
            self.hits += cached
        return cached

    def fork_blocks(self, num_tokens: int) -> int:
        """The full blocks of a prompt of `num_tokens` tokens whose rows depend on its tokens only:
        every full block, less the last one when its `lookahead` tokens lie past the prompt (they
        are each fork's own)."""
        return max(0, num_tokens - self.lookahead) // self.block_size

    def can_fork(self, num_tokens: int) -> bool:
        """Whether `fork` of a prompt of `num_tokens` tokens finds the fresh blocks it needs now."""
        return self.blocks_for(num_tokens) - self.fork_blocks(num_tokens) <= self.num_free_blocks

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> int:
        """A new sequence `child_id` whose first `num_tokens` tokens (a prompt) are the first ones
        of `parent_id`, which holds room for them and has written their rows, or writes them in the
        step that forks (the child reads none before the next step): the child holds the parent's
        `fork_blocks` blocks, copying nothing, and fresh blocks for the rest of the prompt, which it
        computes itself. -> the tokens shared (a multiple of the block size)."""
        if child_id in self._tables:
            raise ValueError(
                f"sequence {child_id} already holds {len(self._tables[child_id])} blocks"
            )
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least 1 token, got {num_tokens}")
        if self.reserved(parent_id) < num_tokens:
            raise ValueError(
                f"sequence {child_id} forks {num_tokens} tokens of sequence {parent_id}, which "
                f"holds room for {self.reserved(parent_id)}"
            )
        shared = self._tables[parent_id][: self.fork_blocks(num_tokens)]
        fresh = self.blocks_for(num_tokens) - len(shared)
        self._need(fresh, f"sequence {child_id} forked from {parent_id} with {num_tokens} tokens")
        for block in shared:
            self._hold(block)
        self._tables[child_id] = shared + [self._take_block() for _ in range(fresh)]
        self._reserved[child_id] = num_tokens
        # the parent may not have hashed every shared block yet: the child's chain is extended when
        # needed
        self._chains[child_id] = self._chains[parent_id][: len(shared)]
        self._written[child_id] = len(shared)
        return len(shared) * self.block_size

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Room for `num_tokens` more tokens of `seq_id` -> its block table (grown in place)."""
        if num_tokens < 0:
            raise ValueError(f"a sequence grows by >= 0 tokens, got {num_tokens}")
        extra = self._extra_blocks(seq_id, num_tokens)
        self._need(extra, f"{num_tokens} more tokens of sequence {seq_id}")
        self._tables[seq_id].extend(self._take_block() for _ in range(extra))
        self._reserved[seq_id] += num_tokens
        return self._tables[seq_id]

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_written: int) -> None:
        """`seq_id` has written the rows of its first `num_written` positions, whose token ids (and
        any known after them) are `token_ids`: each full block among them whose `lookahead` tokens
        are known gets its hash, and becomes cached unless an equal block already is (this one then
        stays private to `seq_id`). A no-op for blocks already done."""
        if num_written > len(token_ids):
            raise ValueError(
                f"sequence {seq_id} wrote {num_written} positions; their token ids expected, got "
                f"{len(token_ids)}"
            )
        table = self._tables[self._check(seq_id)]
        complete = self._complete_blocks(seq_id, num_written, len(token_ids))
        if self.enable_caching:  # (without caching only the count matters, for `would_cache`)
            self._extend_chain(self._chains[seq_id], token_ids, complete)
            for i in range(self._written[seq_id], complete):
                digest = self._chains[seq_id][i]
                if digest not in self._block_of:
                    self._block_of[digest], self._hash_of[table[i]] = table[i], digest
        self._written[seq_id] = max(self._written[seq_id], complete)

    def would_cache(self, seq_id: int, num_written: int, num_known: int) -> bool:
        """Whether `cache_blocks` with `num_written` positions written and `num_known` token ids
        known would hash a new block (a caller can then build the token list only when
        it is needed)."""
        return (
            self._complete_blocks(seq_id, num_written, num_known)
            > self._written[self._check(seq_id)]
        )

    def free(self, seq_id: int) -> None:
        """Give back every block of `seq_id` (finished, aborted or preempted). Its cached blocks
        stay cached, its last blocks the first to be evicted."""
        for block in reversed(self._tables.pop(self._check(seq_id))):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        del self._reserved[seq_id], self._chains[seq_id], self._written[seq_id]

    # -- helpers ----------------------------------------------------------------------------------

    def _check(self, seq_id: int) -> int:
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id} holds no blocks")
        return seq_id

    def _hit_blocks(self, token_ids: Sequence[int], hashes: list[bytes] | None) -> list[int]:
        """The cached blocks of the longest chain matching the head of a prompt, leaving its last
        token out; `hashes` is extended with the hashes computed on the way."""
        if not self.enable_caching:
            return []
        chain, blocks = [] if hashes is None else hashes, []
        # block i ends at or before the last token
        for i in range((len(token_ids) - 1) // self.block_size):
            self._extend_chain(chain, token_ids, i + 1)
            if chain[i] not in self._block_of:
                break
            blocks.append(self._block_of[chain[i]])
        return blocks

    def _reused_blocks(self, token_ids: Sequence[int], chain: list[bytes], reuse: int) -> list[int]:
        """The cached blocks of the first `reuse` tokens of a prompt, which another rank's lookup
        found cached; `chain` is extended with their hashes. RuntimeError where this cache lacks
        one of them."""
        size = self.block_size
        if (
            reuse < 0
            or reuse % size
            or (reuse and reuse >= len(token_ids))
            or (reuse and not self.enable_caching)
        ):
            raise ValueError(
                f"reusing {reuse} cached tokens of a {len(token_ids)}-token prompt: a multiple of "
                f"{size} below the prompt's length "
                f"expected{'' if self.enable_caching else ', and 0 with prefix caching off'}"
            )
        self._extend_chain(chain, token_ids, reuse // size)
        blocks = [self._block_of.get(digest) for digest in chain[: reuse // size]]
        if None in blocks:
            raise RuntimeError(
                f"the deciding rank reuses {reuse} cached prompt tokens, but this rank's prefix "
                f"cache holds only the first {blocks.index(None) * size} of them: the ranks' "
                "caches diverged"
            )
        return blocks

    def _extend_chain(self, chain: list[bytes], token_ids: Sequence[int], num_blocks: int) -> None:
        """Append to `chain` (the hashes of the first blocks of `token_ids`) up to `num_blocks`
        hashes; the caller knows the tokens those blocks (and their lookahead) need."""
        size = self.block_size
        for i in range(len(chain), num_blocks):
            chain.append(
                block_hash(
                    chain[-1] if chain else None,
                    token_ids[i * size : (i + 1) * size + self.lookahead],
                )
            )

    def _complete_blocks(self, seq_id: int, num_written: int, num_known: int) -> int:
        """Leading blocks of `seq_id` that are full, written, and whose lookahead
        tokens are known."""
        return min(
            num_written, num_known - self.lookahead, len(self._tables[seq_id]) * self.block_size
        ) // (self.block_size)

    def _unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` (cached) nobody holds: taking them leaves fewer free blocks."""
        return sum(1 for b in blocks if b in self._evictable)

    def _hold(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take_block(self) -> int:
        """A free block for one sequence: an uncached one, else the least recently used cached
        one (evicted)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        return self.blocks_for(self._reserved[self._check(seq_id)] + num_tokens) - len(
            self._tables[seq_id]
        )

    def _need(self, blocks: int, what: str) -> None:
        if blocks > self.num_free_blocks:
            raise ValueError(
                f"{what} needs {blocks} KV cache blocks, {self.num_free_blocks} of "
                f"{self.num_blocks} are free"
            )
