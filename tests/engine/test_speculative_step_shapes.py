"""The speculative decode step in the fixed shapes a CUDA graph captures (`cuda_graphs.decode_hidden`,
`cuda_graphs.draft_tokens`), run eagerly on CPU in float32 against the engine's eager reference path over the
same paged cache:

- the target's verification step (each sequence feeds its token and k drafts), laid out as graph rows (every
  row names its sequence's block table, a pad sequence in the scratch block), gives the hidden states of the
  eager forward over the same tokens;
- the drafter's step, which catches up on every fed row (junk tokens past each sequence's last verified row)
  and drafts from the last verified one, its chain fed the lookup's drafts where they lead (`FORCED`),
  proposes what `MtpDrafter.propose` proposes when it is fed only the verified rows; a sequence that
  stops sends its one-token steps to the scratch row; and nothing outside the rows the step may write
  changes in any layer's cache."""

import torch

from spmoe.distributed import spawn

from ..conftest import relative_error
from .conftest import ENGINE_CONFIG, cache_slot, cache_state

K = 2
T = 1 + K
PROMPT_LENS = (5, 70, 130, 9)  # the last sequence stops in the step under test
LAST = (0, 2, 1, 1)  # each sequence's last verified row (accepted drafts)
FORCED = ([7], [], [11, 12], [])  # the lookup's drafts that lead each sequence's slots


def fixed_shape_cases(folder: str) -> dict:
    from spmoe.config import ParallelConfig
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.engine.runner.drafter import MtpDrafter
    from spmoe.engine.runner.graphs import decode_hidden, draft_tokens
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    cache = PagedKVCache.for_model(model, 2**22)
    gen = torch.Generator().manual_seed(0)
    vocab, count = ENGINE_CONFIG["vocab_size"], len(PROMPT_LENS)
    tables, first_block = [], 3  # blocks after the first ones, in reverse order within each table
    for n in PROMPT_LENS:
        blocks = -(-(n + T + K) // BLOCK_SIZE)
        tables.append(list(range(first_block + blocks - 1, first_block - 1, -1)))
        first_block += blocks
    width = max(map(len, tables)) + 1
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    # token + K drafts
    fed = [torch.randint(0, vocab, (T,), generator=gen).tolist() for _ in PROMPT_LENS]
    # token after each row
    after = [torch.randint(0, vocab, (T,), generator=gen).tolist() for _ in PROMPT_LENS]
    drafter, out = MtpDrafter(model, cache, K), {}
    with torch.no_grad():
        view = cache.view(tables, [0] * count, list(PROMPT_LENS))
        hidden = model.forward_hidden(
            torch.tensor(sum(prompts, [])), view.positions, list(PROMPT_LENS), view
        )
        drafter.propose(tables, [0] * count, [p[1:] + [f[0]] for p, f in zip(prompts, fed)], hidden)

        # the verification step, eagerly over the cache view, then as graph rows (plus one pad sequence)
        view = cache.view(tables, list(PROMPT_LENS), [T] * count)
        eager = model.forward_hidden(torch.tensor(sum(fed, [])), view.positions, [T] * count, view)
        # + pad, + scratch row
        padded = torch.full((count + 2, width), cache.scratch_block, dtype=torch.int32)
        for i, table in enumerate(tables):
            padded[i, : len(table)] = torch.tensor(table)
        inputs = torch.stack(
            [
                torch.tensor(sum(fed, []) + [0] * T),
                torch.arange(count + 1).repeat_interleave(T),
                torch.tensor([n + j for n in PROMPT_LENS for j in range(T)] + list(range(T))),
            ]
        )
        hidden = decode_hidden(model, cache, inputs, padded)
        out["verify error"] = relative_error(hidden[: count * T], eager)

        # the drafter: the reference fed the verified rows only, then the fixed-shape step on the same cache
        before = cache_state(cache)
        goes_on = [i < count - 1 for i in range(count)]
        want = drafter.propose(
            [tables[i] for i in range(count) if goes_on[i]],
            [PROMPT_LENS[i] for i in range(count) if goes_on[i]],
            [after[i][: LAST[i] + 1] for i in range(count) if goes_on[i]],
            torch.cat([hidden[i * T : i * T + LAST[i] + 1] for i in range(count) if goes_on[i]]),
            forced=[FORCED[i] for i in range(count) if goes_on[i]],
        )
        reference = cache_state(cache)
        for key, t in before.items():  # start again from the state before the reference ran
            layer, name = key
            getattr(cache.layers[layer], name).copy_(t)
        pad_last, scratch_row = count * T, count + 1
        got = draft_tokens(
            model,
            cache,
            inputs,
            padded,
            hidden,
            torch.tensor(sum(after, []) + [0] * T),
            torch.tensor([i * T + a for i, a in enumerate(LAST)] + [pad_last]),
            torch.tensor([i if goes_on[i] else scratch_row for i in range(count)] + [scratch_row]),
            torch.tensor(
                [n + a + 1 if goes_on[i] else 0 for i, (n, a) in enumerate(zip(PROMPT_LENS, LAST))]
                + [0]
            ),
            torch.tensor([f + [-1] * (K - len(f)) for f in FORCED] + [[-1] * K]),
        )
        out["drafts"] = (got[: count - 1].tolist(), want)

        # rows the fixed-shape step may write: every fed row's, each going-on sequence's one-token steps',
        # the scratch block's; every other row must be as before, and the reference's rows where both wrote
        mtp_layer = max(cache.layers)
        may_write = set(
            range(cache.scratch_block * BLOCK_SIZE, (cache.scratch_block + 1) * BLOCK_SIZE)
        )
        both_wrote = set()
        for i, (table, n, a) in enumerate(zip(tables, PROMPT_LENS, LAST)):
            may_write |= {cache_slot(table, n + j) for j in range(T)}
            if goes_on[i]:
                steps = {cache_slot(table, n + a + 1 + j) for j in range(K - 1)}
                may_write |= steps
                both_wrote |= {cache_slot(table, n + j) for j in range(a + 1)} | steps
        untouched, mtp_error = True, 0.0
        for (layer, name), t in cache_state(cache).items():
            keep = torch.ones(t.shape[0], dtype=torch.bool)
            keep[sorted(may_write)] = False
            untouched &= torch.equal(t[keep], before[layer, name][keep])
            if layer == mtp_layer and t.dtype.is_floating_point:
                rows = sorted(both_wrote)
                scale = reference[layer, name][rows].abs().max().clamp(min=1e-6)
                mtp_error = max(
                    mtp_error, ((t[rows] - reference[layer, name][rows]).abs().max() / scale).item()
                )
        out["untouched"], out["mtp row error"] = untouched, mtp_error
    return out


def test_fixed_shape_speculative_step_matches_the_eager_path(engine_checkpoint):
    got = spawn(fixed_shape_cases, 1, engine_checkpoint)[0]
    print(got)
    assert got["verify error"] < 1e-5, got["verify error"]
    drafts, want = got["drafts"]
    assert drafts == want
    assert got["untouched"], "the drafter's fixed-shape step wrote a cache row outside its rows"
    assert got["mtp row error"] < 1e-5, got["mtp row error"]
