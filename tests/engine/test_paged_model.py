"""A whole tiny model (IndexShare full / shared / full layers and the MTP layer) over the paged cache against the
same model over the dense KV cache, float32 on CPU, at TP 1 and TP 2 (heads split, cache replicated): chunked
prefills on top of cached contexts beside decodes, contexts below and above index_topk; and the
CUDA-graph-style decode view (fixed shapes, a pad row in the scratch block) against the eager view."""

import torch

from spmoe.distributed import get_parallel_state, spawn

from ..conftest import relative_error
from .conftest import ENGINE_CONFIG

TOPK = 8
CONFIG = {**ENGINE_CONFIG, "index_topk": TOPK, "kv_lora_rank": 128}
# (sequence, new tokens) per step; final contexts 6 (< topk), 41 and 75 (> topk, over two blocks)
STEPS = [
    [(0, 4), (1, 30), (2, 50)],
    [(2, 22), (0, 1), (1, 9)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1), (1, 1)],
]


def paged_against_dense(folder: str) -> dict:
    from spmoe.config import ParallelConfig
    from spmoe.engine.cache.blocks import BlockManager
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(
        folder, ParallelConfig(tensor_parallel_size=get_parallel_state().tp_size), with_mtp=True
    )
    dense, paged = KVCache.for_model(model, 3, 80), PagedKVCache.for_model(model, 2**22)
    blocks = BlockManager(paged.num_blocks, BLOCK_SIZE)
    blocks.allocate(99, BLOCK_SIZE + 1)  # the sequences' blocks are not the first ones
    slots, cached, gen, errors = (
        [dense.allocate() for _ in range(3)],
        [0, 0, 0],
        torch.Generator().manual_seed(0),
        [],
    )
    with torch.no_grad():
        for step in STEPS:
            seqs, lens = [s for s, _ in step], [n for _, n in step]
            for s, n in step:
                blocks.grow(s, n) if s in blocks else blocks.allocate(s, n)
            ids = torch.randint(0, CONFIG["vocab_size"], (sum(lens),), generator=gen)
            starts = [cached[s] for s in seqs]
            out = {}
            for name, view in (
                ("dense", dense.view([slots[s] for s in seqs], starts, lens)),
                ("paged", paged.view([blocks.block_table(s) for s in seqs], starts, lens)),
            ):
                hidden = model.forward_hidden(ids, view.positions, lens, view)
                draft = model.forward_draft_hidden(ids, view.positions, hidden, lens, view)
                out[name] = (model.compute_logits(hidden), model.compute_draft_logits(draft))
            errors.append([relative_error(p, d) for p, d in zip(out["paged"], out["dense"])])
            for s, n in step:
                cached[s] += n
        # one more decode step, as a CUDA graph would run it: fixed-width block tables, plus a pad row
        tables = [blocks.block_table(s) for s in range(3)]
        view = paged.view(tables, cached, [1, 1, 1])
        ids = torch.tensor([5, 6, 7])
        want = model(ids, view.positions, [1, 1, 1], view)
        width = 4  # the same step again (it rewrites the same rows) over the static view
        padded = torch.tensor(
            [t + [paged.scratch_block] * (width - len(t)) for t in tables]
            + [[paged.scratch_block] * width],
            dtype=torch.int32,
        )
        positions = torch.tensor(cached + [0])
        static = paged.decode_view(padded, torch.arange(4), positions)
        got = model(torch.cat([ids, torch.zeros(1, dtype=torch.long)]), positions, [1] * 4, static)[
            :3
        ]
    return {"steps": errors, "static": relative_error(got, want)}


def test_paged_model_equals_dense(tmp_path):
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, CONFIG, tmp_path, 1)
    for tp in (1, 2):
        ranks = spawn(paged_against_dense, tp, str(tmp_path))
        got = ranks[0]
        print(tp, got)
        for step, (target, draft) in enumerate(got["steps"]):
            assert target < 1e-5 and draft < 1e-5, (tp, step, target, draft)
        assert got["static"] < 1e-5, (tp, got["static"])
        assert all(rank == got for rank in ranks[1:]), f"TP {tp}: ranks disagree"
