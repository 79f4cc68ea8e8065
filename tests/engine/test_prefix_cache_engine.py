"""Prefix caching in the engine: the same tokens and logits with caching on as with it off, at TP 2
with SP off and on, with MTP speculation (the drafts too: the MTP layer's rows of reused blocks are
exact), and with a cache so small that sequences preempt each other; every TP rank reuses the same
blocks, as rank 0 decides: rank 1's own prefix-cache lookup is made to find nothing, and it still
reuses what rank 0 reuses, in the batch job and in the serving loop (the decisions travelling in the
step plans); a rank 1 whose cache lost the blocks rank 0 reuses raises instead of computing
something else. In each case, n = 3 choices of one prompt (the others fork from the first, as rank 0
decides) get the tokens each gets alone, on every rank.

Two rounds of requests run through one engine: the second round's prompts share prefixes of random
lengths with the first round's (an exact block multiple, a prompt that is a whole earlier prompt, a
prompt that is exactly a cached block, random lengths), so they are admitted with cached blocks. One
spawned group (TP 2) runs every case; the comparisons happen here. A second group, DP 2 x TP 2 (it
needs 4 ranks), runs both rounds through the serving loop: each DP group's TP rank 1 follows its own
group's TP rank 0.
"""

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.distributed.comm import broadcast_object
from spmoe.engine.cache.paged import BLOCK_SIZE
from spmoe.engine.ranks import channel, generate
from spmoe.engine.request import Request

from ..conftest import relative_error
from .conftest import ENGINE_CONFIG, choices_and_alone

MAX_NEW = 6
# n = 3 sampled choices of one 70-token prompt, then each alone (choices_and_alone)
CHOICES_PROMPT = torch.randint(
    0, ENGINE_CONFIG["vocab_size"], (70,), generator=torch.Generator().manual_seed(1)
)
BUDGET = 24  # prompts are prefilled in chunks
CASES = {  # name -> (SP, MTP drafts, cache blocks; None: room for everything)
    "sp off": ("off", 0, None),
    "sp off mtp": ("off", 2, None),
    "sp on": ("on", 0, None),
    "sp on mtp": ("on", 2, None),
    "sp on small cache": ("on", 0, 5),
}
# prompt tokens served from the cache (blocks of 64). Without MTP: in the first round the second
# prompt finds the first prompt's first block and the third its first two (64 + 128); in the second
# round 128, 128, 0, 64 and 128. With MTP a block also needs the token after it to match: 0 + 128,
# then 64, 128, 0, 64 and 128.
WANT_HITS = {0: 192 + 448, 2: 128 + 384}
PROMPT_TOKENS = (135 + 84 + 150) + (137 + 150 + 64 + 140 + 196)


