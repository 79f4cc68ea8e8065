"""The n choices of one prompt in the engine (prefill once, then fork): each choice's tokens, logprobs
and logits are the ones it gets as a request of its own with the same settings and seed, with the
prompt chunked, with MTP speculation, with the hybrid (MTP + n-gram lookup), with prefix caching
off, in a cache so small that a choice cannot fork or is preempted, and with aborts before and after
the fork; every block comes back. One spawned rank runs every case; the comparisons happen here (TP
2 with SP: `test_prefix_cache_engine.py`)."""

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.cache.paged import BLOCK_SIZE
from spmoe.engine.sequence import Role

from ..conftest import relative_error
from .conftest import ENGINE_CONFIG

MAX_NEW = 5
BUDGET = 48  # prompts are fed in chunks (3 steps), and so is what a fork recomputes with MTP
PROMPT_LENS = (130, 128)  # a partly filled last block; a whole number of blocks
CASES = {  # name -> (MTP drafts, prefix caching, cache blocks; None: room for everything, prompt lengths)
    "plain": (0, True, None, PROMPT_LENS),
    "mtp": (
        2,
        True,
        None,
        PROMPT_LENS,
    ),  # 128 tokens: the fork shares 1 block and recomputes 64 tokens
    "hybrid": (2, True, None, PROMPT_LENS),  # MTP and the n-gram lookup
    "no prefix caching": (0, False, None, (130,)),
    "small cache": (
        0,
        True,
        5,
        PROMPT_LENS,
    ),  # 130 tokens: the last choice finds no block to fork; 128: one is
    # preempted
}
FORK_STEP = 2  # the step (from 0) that completes the prompt


def choice_sampling(i: int):
    """Choice i's settings: the server gives choice i the seed `seed + i`; one choice is greedy with a penalty."""
    from spmoe.engine.request import SamplingParams

    if i == 3:
        return SamplingParams(0.0, seed=11 + i, frequency_penalty=0.5, logprobs=2)
    return SamplingParams(1.0, seed=11 + i, logprobs=2)


def run_choices(engine, prompt: list[int], aborts: dict[int, int] | None = None) -> dict:
    """Add 4 choices of `prompt` and step to the end, aborting choice i once `aborts[i]` steps ran. -> `drive`'s
    results."""
    from spmoe.engine.request import Request

    seqs = [
        engine.add_request(
            Request(f"choice-{i}", prompt, MAX_NEW, choice_sampling(i)), record_logits=True
        )
        for i in range(4)
    ]
    return drive(engine, seqs, aborts or {})


def drive(engine, seqs, aborts: dict[int, int]) -> dict:
    """Step until every sequence ended, aborting sequence i once `aborts[i]` steps ran. -> {i: (tokens,
    logprobs, logits)} for each sequence, "peak": the most blocks held at once (from the block tables),
    "forked": the sequences that drew their first token from another's row."""
    logprobs = {seq.request_id: [] for seq in seqs}
    steps, peak, forked = 0, 0, set()
    room = engine.scheduler.room
    schedule = engine.scheduler.schedule

    def schedule_and_count(admissions=None):
        nonlocal peak
        batch = schedule(admissions)
        if batch is not None:
            forked.update(p.seq.request_id for p in batch.parts if p.role is Role.FORK)
            peak = max(peak, len({b for s in engine.scheduler.running for b in room.location(s)}))
        return batch

    engine.scheduler.schedule = schedule_and_count
    while engine.has_unfinished():
        for i, when in aborts.items():
            if when == steps:
                engine.abort(seqs[i].request_id)
        for out in engine.step():
            logprobs[out.request_id] += out.logprobs or []
        steps += 1
    engine.scheduler.schedule = schedule
    blocks = room.blocks
    # every block came back
    assert blocks.num_used_blocks == 0 and blocks.num_free_blocks == blocks.num_blocks
    got = {
        i: (seq.output, logprobs[seq.request_id], torch.stack(seq.logits) if seq.logits else None)
        for i, seq in enumerate(seqs)
    }
    return {**got, "peak": peak, "forked": forked, "preemptions": engine.scheduler.preemptions}


