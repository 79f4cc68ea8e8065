"""The paged cache's block accounting: allocation, growth across block boundaries, exhaustion, preemption
(free everything, allocate again), usage figures and bad calls; the prefix cache: the hash chain, hits of
shared prefixes of every length against a model of what each cache row holds, LRU eviction, forks, and no
leaked block after 1000 random requests with aborts and preemptions."""

import hashlib
import random
import struct

import pytest

from spmoe.engine.cache.blocks import BlockManager, block_hash


def test_allocate_grow_free():
    blocks = BlockManager(num_blocks=5, block_size=4)
    assert blocks.capacity_tokens == 20 and blocks.usage == 0
    assert blocks.allocate(7, 5) == 0 and blocks.block_table(7) == [0, 1]  # 5 tokens: 2 blocks
    assert blocks.reserved(7) == 5 and blocks.num_used_blocks == 2 and blocks.usage == 0.4
    assert blocks.can_grow(7, 3) and blocks.grow(7, 3) == [0, 1]  # 8 tokens still fit in 2 blocks
    assert blocks.grow(7, 1) == [0, 1, 2]  # the 9th opens a third
    assert (
        blocks.allocate(8, 1) == 0 and blocks.block_table(8) == [3] and blocks.num_free_blocks == 1
    )
    assert blocks.grow(8, 0) == [3]
    assert not blocks.can_allocate(5) and blocks.can_allocate(4)
    assert not blocks.can_grow(7, 8) and blocks.can_grow(7, 7)  # 9 + 7 = 16 tokens = 4 blocks
    blocks.free(7)
    assert blocks.num_free_blocks == 4 and 7 not in blocks and 8 in blocks
    blocks.allocate(9, 16)
    assert blocks.block_table(9) == [0, 1, 2, 4]  # the blocks freed last come back first
    assert (
        blocks.usage == 1
        and not blocks.can_allocate(1)
        and not blocks.can_grow(8, 4)
        and blocks.can_grow(8, 3)
    )


def test_preempted_sequence_frees_all_and_comes_back():
    blocks = BlockManager(num_blocks=4, block_size=2)
    blocks.allocate(0, 3)
    blocks.allocate(1, 4)
    assert not blocks.can_grow(1, 1)  # the running sequence cannot grow: the scheduler preempts one
    blocks.free(0)
    assert blocks.can_grow(1, 1) and blocks.grow(1, 1) == [2, 3, 0]
    assert not blocks.can_allocate(3) and blocks.can_allocate(2)  # the preempted one waits for room
    blocks.free(1)
    blocks.allocate(0, 8)
    assert blocks.num_free_blocks == 0 and sorted(blocks.block_table(0)) == [0, 1, 2, 3]


def test_bad_calls_raise_clear_errors():
    blocks = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(
        ValueError,
        match=r"a new sequence of 9 tokens \(0 cached\) needs 3 KV cache blocks, 2 of 2 are free",
    ):
        blocks.allocate(0, 9)
    assert blocks.num_free_blocks == 2  # a refused allocation takes nothing
    blocks.allocate(0, 4)
    with pytest.raises(ValueError, match="sequence 0 already holds 1 blocks"):
        blocks.allocate(0, 1)
    with pytest.raises(
        ValueError, match="5 more tokens of sequence 0 needs 2 KV cache blocks, 1 of 2 are free"
    ):
        blocks.grow(0, 5)
    # a refused growth changes nothing
    assert blocks.reserved(0) == 4 and blocks.block_table(0) == [0]
    with pytest.raises(KeyError, match="sequence 3 holds no blocks"):
        blocks.free(3)
    with pytest.raises(KeyError, match="sequence 3 holds no blocks"):
        blocks.can_grow(3, 1)
    with pytest.raises(ValueError, match="at least 1 token, got 0"):
        blocks.allocate(1, 0)
    with pytest.raises(ValueError, match="grows by >= 0 tokens, got -1"):
        blocks.grow(0, -1)
    with pytest.raises(ValueError, match="num_blocks >= 1 and block_size >= 1, got 0 and 64"):
        BlockManager(0, 64)
    with pytest.raises(ValueError, match="lookahead must be >= 0 tokens, got -1"):
        BlockManager(4, 4, lookahead=-1)


# -- the prefix cache ---------------------------------------------------------------------------------------


