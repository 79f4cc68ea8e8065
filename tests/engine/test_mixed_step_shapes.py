"""A mixed step (prompt chunks and decode tokens of several sequences) in the fixed shape a mixed-step graph
captures (`cuda_graphs.mixed_rows`: the sequences' tokens end to end, then pad rows in the all-scratch table
row; `decode_hidden` over block tables with more rows and columns than the step uses, the spare ones holding
another sequence's block), run eagerly on CPU in float32 against the engine's eager path over the same paged
cache: the same hidden states and logits at the rows the step commits from, the same cache rows written, and
nothing written outside the fed rows and the scratch block. Cases: a decode token beside a prompt chunk after
a cached context and a fresh prompt; one token alone; a step that fills its size exactly; a chunk from a
block boundary."""

import torch

from spmoe.distributed import spawn

from ..conftest import relative_error
from .conftest import ENGINE_CONFIG, cache_slot, cache_state

WIDTH, TABLE_ROWS = 8, 5  # the captured tables: blocks per row, rows (the last all scratch)
STALE = 20  # a block another sequence holds, left in every table entry the step does not use
TABLES = ([5, 9, 2, 7], [11, 3], [14])  # blocks out of order
# per case, per sequence (its table, context cached before the step, tokens it feeds), the graph's size
CASES = (
    ([(0, 130, 1), (1, 64, 23), (2, 0, 5)], 32),
    ([(0, 130, 1)], 16),
    ([(0, 100, 20), (1, 40, 12)], 32),
    ([(0, 128, 16)], 16),
)


def mixed_cases(folder: str) -> list[dict]:
    from spmoe.config import ParallelConfig
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.engine.runner.graphs import decode_hidden, mixed_rows
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig())
    cache = PagedKVCache.for_model(model, 2**22)
    gen = torch.Generator().manual_seed(0)
    vocab = ENGINE_CONFIG["vocab_size"]
    scratch = set(range(cache.scratch_block * BLOCK_SIZE, (cache.scratch_block + 1) * BLOCK_SIZE))
    out = []
    with torch.no_grad():
        # the stale block holds real rows
        other = torch.randint(0, vocab, (BLOCK_SIZE,), generator=gen)
        view = cache.view([[STALE]], [0], [BLOCK_SIZE])
        model.forward_hidden(other, view.positions, [BLOCK_SIZE], view)
        for seqs, size in CASES:
            tables = [TABLES[t] for t, _, _ in seqs]
            starts, lens = [c for _, c, _ in seqs], [n for *_, n in seqs]
            for table, context in zip(tables, starts):
                if context:
                    view = cache.view([table], [0], [context])
                    prompt = torch.randint(0, vocab, (context,), generator=gen)
                    model.forward_hidden(prompt, view.positions, [context], view)
            tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
            # each sequence's last
            rows = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
            before = cache_state(cache)

            view = cache.view(tables, starts, lens)  # the eager step
            eager = model.forward_hidden(torch.tensor(sum(tokens, [])), view.positions, lens, view)
            eager_logits = model.compute_logits(eager, rows)
            eager_state = cache_state(cache)
            for (layer, name), t in before.items():
                getattr(cache.layers[layer], name).copy_(t)

            padded = torch.full((TABLE_ROWS, WIDTH), cache.scratch_block, dtype=torch.int32)
            padded[:-1] = STALE
            for i, table in enumerate(tables):
                padded[i, : len(table)] = torch.tensor(table)
            inputs = torch.tensor(mixed_rows(tokens, starts, size, TABLE_ROWS - 1))
            hidden = decode_hidden(model, cache, inputs, padded)
            logits = model.compute_logits(hidden, rows)

            written = sorted(
                {cache_slot(t, c + j) for t, c, n in zip(tables, starts, lens) for j in range(n)}
            )
            untouched, row_error = True, 0.0
            for key, t in cache_state(cache).items():
                keep = torch.ones(t.shape[0], dtype=torch.bool)
                keep[written + sorted(scratch)] = False
                untouched &= torch.equal(t[keep], before[key][keep])
                if t.dtype.is_floating_point:
                    scale = eager_state[key][written].abs().max().clamp(min=1e-6)
                    row_error = max(
                        row_error,
                        ((t[written] - eager_state[key][written]).abs().max() / scale).item(),
                    )
            fed = sum(lens)
            out.append(
                {
                    "case": (seqs, size),
                    "hidden error": relative_error(hidden[:fed], eager),
                    "logit error": relative_error(logits, eager_logits),
                    "untouched": untouched,
                    "row error": row_error,
                    "rows": tuple(hidden.shape),
                }
            )
    return out


def test_fixed_shape_mixed_step_matches_the_eager_path(engine_checkpoint):
    got = spawn(mixed_cases, 1, engine_checkpoint)[0]
    assert [g["case"] for g in got] == list(CASES)
    for g in got:
        print(g)
        _, size = g["case"]
        assert g["rows"] == (size, ENGINE_CONFIG["hidden_size"]), g
        assert g["hidden error"] < 1e-5, g
        assert g["logit error"] < 1e-5, g
        assert g["untouched"], f"the fixed-shape mixed step wrote a cache row outside its rows: {g}"
        assert g["row error"] < 1e-5, g