def forked_and_alone(folder: str) -> dict:
    """-> {(case, prompt length): `drive`'s results for 4 choices}, {(prompt length, "alone"): each choice as a
    request of its own}, and ("aborts" | "abort all", prompt length): choices aborted before and after the fork."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.request import Request
    from spmoe.engine.speculation import NgramConfig, Speculation
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), with_mtp=True)
    token_bytes = PagedKVCache.for_model(model, 2**20).bytes_per_token

    def engine(k: int, caching: bool, blocks: int | None, lookup: bool = False):
        budget = 2**22 if blocks is None else blocks * BLOCK_SIZE * token_bytes
        ngram = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=2) if lookup else None
        return Engine(
            model,
            PagedKVCache.for_model(model, budget),
            max_num_batched_tokens=BUDGET,
            enable_prefix_caching=caching,
            speculation=Speculation(num_speculative_tokens=k, lookup=ngram),
        )

    gen = torch.Generator().manual_seed(3)
    results = {}
    for prompt_len in PROMPT_LENS:
        prompt = torch.randint(
            0, ENGINE_CONFIG["vocab_size"], (prompt_len,), generator=gen
        ).tolist()
        # each choice alone, one after the other (the first prompt's blocks cached for the others: prefix caching
        # changes no token, test_prefix_cache_engine.py); the tokens do not depend on MTP or the cache's size
        alone, one = {}, engine(0, True, None)
        for i in range(4):
            seq = one.add_request(
                Request(f"alone-{i}", prompt, MAX_NEW, choice_sampling(i)), record_logits=True
            )
            got = drive(one, [seq], {})
            alone[i], alone["peak"] = got[0], got["peak"]
        results[prompt_len, "alone"] = alone
        for case, (k, caching, blocks, lens) in CASES.items():
            if prompt_len in lens:
                built = engine(k, caching, blocks, lookup=case == "hybrid")
                results[case, prompt_len] = run_choices(built, prompt)
        if prompt_len != 130:
            continue
        # choice 2 aborted while the prompt is computed, the source once the others forked, choice 3 two steps
        # later; then 4 choices of another prompt all aborted right after the fork
        aborting = engine(0, True, None)
        results["aborts", prompt_len] = run_choices(
            aborting, prompt, {2: 1, 0: FORK_STEP + 1, 3: FORK_STEP + 3}
        )
        everything = {i: FORK_STEP + 1 for i in range(4)}
        results["abort all", prompt_len] = run_choices(aborting, prompt[::-1], everything)
    return results


def test_each_choice_gets_what_it_gets_alone(engine_checkpoint):
    results = spawn(forked_and_alone, 1, engine_checkpoint)[0]
    for prompt_len in PROMPT_LENS:
        for case, (k, _, blocks, lens) in CASES.items():
            if prompt_len not in lens:
                continue
            got, alone = results[case, prompt_len], results[prompt_len, "alone"]
            where = (case, prompt_len)
            for i in range(4):
                tokens, logprobs, logits = got[i]
                want_tokens, want_logprobs, want_logits = alone[i]
                assert tokens == want_tokens and len(tokens) == MAX_NEW, (where, i)
                assert relative_error(logits, want_logits) < 1e-4, (where, i)
                assert len(logprobs) == len(want_logprobs) == MAX_NEW, (where, i)
                for (logprob, top), (want_logprob, want_top) in zip(logprobs, want_logprobs):
                    assert abs(logprob - want_logprob) < 1e-4 and [t for t, _ in top] == [
                        t for t, _ in want_top
                    ]
            # the seeds give different choices
            assert len({tuple(got[i][0]) for i in range(4)}) == 4, where
            if blocks is None:
                assert got["forked"] == {"choice-1", "choice-2", "choice-3"}, where
            # the prompt's full blocks once, and one block of its own per choice
            if blocks is None and k == 0:
                assert got["peak"] == alone["peak"] + 3, (where, got["peak"], alone["peak"])
        small = results["small cache", prompt_len]
        # the source's 3 blocks and 2 forks fill the cache: the last choice computes its own
        if prompt_len == 130:
            assert small["forked"] == {"choice-1", "choice-2"} and small["preemptions"] == 0
        else:  # the three forks hold nothing of their own until they decode: the last one admitted yields
            assert (
                small["forked"] == {"choice-1", "choice-2", "choice-3"} and small["preemptions"] > 0
            )

    aborted, alone = results["aborts", 130], results[130, "alone"]
    # choice 2 was gone before the prompt was computed
    assert aborted["forked"] == {
        "choice-1",
        "choice-3",
    }
    assert (
        aborted[2][0] == []
        and 0 < len(aborted[0][0]) < MAX_NEW
        and 0 < len(aborted[3][0]) < MAX_NEW
    )
    assert len(aborted[1][0]) == MAX_NEW
    for i in (0, 1, 3):  # what each got before its abort is what it gets alone
        assert aborted[i][0] == alone[i][0][: len(aborted[i][0])], i
    everything = results["abort all", 130]
    assert everything["forked"] == {"choice-1", "choice-2", "choice-3"}
    assert all(0 < len(everything[i][0]) < MAX_NEW for i in range(4))
