"""The scheduler over a real paged cache's blocks, without a model: decode tokens first, prompt chunks under
the token budget, admission only into free blocks, and preemption of the most recently admitted sequence
(its blocks freed, queued first, to be recomputed from its prompt and the tokens it generated); `update`
committing hand-made step results: eos, length, non-finite logits, drafts accepted and rejected, a prompt
chunk that does not sample; prefix caching: admission with the cached prefix (a shared head, an exact block
multiple, the whole prompt), chunks continuing from it, a preempted sequence finding its own blocks again, and
eviction of unreferenced cached blocks when room is needed; a scheduler following another's admissions."""

import pytest
import torch

from spmoe.config import ModelConfig
from spmoe.engine.paged_cache import BLOCK_SIZE, PagedKVCache, token_bytes
from spmoe.engine.request import Request
from spmoe.engine.sampling import Sampler
from spmoe.engine.scheduler import BlockRoom, Scheduler
from spmoe.engine.sequence import ScheduledBatch, Sequence, StepResult

from .conftest import ENGINE_CONFIG


def sequence(name: str, prompt_len: int, max_new_tokens: int = 20, eos: tuple[int, ...] = ()) -> Sequence:
    return Sequence(Request(name, list(range(1, prompt_len + 1)), max_new_tokens, eos_token_ids=eos))


def sampler_for(room: BlockRoom) -> Sampler:
    return Sampler(room.max_num_seqs, ENGINE_CONFIG["vocab_size"])


def paged_room(num_blocks: int, prefix_caching: bool = False) -> BlockRoom:
    cfg = ModelConfig.from_dict(ENGINE_CONFIG)
    bytes_per_token = token_bytes(cfg, {0: True}, torch.float32, "auto")
    cache = PagedKVCache(cfg, {0: True}, num_blocks * BLOCK_SIZE * bytes_per_token, torch.float32, "cpu")
    return BlockRoom(cache, 8, enable_prefix_caching=prefix_caching)


def pairs(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)]


def feed(scheduler: Scheduler, batch: ScheduledBatch, token: int = 7) -> None:
    """A step without drafts: every sequence that samples commits `token`."""
    n = len(batch.seqs)
    result = StepResult([[token] if last else [] for last in batch.samples], [0] * n, [True] * n)
    scheduler.update(batch, result)


def test_chunks_admission_and_preemption():
    room = paged_room(3)  # no prefix caching: b recomputes (see test_preempted_sequence_finds_its_blocks_again)
    scheduler = Scheduler(room, sampler_for(room), max_num_batched_tokens=100)
    a, b, c = sequence("a", 64), sequence("b", 64), sequence("c", 64)
    for seq in (a, b, c):
        scheduler.add(seq)

    batch = scheduler.schedule()  # a whole, b's first 36 tokens; c: no budget left
    assert pairs(batch) == [("a", 64), ("b", 36)] and batch.samples == [True, False] and not batch.decode
    assert [s.request_id for s in scheduler.waiting] == ["c"] and room.blocks.num_used_blocks == 2
    feed(scheduler, batch)
    assert a.output == [7] and b.output == [] and b.cached == 36

    batch = scheduler.schedule()  # a decodes into a second block, b's last 28; c finds no free block
    assert pairs(batch) == [("a", 1), ("b", 28)] and batch.starts == [64, 36]
    assert room.blocks.num_free_blocks == 0 and [s.request_id for s in scheduler.waiting] == ["c"]
    feed(scheduler, batch)

    batch = scheduler.schedule()  # b needs a second block for its 65th token: b, the latest admitted, yields
    assert pairs(batch) == [("a", 1)] and batch.decode and batch.step == 3
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"] and scheduler.preemptions == 1
    assert b.cached == 0 and b.prefilling and b.pending == list(range(1, 65)) + [7] and b.output == [7]
    assert room.blocks.num_used_blocks == 2  # a's; b's block is free again
    scheduler.finish(a, "length")
    batch = scheduler.schedule()  # b first again, recomputing its 65 tokens; c in what budget is left
    assert pairs(batch) == [("b", 65), ("c", 35)]
    assert room.blocks.num_used_blocks == 3


def test_nothing_to_run():
    """An empty scheduler has no step to run, unless the DP ranks must keep in step: then an empty batch."""
    assert Scheduler(paged_room(1), Sampler(8, 16)).schedule() is None
    batch = Scheduler(paged_room(1), Sampler(8, 16), keep_in_step=True).schedule()
    assert batch.seqs == [] and batch.step == 1


