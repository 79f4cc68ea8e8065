"""Accounting for the paged KV cache's blocks: which blocks are free, and each sequence's block table.

The cache is a pool of `num_blocks` blocks of `block_size` tokens, shared by all sequences. Sequence `seq_id`
owns a block table: its logical block i (positions `[i * block_size, (i + 1) * block_size)`) lives in
physical block `table[i]`. A sequence holds room for `reserved(seq_id)` tokens, always within its blocks.

The scheduler asks before it acts: `can_allocate(n)` before admitting a prompt of n tokens (else it waits),
`can_grow(seq_id, n)` before a running sequence takes n more tokens (else one is preempted: `free` gives back
all its blocks, and it is recomputed later). Pure Python, no tensors: the engine turns the tables into the
step's device tensors.
"""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the block manager needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}

    # -- queries --------------------------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits in the free blocks now."""
        return self.blocks_for(num_tokens) <= len(self._free)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        """Whether sequence `seq_id` can take `num_tokens` more tokens (its last block's room, then free ones)."""
        return self._extra_blocks(seq_id, num_tokens) <= len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block of each logical block of `seq_id`."""
        return self._tables[self._check(seq_id)]

    def reserved(self, seq_id: int) -> int:
        """Tokens `seq_id` has room for."""
        return self._reserved[self._check(seq_id)]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    # -- changes ----------------------------------------------------------------------------------------------

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Room for a new sequence's first `num_tokens` tokens -> its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds {len(self._tables[seq_id])} blocks")
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least 1 token, got {num_tokens}")
        self._take(self.blocks_for(num_tokens), f"a new sequence of {num_tokens} tokens")
        self._tables[seq_id] = [self._free.pop() for _ in range(self.blocks_for(num_tokens))]
        self._reserved[seq_id] = num_tokens
        return self._tables[seq_id]

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Room for `num_tokens` more tokens of `seq_id` -> its block table (grown in place)."""
        if num_tokens < 0:
            raise ValueError(f"a sequence grows by >= 0 tokens, got {num_tokens}")
        extra = self._extra_blocks(seq_id, num_tokens)
        self._take(extra, f"{num_tokens} more tokens of sequence {seq_id}")
        self._tables[seq_id].extend(self._free.pop() for _ in range(extra))
        self._reserved[seq_id] += num_tokens
        return self._tables[seq_id]

    def free(self, seq_id: int) -> None:
        """Give back every block of `seq_id` (finished, aborted or preempted)."""
        self._free.extend(reversed(self._tables.pop(self._check(seq_id))))
        del self._reserved[seq_id]

    # -- helpers ----------------------------------------------------------------------------------------------

    def _check(self, seq_id: int) -> int:
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id} holds no blocks")
        return seq_id

    def _extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        return self.blocks_for(self._reserved[self._check(seq_id)] + num_tokens) - len(self._tables[seq_id])

    def _take(self, blocks: int, what: str) -> None:
        if blocks > len(self._free):
            raise ValueError(f"{what} needs {blocks} KV cache blocks, {len(self._free)} of {self.num_blocks} are free")
