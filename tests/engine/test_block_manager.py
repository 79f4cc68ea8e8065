"""The paged cache's block accounting: allocation, growth across block boundaries, exhaustion, preemption
(free everything, allocate again), usage figures and bad calls."""

import pytest

from spmoe.engine.block_manager import BlockManager


def test_allocate_grow_free():
    blocks = BlockManager(num_blocks=5, block_size=4)
    assert blocks.capacity_tokens == 20 and blocks.usage == 0
    assert blocks.allocate(7, 5) == [0, 1]  # 5 tokens: 2 blocks
    assert blocks.reserved(7) == 5 and blocks.num_used_blocks == 2 and blocks.usage == 0.4
    assert blocks.can_grow(7, 3) and blocks.grow(7, 3) == [0, 1]  # 8 tokens still fit in 2 blocks
    assert blocks.grow(7, 1) == [0, 1, 2]  # the 9th opens a third
    assert blocks.allocate(8, 1) == [3] and blocks.num_free_blocks == 1
    assert blocks.grow(8, 0) == [3]
    assert not blocks.can_allocate(5) and blocks.can_allocate(4)
    assert not blocks.can_grow(7, 8) and blocks.can_grow(7, 7)  # 9 + 7 = 16 tokens = 4 blocks
    blocks.free(7)
    assert blocks.num_free_blocks == 4 and 7 not in blocks and 8 in blocks
    assert blocks.allocate(9, 16) == [0, 1, 2, 4]  # the blocks freed last come back first
    assert blocks.usage == 1 and not blocks.can_allocate(1) and not blocks.can_grow(8, 4) and blocks.can_grow(8, 3)


def test_preempted_sequence_frees_all_and_comes_back():
    blocks = BlockManager(num_blocks=4, block_size=2)
    blocks.allocate(0, 3)
    blocks.allocate(1, 4)
    assert not blocks.can_grow(1, 1)  # the running sequence cannot grow: the scheduler preempts one
    blocks.free(0)
    assert blocks.can_grow(1, 1) and blocks.grow(1, 1) == [2, 3, 0]
    assert not blocks.can_allocate(3) and blocks.can_allocate(2)  # the preempted one waits for room
    blocks.free(1)
    assert blocks.num_free_blocks == 4 and sorted(blocks.allocate(0, 8)) == [0, 1, 2, 3]


def test_bad_calls_raise_clear_errors():
    blocks = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="a new sequence of 9 tokens needs 3 KV cache blocks, 2 of 2 are free"):
        blocks.allocate(0, 9)
    assert blocks.num_free_blocks == 2  # a refused allocation takes nothing
    blocks.allocate(0, 4)
    with pytest.raises(ValueError, match="sequence 0 already holds 1 blocks"):
        blocks.allocate(0, 1)
    with pytest.raises(ValueError, match="5 more tokens of sequence 0 needs 2 KV cache blocks, 1 of 2 are free"):
        blocks.grow(0, 5)
    assert blocks.reserved(0) == 4 and blocks.block_table(0) == [0]  # a refused growth changes nothing
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
