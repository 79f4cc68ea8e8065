"""The scheduler over a real paged cache's blocks, without a model: decode tokens first, prompt chunks under
the token budget, admission only into free blocks, and preemption of the most recently admitted sequence
(its blocks freed, queued first, to be recomputed from its prompt and the tokens it generated)."""

import torch

from spmoe.config import ModelConfig
from spmoe.engine.paged_cache import BLOCK_SIZE, PagedKVCache, token_bytes
from spmoe.engine.request import Request
from spmoe.engine.sampling import Sampler, SamplingParams
from spmoe.engine.scheduler import BlockRoom, Scheduler, Sequence

from .conftest import ENGINE_CONFIG


def sequence(name: str, prompt_len: int) -> Sequence:
    return Sequence(Request(name, list(range(1, prompt_len + 1)), 20), Sampler(SamplingParams()))


def feed(work: list[tuple[Sequence, int]], token: int = 7) -> None:
    """What the engine does after a step without drafts: advance each sequence by what it fed; one that fed
    all its pending tokens commits `token`."""
    for seq, n in work:
        if n == len(seq.pending):
            seq.cached, seq.prefilling = seq.cached + n, False
            seq.output.append(token)
            seq.pending = [token]
        else:
            seq.cached, seq.pending = seq.cached + n, seq.pending[n:]


def test_chunks_admission_and_preemption():
    cfg = ModelConfig.from_dict(ENGINE_CONFIG)
    cache = PagedKVCache(
        cfg, {0: True}, 3 * BLOCK_SIZE * token_bytes(cfg, {0: True}, torch.float32, "auto"), torch.float32, "cpu"
    )
    room = BlockRoom(cache, max_num_seqs=8)
    scheduler = Scheduler(room, max_num_batched_tokens=100)
    a, b, c = sequence("a", 64), sequence("b", 64), sequence("c", 64)
    for seq in (a, b, c):
        scheduler.add(seq)

    work = scheduler.schedule()  # a whole, b's first 36 tokens; c: no budget left
    assert [(s.request_id, n) for s, n in work] == [("a", 64), ("b", 36)]
    assert [s.request_id for s in scheduler.waiting] == ["c"] and room.blocks.num_used_blocks == 2
    feed(work)
    assert a.output == [7] and b.output == [] and b.cached == 36

    work = scheduler.schedule()  # a decodes into a second block, b's last 28; c finds no free block
    assert [(s.request_id, n) for s, n in work] == [("a", 1), ("b", 28)]
    assert room.blocks.num_free_blocks == 0 and [s.request_id for s in scheduler.waiting] == ["c"]
    feed(work)

    work = scheduler.schedule()  # b needs a second block for its 65th token: b, the latest admitted, yields
    assert [(s.request_id, n) for s, n in work] == [("a", 1)]
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"] and scheduler.preemptions == 1
    assert b.cached == 0 and b.prefilling and b.pending == list(range(1, 65)) + [7] and b.output == [7]
    assert room.blocks.num_used_blocks == 2  # a's; b's block is free again
    scheduler.finish(a, "length")
    work = scheduler.schedule()  # b first again, recomputing its 65 tokens; c in what budget is left
    assert [(s.request_id, n) for s, n in work] == [("b", 65), ("c", 35)]
    assert room.blocks.num_used_blocks == 3