class Rows:
    """A model of the cache's rows: each row records the token ids it was computed from (with `lookahead`, the
    MTP layer's row at p also embeds token p + 1), so a reused block can be checked against recomputing it."""

    def __init__(self, blocks: BlockManager):
        self.blocks, self.rows = blocks, {}

    def write(self, seq_id: int, tokens: list[int], start: int, end: int) -> None:
        """`seq_id` computes positions [start, end) of `tokens` and tells the manager."""
        table = self.blocks.block_table(seq_id)
        for p in range(start, end):
            block = table[p // self.blocks.block_size]
            # a row is written only in a block its sequence holds alone and that is not cached
            assert self.blocks._refs[block] == 1 and block not in self.blocks._hash_of, (
                seq_id,
                p,
                block,
            )
            self.rows[block, p % self.blocks.block_size] = tuple(
                tokens[: p + 1 + self.blocks.lookahead]
            )
        self.blocks.cache_blocks(seq_id, tokens, end)

    def check(self, seq_id: int, tokens: list[int], cached: int) -> None:
        """The rows of `seq_id`'s first `cached` positions are what computing them from `tokens` gives."""
        table, size = self.blocks.block_table(seq_id), self.blocks.block_size
        for p in range(cached):
            assert self.rows[table[p // size], p % size] == tuple(
                tokens[: p + 1 + self.blocks.lookahead]
            ), (seq_id, p)


def audit(blocks: BlockManager, tables: dict[int, list[int]]) -> None:
    """Every block is exactly one of: free and uncached, cached and held by nobody, or held by as many
    sequences as its reference count says; the hash maps are each other's inverse."""
    held = [0] * blocks.num_blocks
    for seq_id, table in tables.items():
        assert blocks.block_table(seq_id) == table
        assert len(set(table)) == len(table), seq_id
        for block in table:
            held[block] += 1
    assert blocks._refs == held
    free, evictable = set(blocks._free), set(blocks._evictable)
    assert len(free) == len(blocks._free) and not free & evictable
    assert free | evictable == {b for b in range(blocks.num_blocks) if not held[b]}
    assert evictable <= set(blocks._hash_of) and not free & set(blocks._hash_of)
    assert {h: b for b, h in blocks._hash_of.items()} == blocks._block_of
    assert blocks.num_used_blocks == sum(1 for n in held if n)


def test_hash_chain():
    tokens = [3, 1, 4, 1]
    first = block_hash(None, tokens)
    assert first == hashlib.sha256(struct.pack("<4q", *tokens)).digest()
    assert block_hash(first, [5, 9]) == hashlib.sha256(first + struct.pack("<2q", 5, 9)).digest()
    assert block_hash(first, tokens) != first  # the same tokens under a parent are another block
    assert block_hash(None, [1, 3, 4, 1]) != first and block_hash(None, [3, 1, 4, 1, 5]) != first

    # equal second blocks under different first blocks: no hit (the chain carries the whole prefix)
    blocks = BlockManager(8, 2, enable_caching=True)
    rows = Rows(blocks)
    a = [1, 2, 3, 4, 5]
    blocks.allocate(0, 5, a)
    rows.write(0, a, 0, 5)
    blocks.free(0)
    assert blocks.num_cached_blocks == 2 and blocks.cached_prefix(a) == 4
    assert blocks.cached_prefix([9, 9, 3, 4, 5]) == 0 and blocks.cached_prefix([1, 2, 9, 4, 5]) == 2
    # with a lookahead token the first block is keyed by the token after it too
    blocks = BlockManager(8, 2, enable_caching=True, lookahead=1)
    rows = Rows(blocks)
    blocks.allocate(0, 5, a)
    rows.write(0, a, 0, 5)
    blocks.free(0)
    assert blocks.num_cached_blocks == 2  # [1, 2] + 3, [3, 4] + 5; [5] is not full
    assert blocks.cached_prefix(a) == 4 and blocks.cached_prefix([1, 2, 9, 4, 5]) == 0
    assert blocks.cached_prefix([1, 2, 3, 4]) == 2  # [3, 4]'s lookahead is not in this prompt


def expected_hit(first: list[int], second: list[int], size: int, lookahead: int) -> int:
    """Tokens of `second` a cache holding all of `first` gives back: whole blocks whose tokens and lookahead
    agree, that `first` had the lookahead of, and that end before `second`'s last token."""
    blocks = 0
    while True:
        end = (blocks + 1) * size
        if (
            end + lookahead > len(first)
            or end > len(second) - 1
            or first[: end + lookahead] != second[: end + lookahead]
        ):
            return blocks * size
        blocks += 1


@pytest.mark.parametrize("lookahead", [0, 1])
def test_hits_of_every_shared_prefix_length(lookahead):
    size, rng = 4, random.Random(lookahead)
    for first_len in (3 * size, 3 * size + 1):
        first = [rng.randrange(50) for _ in range(first_len)]
        for shared in range(first_len + 1):
            # a prompt that leaves the first after `shared` tokens, and one that is its first `shared` tokens
            seconds = [
                first[:shared] + [50 + rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            ]
            seconds += [first[:shared]] if shared else []
            for second in seconds:
                blocks = BlockManager(16, size, enable_caching=True, lookahead=lookahead)
                rows = Rows(blocks)
                assert blocks.allocate(0, first_len, first) == 0
                rows.write(0, first, 0, first_len)
                blocks.free(0)
                want = expected_hit(first, second, size, lookahead)
                assert blocks.cached_prefix(second) == want, (first_len, shared, second)
                assert blocks.allocate(1, len(second), second) == want
                rows.check(1, second, want)
                rows.write(1, second, want, len(second))
                assert blocks.queries == first_len + len(second) and blocks.hits == want
                audit(blocks, {1: blocks.block_table(1)})
    # the whole prompt cached: all but the block holding its last token (exact block multiple or not)
    assert expected_hit(first, first, size, lookahead) == 3 * size
    assert expected_hit(first[: 2 * size], first[: 2 * size], size, 0) == size


def test_caching_off_finds_nothing():
    blocks = BlockManager(8, 2)
    a = [1, 2, 3, 4, 5]
    blocks.allocate(0, 5, a)
    blocks.cache_blocks(0, a, 5)
    blocks.free(0)
    assert blocks.num_cached_blocks == 0 and blocks.num_free_blocks == 8
    assert blocks.allocate(1, 5, a) == 0 and blocks.queries == 0 and blocks.hits == 0


def test_eviction_is_least_recently_used_and_tail_first():
    blocks = BlockManager(6, 2, enable_caching=True)
    rows = Rows(blocks)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 5]
    for seq_id, tokens in ((0, a), (1, b)):
        blocks.allocate(seq_id, 5, tokens)
        rows.write(seq_id, tokens, 0, 5)
        blocks.free(seq_id)  # a's blocks, then b's, go unreferenced
    assert (
        blocks.num_cached_blocks == 4
        and blocks.num_free_blocks == 6
        and blocks.num_used_blocks == 0
    )
    # a is used again, so b is now the least recently used
    assert blocks.allocate(2, 5, [1, 2, 3, 4, 9]) == 4
    blocks.free(2)
    assert blocks.num_cached_blocks == 4
    blocks.allocate(3, 8)  # 4 blocks: the 2 uncached free ones, then b's two, its last block first
    assert (
        blocks.cached_prefix(b) == 0
        and blocks.cached_prefix(a) == 4
        and blocks.num_cached_blocks == 2
    )
    blocks.grow(3, 2)  # one more: a's last block goes before its first
    assert blocks.cached_prefix(a) == 2 and blocks.num_cached_blocks == 1
    blocks.grow(3, 2)
    assert (
        blocks.cached_prefix(a) == 0
        and blocks.num_cached_blocks == 0
        and blocks.num_free_blocks == 0
    )
    blocks.free(3)
    audit(blocks, {})


def test_a_held_cached_block_is_shared_not_evicted():
    blocks = BlockManager(4, 2, enable_caching=True)
    rows = Rows(blocks)
    a = [1, 2, 3, 4, 5]
    blocks.allocate(0, 5, a)
    rows.write(0, a, 0, 5)
    # 1 fresh block with the hit, 3 without
    assert blocks.can_allocate(5, a) and not blocks.can_allocate(5)
    assert blocks.allocate(1, 5, a) == 4  # the two full blocks, held by both
    assert blocks.block_table(1)[:2] == blocks.block_table(0)[:2] and blocks.num_free_blocks == 0
    audit(blocks, {0: blocks.block_table(0), 1: blocks.block_table(1)})
    blocks.free(0)
    assert blocks.num_free_blocks == 1  # a's last block; the shared ones are still held
    blocks.allocate(2, 2)
    rows.check(1, a, 4)
    blocks.free(1)
    blocks.free(2)
    audit(blocks, {})


def test_reuse_follows_the_deciding_rank_or_fails_clearly():
    blocks = BlockManager(8, 2, enable_caching=True)
    rows = Rows(blocks)
    a = [1, 2, 3, 4, 5]
    blocks.allocate(0, 5, a)
    rows.write(0, a, 0, 5)
    assert blocks.cached_prefix(a) == 4
    # the deciding rank reused 2 tokens: this manager takes that block and no more, though it holds the next one
    assert (
        blocks.allocate(1, 5, a, reuse=2) == 2
        and blocks.block_table(1)[0] == blocks.block_table(0)[0]
    )
    assert blocks.block_table(1)[1] != blocks.block_table(0)[1] and blocks.hits == 2
    assert blocks.allocate(2, 5, a, reuse=0) == 0 and not set(blocks.block_table(2)) & set(
        blocks.block_table(0)
    )
    rows.check(1, a, 2)
    for seq_id in (0, 1, 2):
        blocks.free(seq_id)
    blocks.allocate(3, 16)  # every block: the cached ones are evicted
    blocks.free(3)
    with pytest.raises(
        RuntimeError,
        match="reuses 4 cached prompt tokens, but this rank's prefix cache holds only the first 0",
    ):
        blocks.allocate(4, 5, a, reuse=4)
    with pytest.raises(ValueError, match="a multiple of 2 below the prompt's length expected"):
        blocks.allocate(4, 5, a, reuse=3)
    with pytest.raises(ValueError, match="and 0 with prefix caching off"):
        BlockManager(6, 2).allocate(0, 5, a, reuse=2)
    assert 4 not in blocks
    audit(blocks, {})


@pytest.mark.parametrize("enable_caching", [False, True])
@pytest.mark.parametrize("lookahead", [0, 1])
def test_fork_shares_the_prompts_full_blocks(enable_caching, lookahead):
    """A fork holds the parent's full prompt blocks, but with lookahead the block whose last row embeds the token
    after the prompt (each fork's own first token); a partly filled block is its own."""
    blocks = BlockManager(8, 4, enable_caching=enable_caching, lookahead=lookahead)
    rows = Rows(blocks)
    prompt = list(range(8))  # two full blocks
    blocks.allocate(0, 9, prompt)
    rows.write(0, prompt + [20], 0, 8)  # the parent's prompt, and its first token known
    shared = 8 if lookahead == 0 else 4
    assert blocks.fork(0, 1, 8) == shared
    # its own first token: the shared rows are still what computing them gives
    child = prompt + [
        30,
        31,
    ]
    rows.check(1, child, shared)
    assert blocks.block_table(1)[: shared // 4] == blocks.block_table(0)[: shared // 4]
    blocks.grow(1, 1)
    rows.write(1, child, shared, 9)  # it computes the rest itself, in blocks of its own
    assert blocks.fork(0, 2, 6) == 4  # 6 tokens: the second block is partly filled
    assert blocks.block_table(2)[0] == blocks.block_table(0)[0]
    assert blocks.block_table(2)[1] not in blocks.block_table(0) + blocks.block_table(1)
    tables = {s: blocks.block_table(s) for s in (0, 1, 2)}
    audit(blocks, tables)
    assert (
        blocks.num_used_blocks
        == len({b for table in tables.values() for b in table})
        == 3 + (3 - shared // 4) + 1
    )
    blocks.free(0)
    with pytest.raises(
        ValueError, match="sequence 4 forks 8 tokens of sequence 2, which holds room for 6"
    ):
        blocks.fork(2, 4, 8)
    for seq_id in (1, 2):
        blocks.free(seq_id)
    audit(blocks, {})


def test_bad_prefix_calls_raise_clear_errors():
    blocks = BlockManager(8, 2, enable_caching=True)
    a = [1, 2, 3, 4, 5]
    blocks.allocate(0, 5, a)
    with pytest.raises(
        ValueError, match="sequence 0 wrote 6 positions; their token ids expected, got 5"
    ):
        blocks.cache_blocks(0, a, 6)
    blocks.cache_blocks(0, a, 5)
    blocks.free(0)
    with pytest.raises(
        ValueError, match="finds 4 prompt tokens cached .* more than 4 tokens expected, got 4"
    ):
        blocks.allocate(1, 4, a)
    # a refused allocation takes nothing
    assert blocks.num_used_blocks == 0 and blocks.num_cached_blocks == 2
    with pytest.raises(KeyError, match="sequence 7 holds no blocks"):
        blocks.fork(7, 8, 4)
    blocks.allocate(1, 5, a)
    with pytest.raises(ValueError, match="sequence 1 already holds 3 blocks"):
        blocks.fork(1, 1, 4)


@pytest.mark.parametrize("lookahead", [0, 1])
def test_no_leaked_block_after_1000_random_requests(lookahead):
    """A random scheduler over the manager: requests with prompts that share random prefixes of a few system
    prompts, admitted with their cached prefix, computed in random chunks, preempted when they cannot grow
    (recomputed later from what they had), aborted at random, forked; every hit is checked against the rows."""
    rng, size = random.Random(lookahead), 4
    blocks = BlockManager(24, size, enable_caching=True, lookahead=lookahead)
    rows = Rows(blocks)
    systems = [[rng.randrange(3) for _ in range(rng.randrange(1, 24))] for _ in range(4)]
    # (seq_id, all its tokens, how many are known: its prompt, or what it had when preempted, its hash memo)
    waiting = []
    running = {}  # seq_id -> [all its tokens, positions computed, prompt length]
    counts = dict(requests=0, preempted=0, aborted=0, forked=0, hits=0)
    next_id = 0
    while counts["requests"] < 1000 or waiting or running:
        action = rng.random()
        if action < 0.25 and counts["requests"] < 1000:
            prompt = rng.choice(systems)[: rng.randrange(24)] + [
                rng.randrange(3) for _ in range(rng.randrange(1, 6))
            ]
            waiting.append(
                (
                    next_id,
                    prompt + [rng.randrange(3) for _ in range(rng.randrange(8))],
                    len(prompt),
                    [],
                )
            )
            next_id, counts["requests"] = next_id + 1, counts["requests"] + 1
        elif action < 0.45 and waiting:
            seq_id, tokens, known, hashes = waiting[0]
            cached = blocks.cached_prefix(tokens[:known], hashes)
            assert cached == blocks.cached_prefix(tokens[:known])  # the memo changes nothing
            room = min(len(tokens), cached + rng.randrange(1, 9))
            if blocks.can_allocate(room, tokens[:known], hashes):
                waiting.pop(0)
                assert blocks.allocate(seq_id, room, tokens[:known], hashes) == cached
                rows.check(seq_id, tokens, cached)
                running[seq_id] = [tokens, cached, known, hashes]
                counts["hits"] += cached > 0
        elif action < 0.85 and running:
            seq_id = rng.choice(sorted(running))
            tokens, done, known, hashes = running[seq_id]
            n = min(rng.randrange(1, 9), len(tokens) - done)
            grow = max(0, done + n - blocks.reserved(seq_id))
            if not blocks.can_grow(seq_id, grow):  # preempted: recomputed later from what it has
                blocks.free(seq_id)
                del running[seq_id]
                waiting.insert(0, (seq_id, tokens, max(known, done), hashes))
                counts["preempted"] += 1
            else:
                blocks.grow(seq_id, grow)
                rows.write(seq_id, tokens, done, done + n)
                running[seq_id][1] = done + n
                if done + n == len(tokens):
                    blocks.free(seq_id)
                    del running[seq_id]
        elif action < 0.92 and (running or waiting):
            pool = sorted(running) + [w[0] for w in waiting]
            victim = rng.choice(pool)
            if victim in running:
                blocks.free(victim)
                del running[victim]
            else:
                waiting = [w for w in waiting if w[0] != victim]
            counts["aborted"] += 1
        elif running:
            parent = rng.choice(sorted(running))
            tokens, done, known, _ = running[parent]
            prompt = tokens[:known]
            # forks once the prompt is written
            if done < len(prompt) or not blocks.can_fork(len(prompt)):
                continue
            shared = blocks.fork(parent, next_id, len(prompt))
            assert shared == (len(prompt) - lookahead) // size * size
            child = prompt + [rng.randrange(3) for _ in range(rng.randrange(4))]
            rows.check(next_id, child, shared)
            running[next_id] = [child, shared, len(prompt), []]
            next_id, counts["forked"] = next_id + 1, counts["forked"] + 1
        audit(blocks, {s: blocks.block_table(s) for s in running})
    assert blocks.num_used_blocks == 0 and blocks.num_free_blocks == blocks.num_blocks
    assert (
        all(n == 0 for n in blocks._refs)
        and len(blocks._free) + len(blocks._evictable) == blocks.num_blocks
    )
    assert blocks.num_cached_blocks == len(blocks._evictable) > 0
    assert min(counts.values()) > 50, counts  # every path ran many times
    assert blocks.hits > 0 and blocks.queries > blocks.hits