def rounds() -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds of prompts over one 200-token head `base`."""
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, ENGINE_CONFIG["vocab_size"], (n,), generator=gen).tolist()  # noqa: E731
    base = tokens(200)
    first = [base[:130] + tokens(5), base[:64] + tokens(20), base[:150]]
    second = [
        base[:128] + tokens(9),  # two full blocks shared, then its own tokens
        base[:150],  # a whole earlier prompt
        base[:64],  # exactly a cached block: its last token is computed, so nothing is reused
        base[:100] + tokens(40),  # a random length: one block
        base[:193] + tokens(3),  # more than what is cached
    ]
    return first, second


def on_and_off(folder: str) -> dict:
    """-> {(case, caching): (outputs of both rounds, their logits `[tokens, V]`, the MTP drafts and
    prompt rows (`record_drafts`), the second round's stats)}, and the serving loop's and the
    divergence's results (`through_serving_loop`, `diverged`). Rank 1's own prefix-cache lookup
    always finds nothing (`blind_lookup`): its engines reuse only what rank 0 tells them."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    state, results, models = get_parallel_state(), {}, {}
    for case, (sp, k, blocks) in CASES.items():
        if sp not in models:
            models[sp] = load_model(
                folder, ParallelConfig(tensor_parallel_size=state.tp_size, sp=sp), with_mtp=True
            )
        model = models[sp]
        for caching in (False, True):
            budget = (
                2**22
                if blocks is None
                else blocks * BLOCK_SIZE * PagedKVCache.for_model(model, 2**20).bytes_per_token
            )
            engine = Engine(
                model,
                PagedKVCache.for_model(model, budget),
                k,
                max_num_batched_tokens=BUDGET,
                enable_prefix_caching=caching,
                ranks=channel(),
            )
            blind_lookup(engine)
            recorded = record_drafts(engine) if k else {}
            outputs, logits, drafts = [], [], {}
            # both rounds name their requests generate-0, -1, ...
            for number, prompts in enumerate(rounds()):
                gen = generate(engine, prompts, MAX_NEW, record_logits=True)
                outputs += gen.outputs
                logits += gen.logits
                drafts.update({(number, key): value for key, value in recorded.items()})
                recorded.clear()
            results[case, caching] = (outputs, torch.cat(logits), drafts, gen.stats)
            results[case, caching, "choices"] = choices_and_alone(
                engine, CHOICES_PROMPT.tolist(), [5, 6, 7], MAX_NEW
            )
    results["serving loop"] = through_serving_loop(caching_engine(models["off"]))
    results["diverged"] = diverged(caching_engine(models["off"]))
    return results


def caching_engine(model, caching: bool = True):
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine

    cache = PagedKVCache.for_model(model, 2**22)
    return blind_lookup(
        Engine(
            model,
            cache,
            max_num_batched_tokens=BUDGET,
            enable_prefix_caching=caching,
            ranks=channel(),
        )
    )


def blind_lookup(engine):
    """On every TP rank but 0, the engine's own prefix-cache lookup finds nothing: only reuse that
    its DP group's TP rank 0 decides (and this rank's cache holds) can happen there. -> the
    engine."""
    if get_parallel_state().tp_rank != 0:
        engine.scheduler.room.blocks._hit_blocks = lambda token_ids, hashes: []
    return engine


def through_serving_loop(engine) -> tuple[list[list[int]], dict] | None:
    """Both rounds through the serving loop (rank 0 plans, rank 1 applies the plans in
    `worker_loop`). -> on every rank, the outputs in `generate`'s order (None on rank 1) and the
    engine's KV cache stats."""
    from spmoe.engine.engine import per_prompt
    from spmoe.engine.ranks import ServingLoop, worker_loop
    from spmoe.engine.request import SamplingParams

    if get_parallel_state().rank != 0:
        worker_loop(engine)
        return None, engine.scheduler.room.stats()
    loop, outputs = ServingLoop(engine), []
    for number, prompts in enumerate(rounds()):
        tokens = {f"{number}-{i}": [] for i in range(len(prompts))}
        requests = [
            Request(request_id, prompt, MAX_NEW, params)
            for request_id, prompt, params in zip(
                tokens, prompts, per_prompt(SamplingParams(), len(prompts))
            )
        ]
        plan = loop.plan(requests, [])
        while plan.command == "step":
            for out in loop.step(plan).outputs:
                tokens[out.request_id] += out.new_token_ids
            plan = loop.plan([], [])
        outputs += tokens.values()
    loop.step(loop.plan([], [], shutdown=True))
    return outputs, engine.scheduler.room.stats()


def diverged(engine) -> str | None:
    """The first round on both ranks, then rank 1's cache loses every cached block (one sequence
    takes the whole pool); rank 0 schedules the second round's first step and sends its admissions,
    and rank 1 follows them. -> on rank 1 the error it raised (None if it raised none); None on rank
    0. No forward runs after."""
    state = get_parallel_state()
    first, second = rounds()
    generate(engine, first, MAX_NEW)
    if state.rank != 0:
        blocks = engine.scheduler.room.blocks
        blocks.allocate(-1, blocks.capacity_tokens)
        blocks.free(-1)
    for i, prompt in enumerate(second):
        engine.add_request(Request(f"second-{i}", prompt, MAX_NEW))
    if state.rank == 0:
        broadcast_object(engine.scheduler.schedule().admissions, state.control_group)
        return None
    admissions = broadcast_object(None, state.control_group)
    try:
        engine.scheduler.schedule(admissions)
    except RuntimeError as error:
        return str(error)
    return None


def record_drafts(engine) -> dict:
    """Wrap the drafter's draft step: -> a dict it fills with each sequence's drafts, keyed by
    (request id, tokens it had generated before the step), and with the MTP layer's cache rows of
    each prompt once the drafter has caught up on all of it (keyed by request id): `[prompt, c +
    r]`, the latent and the rope key."""
    recorded, draft = {}, engine.drafter.draft
    mtp = engine.cache.layers[engine.model.cfg.num_hidden_layers]

    def draft_and_record(batch, forward, results):
        proposed = draft(batch, forward, results)
        for result in results:
            seq, new = result.part.seq, proposed.get(result.part.seq)
            if not new:
                continue
            # the drafts follow this step's commit: the tokens it had before it
            before = len(seq.output) - len(result.output.new_token_ids)
            recorded[seq.request_id, before] = new
            if not before:  # its first token: the drafter has caught up on the whole prompt
                positions = torch.arange(len(seq.request.prompt))
                rows = (
                    torch.tensor(result.part.location)[positions // BLOCK_SIZE] * BLOCK_SIZE
                    + positions % BLOCK_SIZE
                )
                recorded[seq.request_id] = torch.cat([mtp.latent[rows], mtp.rope[rows]], dim=1)
        return proposed

    engine.drafter.draft = draft_and_record
    return recorded


def test_prefix_caching_changes_no_output(engine_checkpoint):
    ranks = spawn(on_and_off, 2, engine_checkpoint)
    for case, (_, k, blocks) in CASES.items():
        outputs, logits, drafts, stats = ranks[0][case, True]
        want_outputs, want_logits, want_drafts, off_stats = ranks[0][case, False]
        assert outputs == want_outputs, case
        assert relative_error(logits, want_logits) < 1e-4, case
        # the MTP layer's rows of every prompt, reused or computed, are what computing them gives:
        # the same drafts
        assert drafts.keys() == want_drafts.keys() and (len(drafts) > 0) == (k > 0), case
        for key, want in want_drafts.items():
            if isinstance(key[1], str):
                assert relative_error(drafts[key], want) < 1e-4, (case, key)
            else:
                assert drafts[key] == want, (case, key)
        cache = stats["kv_cache"]
        assert off_stats["kv_cache"]["prefix_cache_hits"] == 0 and cache["prefix_caching"], case
        assert cache["blocks_in_use"] == 0, case  # every reference given back; cached blocks stay
        if blocks is None:
            assert cache["prefix_cache_queries"] == PROMPT_TOKENS, case
            assert cache["prefix_cache_hits"] == WANT_HITS[k], case
        else:
            assert stats["preemptions"] > 0 and cache["prefix_cache_hits"] > 0, case
        # every TP rank made rank 0's decisions, its own lookup finding nothing
        for rank in ranks[1:]:
            assert rank[case, True][0] == outputs and rank[case, True][3]["kv_cache"] == cache, case
        # n = 3: each choice gets what it gets alone, the prompt computed once
        for caching in (
            False,
            True,
        ):
            got, alone, logits, alone_logits, queries, blocks_in_use = ranks[0][
                case, caching, "choices"
            ]
            assert got == alone and len(set(map(tuple, got))) == 3, (case, caching)
            assert relative_error(logits, alone_logits) < 1e-4, (case, caching)
            assert queries == (70 if caching else 0) and blocks_in_use == 0, (case, caching)
            assert ranks[1][case, caching, "choices"][0] == got, (case, caching)
    # the serving loop: the same tokens, and rank 1 reuses what rank 0 reuses, told by the step
    # plans
    outputs, cache = ranks[0]["serving loop"]
    assert outputs == ranks[0]["sp off", False][0]
    assert cache["prefix_cache_hits"] == WANT_HITS[0] and ranks[1]["serving loop"][1] == cache
    # rank 0 reuses the 128 cached tokens of the second round's first prompt, which rank 1 no longer
    # holds
    assert ranks[0]["diverged"] is None
    assert ranks[1]["diverged"] == (
        "the deciding rank reuses 128 cached prompt tokens, but this rank's prefix cache holds only the first 0 of "
        "them: the ranks' caches diverged"
    )


def data_parallel(folder: str) -> dict:
    """DP 2 x TP 2: both rounds through the serving loop with caching off and on. -> {caching:
    (outputs on rank 0, this rank's KV cache stats)}."""
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
    return {
        caching: through_serving_loop(caching_engine(model, caching)) for caching in (False, True)
    }


def test_each_dp_group_follows_its_own_tp_rank_0(engine_checkpoint):
    """Under DP each DP group's TP rank 0 decides its group's reuse and sends it to its TP peer
    (whose own lookup finds nothing): the same tokens as without caching, and both ranks of a group
    reuse the same."""
    ranks = spawn(
        data_parallel,
        4,
        engine_checkpoint,
        config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2),
    )
    assert ranks[0][True][0] == ranks[0][False][0]
    hits = [rank[True][1]["prefix_cache_hits"] for rank in ranks]
    assert hits[0] > 0 and hits[2] > 0 and hits[1] == hits[0] and hits[3] == hits[2]
    assert ranks[1][True][1] == ranks[0][True][1] and ranks[3][True][1] == ranks[2][True][1]
