"""The hybrid (MTP + n-gram lookup, k = 3) runs no MTP forward in a step whose drafts the lookup makes
alone, and owes the MTP layer that step's rows (`MtpDrafter.defer`). The prompts are a head and the
checkpoint's first 40 greedy tokens after it, whose continuation brings back n-grams of them, so that
the lookup fills every slot in some steps and MTP drafts in others:

- greedy output identical to no speculation, at batch 1 and 2, on TP 1 and on TP 2 with SP (gloo),
  and seeded sampling's too (its draws depend on the seed alone; the distribution itself:
  `test_speculative_sampling.py`, whose short answers end before a step can skip MTP);
- the MTP layer skipped in some steps and drafting in others (its deferred and draft steps counted),
  its forwards fewer than k a step;
- wherever the hybrid's MTP layer drafted, its own first choice equals MTP alone's at the same
  committed length: the rows it was owed were written before it read them;
- on a paged cache with prefix caching, the next turn of a conversation (the prompt, the answer, one
  more token) reuses the answer's blocks, and its MTP choices are those of a fresh engine: the rows
  owed to a sequence are written before its blocks are cached.
"""

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.engine.request import Request, SamplingParams

K, NEW, ANSWER = 3, 48, 87  # ANSWER: the first turn's tokens, its last steps' MTP rows owed
HEADS = ([23, 61, 7], [5, 88, 40, 17])  # each prompt's head, then 40 greedy tokens after it


def speculation(hybrid: bool):
    from spmoe.engine.speculation import NgramConfig, Speculation

    lookup = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3) if hybrid else None
    return Speculation(num_speculative_tokens=K, lookup=lookup)


def recorded(engine) -> dict:
    """Count the MTP layer's steps that drafted and those it deferred, and record its first own
    choice per (request, tokens generated) when it drafts. -> the record, filled as the engine runs."""
    drafter = engine.drafter.drafter
    log = {"choices": {}, "drafted": 0, "deferred": 0}
    draft, defer = drafter.draft, drafter.defer

    def drafting(batch, forward, results, forced):
        own = draft(batch, forward, results, forced)
        log["drafted"] += bool(own)
        for seq, choices in own.items():
            log["choices"][seq.request_id, len(seq.output)] = choices[0]
        return own

    def deferring(forward, results):
        log["deferred"] += 1
        defer(forward, results)

    drafter.draft, drafter.defer = drafting, deferring
    return log


def run(engine, prompts: list[list[int]], sampling=SamplingParams()) -> tuple:
    """NEW tokens after each prompt -> (outputs, the MTP record, MTP forwards)."""
    from spmoe.engine.ranks import generate

    log = recorded(engine) if engine.drafter.drafter is not None else None
    outputs = generate(engine, prompts, NEW, sampling).outputs
    return outputs, log, engine.stats.phases["draft"].forwards


def engines_on_rank(folder: str, sp: str) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import channel, generate
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    parallel = ParallelConfig(tensor_parallel_size=state.tp_size, sp=sp, sp_scope="all")
    model = load_model(folder, parallel, with_mtp=True)

    def slot_engine(spec, batch: int):
        cache = KVCache.for_model(model, batch, 200)
        return Engine(model, cache, ranks=channel(), speculation=spec)

    plain = Engine(model, KVCache.for_model(model, 1, 64), ranks=channel())
    prompts = [h + generate(plain, [h], 40).outputs[0] for h in HEADS]
    out = {}
    for batch in (1, 2):
        out[batch] = {"plain": generate(slot_engine(None, batch), prompts[:batch], NEW).outputs}
        for name, hybrid in (("hybrid", True), ("mtp", False)):
            out[batch][name] = run(slot_engine(speculation(hybrid), batch), prompts[:batch])
    # seeded sampling: the same tokens with and without speculation (the draws depend on the seed)
    sampled = SamplingParams(temperature=0.7, seed=11)
    out["sampled"] = {
        "plain": generate(slot_engine(None, 2), prompts, NEW, sampled).outputs,
        "hybrid": run(slot_engine(speculation(True), 2), prompts, sampled),
    }

    # a conversation on a paged cache: the first answer (rows owed in its blocks), then the next turn
    first = prompts[0]
    turns = {}
    for name, hybrid in (("hybrid", True), ("fresh", False)):
        engine = Engine(
            model, PagedKVCache.for_model(model, 2**22), max_num_seqs=2, max_model_len=512,
            ranks=channel(), speculation=speculation(hybrid),
        )  # fmt: skip
        log = recorded(engine)
        if hybrid:
            answer = generate(engine, [first], ANSWER).outputs[0]
            log["choices"].clear()
            hits = engine.scheduler.room.prefix_cache_counts()[1]
        turn = first + answer + [1]
        engine.add_request(Request("turn", turn, 8, SamplingParams()))
        while engine.has_unfinished():
            engine.step()
        turns[name] = {
            "answer": answer,
            "choices": dict(log["choices"]),
            "hits": engine.scheduler.room.prefix_cache_counts()[1] - (hits if hybrid else 0),
            "deferred": log["deferred"],
        }
    out["turns"] = turns
    return out


def check(got: dict) -> None:
    for batch in (1, 2):
        hybrid, hybrid_log, hybrid_forwards = got[batch]["hybrid"]
        mtp, mtp_log, mtp_forwards = got[batch]["mtp"]
        assert hybrid == mtp == got[batch]["plain"], batch
        # the MTP layer was skipped in some steps and drafted in others: k forwards a draft step
        # and one catch-up forward now and then, fewer than k forwards a step
        drafted, deferred = hybrid_log["drafted"], hybrid_log["deferred"]
        assert deferred > 0 and drafted > 0, (batch, hybrid_log)
        assert K * drafted < hybrid_forwards < K * (drafted + deferred), (batch, hybrid_log)
        assert mtp_log["deferred"] == 0 and mtp_forwards == K * mtp_log["drafted"]
        # where both drafted (after deferred steps too), the same first choice
        common = set(hybrid_log["choices"]) & set(mtp_log["choices"])
        assert len(common) >= 8, (batch, sorted(common))
        for key in common:
            assert hybrid_log["choices"][key] == mtp_log["choices"][key], (batch, key)
    print("deferred steps at batch 1:", got[1]["hybrid"][1]["deferred"])
    assert got[1]["hybrid"][1]["deferred"] >= 10
    outputs, log, _ = got["sampled"]["hybrid"]
    assert outputs == got["sampled"]["plain"] and outputs != got[2]["plain"]
    print("deferred steps, sampled:", log["deferred"])
    assert log["deferred"] > 0

    turns = got["turns"]
    assert turns["hybrid"]["deferred"] > 0  # the first answer left rows owed
    # the next turn reused the blocks that the first turn filled (64 tokens each), answer included
    assert len(turns["hybrid"]["answer"]) == ANSWER
    assert turns["hybrid"]["hits"] == 128
    assert turns["fresh"]["hits"] == 0
    common = set(turns["hybrid"]["choices"]) & set(turns["fresh"]["choices"])
    assert ("turn", 1) in common
    for key in common:
        assert turns["hybrid"]["choices"][key] == turns["fresh"]["choices"][key], key


def test_mtp_skipped_while_the_lookup_drafts_alone_tp1(engine_checkpoint):
    check(spawn(engines_on_rank, 1, engine_checkpoint, "off")[0])


def test_mtp_skipped_while_the_lookup_drafts_alone_tp2_sp(engine_checkpoint):
    ranks = spawn(engines_on_rank, 2, engine_checkpoint, "on")
    check(ranks[0])
    assert ranks[1] == ranks[0]