def test_update_commits_a_hand_made_result():
    """No model: each sequence's result is written by hand and `update` must commit it."""
    room = paged_room(8)
    scheduler = Scheduler(room, sampler_for(room), reserve_tokens=2, max_num_batched_tokens=100)
    chunk = sequence("chunk", 100)  # 100 - 4 - 3 - 1 - 1 = 91 tokens of budget left for it: a chunk
    eos = sequence("eos", 4, eos=(50,))
    length = sequence("length", 3, max_new_tokens=2)
    nan = sequence("nan", 1)
    spec = sequence("spec", 1)
    for seq in (eos, length, nan, spec, chunk):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert pairs(batch) == [("eos", 4), ("length", 3), ("nan", 1), ("spec", 1), ("chunk", 91)]
    assert batch.samples == [True, True, True, True, False]
    length.output = [9]  # one token short of its limit
    result = StepResult(
        token_ids=[[40, 50, 60], [11, 12], [0], [21], []],  # eos and length: cut after the stopping token
        accepted=[0, 0, 0, 0, 0],
        finite=[True, True, False, True, True],
        drafts=[[], [], [], [22, 23], []],
    )
    outputs = scheduler.update(batch, result)
    got = {o.request_id: (o.new_token_ids, o.finish_reason, o.prompt_tokens) for o in outputs}
    assert got == {
        "eos": ([40, 50], "stop", 4),
        "length": ([11], "length", 3),
        "nan": ([], "error", 1),
        "spec": ([21], None, 1),
    }  # the chunk that did not sample has no output
    assert eos.output == [40, 50] and length.output == [9, 11] and nan.output == []
    assert nan.error.startswith("non-finite logits (NaN or inf) at step 1 (prefill) for request 'nan' after 0")
    assert [s.request_id for s in scheduler.running] == ["spec", "chunk"]  # the finished ones left, room freed
    assert all(s.cache_id == -1 for s in (eos, length, nan))
    assert (spec.cached, spec.pending, spec.drafts) == (1, [21, 22, 23], [22, 23])
    assert (chunk.cached, chunk.pending, chunk.output) == (91, list(range(92, 101)), [])

    batch = scheduler.schedule()  # spec verifies its drafts; the chunk's last 9 tokens
    assert pairs(batch) == [("spec", 3), ("chunk", 9)] and batch.starts == [1, 91] and batch.samples == [True] * 2
    # spec: the target accepts 22, rejects 23 and picks 30 there; its next drafts 31, 32
    result = StepResult([[22, 30], [70]], [1, 0], [True, True], [[31, 32], [71, 72]])
    scheduler.update(batch, result)
    assert (spec.cached, spec.pending, spec.drafts, spec.output) == (3, [30, 31, 32], [31, 32], [21, 22, 30])
    assert (chunk.cached, chunk.pending, chunk.drafts, chunk.output) == (100, [70, 71, 72], [71, 72], [70])

    batch = scheduler.schedule()  # spec: both drafts rejected, one token; chunk: both accepted and a bonus
    scheduler.update(batch, StepResult([[33], [71, 72, 73]], [0, 2], [True, True], [[34, 35], [74, 75]]))
    assert (spec.cached, spec.pending, spec.output[-1]) == (4, [33, 34, 35], 33)
    assert (chunk.cached, chunk.pending, chunk.output) == (103, [73, 74, 75], [70, 71, 72, 73])


def test_prefix_cache_admission():
    room = paged_room(6, prefix_caching=True)
    scheduler = Scheduler(room, sampler_for(room), max_num_batched_tokens=100)
    a = sequence("a", 130, max_new_tokens=3)
    scheduler.add(a)
    batch = scheduler.schedule()
    assert pairs(batch) == [("a", 100)] and batch.starts == [0]
    feed(scheduler, batch)  # positions 0-99 written: block 0 cached
    assert room.blocks.num_cached_blocks == 1
    feed(scheduler, scheduler.schedule())  # the last 30 and a first token: block 1 cached too
    assert room.blocks.num_cached_blocks == 2 and room.prefix_cache_counts() == (130, 0)

    # b: a's first 128 tokens, then its own; c: exactly a's first 128 tokens (a block multiple), whose last
    # token must be computed; d: a's whole prompt
    b = Sequence(Request("b", list(range(1, 129)) + [500, 501], 3))
    c, d = sequence("c", 128, max_new_tokens=3), sequence("d", 130, max_new_tokens=3)
    for seq in (b, c, d):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert pairs(batch) == [("a", 1), ("b", 2), ("c", 64), ("d", 2)]
    assert batch.starts == [130, 128, 64, 128] and batch.samples == [True] * 4
    tables = batch.locations
    assert tables[1][:2] == tables[0][:2] and tables[2][:1] == tables[0][:1] and tables[3][:2] == tables[0][:2]
    assert room.prefix_cache_counts() == (130 + 130 + 128 + 130, 128 + 64 + 128)
    feed(scheduler, batch)
    for seq in (a, b, c, d):
        scheduler.finish(seq, "length")
    # a's two; c computed a copy of a's second block, which stays uncached (its hash is taken)
    assert room.blocks.num_used_blocks == 0 and room.blocks.num_cached_blocks == 2

    # a new prompt that needs every block evicts the cached ones: a's prompt then finds nothing
    e = Sequence(Request("e", [900 + i % 50 for i in range(6 * BLOCK_SIZE - 1)], 1))
    scheduler.add(e)
    scheduler.max_num_batched_tokens = 6 * BLOCK_SIZE
    assert pairs(scheduler.schedule()) == [("e", 6 * BLOCK_SIZE - 1)]
    assert room.blocks.num_cached_blocks == 0 and room.blocks.cached_prefix(a.request.prompt) == 0


