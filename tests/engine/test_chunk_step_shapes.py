"""A prompt chunk of one sequence in the fixed shape a chunk graph captures (`cuda_graphs.chunk_rows`: its
tokens, then pad rows in the all-scratch table row; `decode_hidden` over block tables wider than the
sequence's, the columns past its blocks holding another sequence's block), run eagerly on CPU in float32
against the engine's eager path over the same paged cache: the same hidden states and last-token logits, the
same cache rows written, and nothing written outside the chunk's rows and the scratch block. Chunks after a
cached context (within a block and from a block boundary), of 1 token, of exactly the graph's size, and a
whole short prompt."""

import torch

from spmoe.distributed import spawn

from .conftest import ENGINE_CONFIG
from .test_speculative_step_shapes import cache_state

WIDTH = 8  # blocks in the captured tables
STALE = 11  # a block another sequence holds, left in the table columns past this sequence's
# (context cached before the chunk, chunk tokens, the chunk graph's size)
CASES = ((130, 23, 32), (130, 1, 16), (130, 32, 32), (128, 16, 16), (0, 20, 32))


def chunk_cases(folder: str) -> list[dict]:
    from spmoe.config import ParallelConfig
    from spmoe.engine.cuda_graphs import chunk_rows, decode_hidden
    from spmoe.engine.paged_cache import BLOCK_SIZE, PagedKVCache
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig())
    cache = PagedKVCache.for_model(model, 2**22)
    gen = torch.Generator().manual_seed(0)
    vocab, table = ENGINE_CONFIG["vocab_size"], [5, 9, 2, 7]  # blocks out of order
    slot = lambda p: table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE  # noqa: E731
    may_write_scratch = set(range(cache.scratch_block * BLOCK_SIZE, (cache.scratch_block + 1) * BLOCK_SIZE))
    out = []
    with torch.no_grad():
        other = torch.randint(0, vocab, (BLOCK_SIZE,), generator=gen)  # the stale block holds real rows
        view = cache.view([[STALE]], [0], [BLOCK_SIZE])
        model.forward_hidden(other, view.positions, [BLOCK_SIZE], view)
        for context, n, size in CASES:
            if context:
                view = cache.view([table], [0], [context])
                prompt = torch.randint(0, vocab, (context,), generator=gen)
                model.forward_hidden(prompt, view.positions, [context], view)
            tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
            before = cache_state(cache)

            view = cache.view([table], [context], [n])  # the eager step
            eager = model.forward_hidden(torch.tensor(tokens), view.positions, [n], view)
            eager_logits = model.compute_logits(eager, torch.tensor([n - 1]))
            eager_state = cache_state(cache)
            for (layer, name), t in before.items():
                getattr(cache.layers[layer], name).copy_(t)

            tables = torch.full((2, WIDTH), cache.scratch_block, dtype=torch.int32)
            tables[0] = STALE
            tables[0, : len(table)] = torch.tensor(table)
            hidden = decode_hidden(model, cache, torch.tensor(chunk_rows(tokens, context, size, 0, 1)), tables)
            logits = model.compute_logits(hidden, torch.tensor([n - 1]))

            written = sorted({slot(context + j) for j in range(n)})
            untouched, row_error = True, 0.0
            for key, t in cache_state(cache).items():
                keep = torch.ones(t.shape[0], dtype=torch.bool)
                keep[written + sorted(may_write_scratch)] = False
                untouched &= torch.equal(t[keep], before[key][keep])
                if t.dtype.is_floating_point:
                    scale = eager_state[key][written].abs().max().clamp(min=1e-6)
                    row_error = max(row_error, ((t[written] - eager_state[key][written]).abs().max() / scale).item())
            out.append(
                {
                    "case": (context, n, size),
                    "hidden error": ((hidden[:n] - eager).abs().max() / eager.abs().max()).item(),
                    "logit error": ((logits - eager_logits).abs().max() / eager_logits.abs().max()).item(),
                    "untouched": untouched,
                    "row error": row_error,
                    "shapes": (tuple(hidden.shape), tuple(logits.shape)),
                }
            )
    return out


def test_fixed_shape_chunk_step_matches_the_eager_path(engine_checkpoint):
    got = spawn(chunk_cases, 1, engine_checkpoint)[0]
    assert [g["case"] for g in got] == list(CASES)
    for g in got:
        print(g)
        _, _, size = g["case"]
        assert g["shapes"] == ((size, ENGINE_CONFIG["hidden_size"]), (1, ENGINE_CONFIG["vocab_size"])), g
        assert g["hidden error"] < 1e-5, g
        assert g["logit error"] < 1e-5, g
        assert g["untouched"], f"the fixed-shape chunk step wrote a cache row outside its rows: {g}"
        assert g["row error"] < 1e-5, g