def test_preempted_sequence_finds_its_blocks_again():
    """The preemption of `test_chunks_admission_and_preemption` with prefix caching: b (a's prompt) is
    preempted for a's second block, and comes back at once holding the cached prompt block, feeding 1 token."""
    room = paged_room(3, prefix_caching=True)
    scheduler = Scheduler(room, sampler_for(room), max_num_batched_tokens=100)
    a, b = sequence("a", 64), sequence("b", 64)
    scheduler.add(a)
    scheduler.add(b)
    feed(scheduler, scheduler.schedule())
    feed(scheduler, scheduler.schedule())
    assert room.blocks.num_cached_blocks == 1  # a's and b's prompt blocks are equal: one is cached
    batch = scheduler.schedule()
    assert scheduler.preemptions == 1 and b.preemptions == 1
    assert pairs(batch) == [("a", 1), ("b", 1)] and batch.starts == [65, 64]
    assert batch.locations[1][0] == batch.locations[0][0]  # b holds a's cached block
    assert room.prefix_cache_counts() == (64 + 64 + 65, 64)


def test_a_twin_waits_for_the_prompt_blocks_it_shares():
    room = paged_room(8, prefix_caching=True)
    scheduler = Scheduler(room, sampler_for(room), max_num_batched_tokens=300)
    choices = [sequence(f"n{i}", 130, max_new_tokens=3) for i in range(3)]  # the same prompt: n = 3
    other = sequence("other", 20)
    for seq in (*choices, other):
        scheduler.add(seq)
    batch = scheduler.schedule()  # the first choice alone; the others (and what queues behind) wait for it
    assert pairs(batch) == [("n0", 130)]
    feed(scheduler, batch)  # its prompt written: blocks 0 and 1 cached
    batch = scheduler.schedule()
    assert pairs(batch) == [("n0", 1), ("n1", 2), ("n2", 2), ("other", 20)]  # the twins compute 2 tokens each
    assert batch.starts[1:3] == [128, 128] and room.blocks.num_used_blocks == 3 + 1 + 1 + 1
    assert room.location(choices[1])[:2] == room.location(choices[0])[:2] == room.location(choices[2])[:2]


def test_a_follower_admits_what_the_decider_admits():
    """Two schedulers as two ranks: the decider's admissions (request id, tokens reused) make the follower's
    batch; admissions in another order than its waiting queue are a one-line error."""
    rooms = [paged_room(6, prefix_caching=True) for _ in range(2)]
    decider, follower = (Scheduler(room, sampler_for(room), max_num_batched_tokens=100) for room in rooms)
    for scheduler in (decider, follower):
        scheduler.add(sequence("a", 130))
        for _ in range(2):
            feed(scheduler, scheduler.schedule())  # a: 100 tokens, then 30 and its first token
        scheduler.add(sequence("b", 140))  # its first two blocks are a's
        scheduler.add(sequence("c", 10))
    batch = decider.schedule()
    assert batch.admissions == [("b", 128), ("c", 0)] and pairs(batch) == [("a", 1), ("b", 12), ("c", 10)]
    followed = follower.schedule(batch.admissions)
    assert (
        pairs(followed) == pairs(batch) and followed.starts == batch.starts and followed.admissions == batch.admissions
    )
    assert followed.locations == batch.locations and rooms[1].prefix_cache_counts() == (280, 128)
    # the follower refuses admissions it cannot follow (budget: 100 - a's decode token - b's 12 - c's 10)
    for scheduler in (decider, follower):
        scheduler.add(sequence("d", 70))
        scheduler.add(sequence("e", 70))
    with pytest.raises(RuntimeError) as error:
        follower.schedule([("e", 0)])
    assert str(error.value) == (
        "the deciding rank admits request 'e' with 0 cached tokens, but this rank's next waiting request is "
        "'d', with 77 tokens of budget and 3 of 8 sequences running: the ranks diverged"
    )
