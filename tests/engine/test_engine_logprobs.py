"""The engine with the batched sampler, against a float32 forward of the whole sequence computed in the test:
logprobs and prompt logprobs (prompts prefilled in chunks) equal log_softmax of that forward's logits; greedy
requests with penalties take the argmax of the penalised logits, step by step; a sampled request's logprobs
are those of its processed distribution. Every request of the batch has different settings. A later request
for prompt logprobs of a prompt whose first block is in the prefix cache still gets them all."""

import pytest

from spmoe.distributed import spawn
from spmoe.engine.request import Request, SamplingParams

from .conftest import log_softmax

# 70 tokens: one full block of 64 for the prefix cache
PROMPT = [
    3,
    14,
    15,
    92,
    65,
    35,
    89,
    7,
    7,
    21,
] * 7
MAX_NEW = 6
REQUESTS = {
    "logprobs": SamplingParams(logprobs=3, prompt_logprobs=2),
    "penalised_greedy": SamplingParams(
        frequency_penalty=-2.0, presence_penalty=-1.0
    ),  # repeat yourself
    "penalised_sampled": SamplingParams(
        1.0,
        seed=3,
        repetition_penalty=1.4,
        frequency_penalty=0.7,
        logprobs=0,
        logit_bias=((5, 3.0),),
    ),
    "plain": SamplingParams(),
}


def run_engine_and_forward(folder: str) -> dict:
    import torch

    from spmoe.config import ParallelConfig
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig())
    # prompts in chunks
    engine = Engine(model, PagedKVCache.for_model(model, 2**22), max_num_batched_tokens=8)
    for name, params in REQUESTS.items():
        engine.add_request(Request(name, PROMPT, MAX_NEW, params))
    got = {name: {"tokens": [], "logprobs": [], "prompt_logprobs": None} for name in REQUESTS}
    while engine.has_unfinished():
        for out in engine.step():
            entry = got[out.request_id]
            entry["tokens"] += out.new_token_ids
            entry["logprobs"] += out.logprobs or []
            if out.prompt_logprobs is not None:
                entry["prompt_logprobs"] = out.prompt_logprobs
    # the same prompt again: a plain request finds its first block cached, one asking for prompt logprobs does not
    # use it (its logprobs come from the forward over the prompt)
    for name, params in (
        ("again_plain", SamplingParams()),
        ("again", SamplingParams(prompt_logprobs=2)),
    ):
        engine.add_request(Request(name, PROMPT, 1, params))
        got[name] = {"tokens": [], "logprobs": [], "prompt_logprobs": None}
        hits = engine.metrics().prefix_cache_hits
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id]["tokens"] += out.new_token_ids
                if out.prompt_logprobs is not None:
                    got[out.request_id]["prompt_logprobs"] = out.prompt_logprobs
        got[name]["hits"] = engine.metrics().prefix_cache_hits - hits
    forward = {}
    with torch.no_grad():
        for name, entry in list(got.items())[: len(REQUESTS)]:
            ids = torch.tensor(PROMPT + entry["tokens"])
            logits = model(ids, torch.arange(len(ids)), [len(ids)])  # float32 [L, V], no cache
            forward[name] = logits.float().tolist()
    return {"got": got, "forward": forward}


@pytest.fixture(scope="module")
def ran(engine_checkpoint):
    return spawn(run_engine_and_forward, 1, engine_checkpoint)[0]


def test_logprobs_and_prompt_logprobs_equal_a_float32_forward(ran):
    got, logits = ran["got"]["logprobs"], ran["forward"]["logprobs"]
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        want = log_softmax(logits[i - 1])
        lp, top = got["prompt_logprobs"][i]
        assert lp == pytest.approx(want[PROMPT[i]], abs=1e-4)
        assert [t for t, _ in top] == sorted(range(len(want)), key=lambda t: -want[t])[:2]
        assert [v for _, v in top] == pytest.approx(sorted(want, reverse=True)[:2], abs=1e-4)
    assert len(got["logprobs"]) == len(got["tokens"]) == MAX_NEW
    for j, (token, (lp, top)) in enumerate(zip(got["tokens"], got["logprobs"])):
        want = log_softmax(logits[len(PROMPT) - 1 + j])
        assert token == max(range(len(want)), key=lambda t: want[t])  # greedy
        assert lp == pytest.approx(want[token], abs=1e-4)
        assert [v for _, v in top] == pytest.approx(sorted(want, reverse=True)[:3], abs=1e-4)


def test_penalties_steer_greedy_and_sampled_requests(ran):
    plain = ran["got"]["plain"]["tokens"]
    greedy = ran["got"]["penalised_greedy"]
    logits = ran["forward"]["penalised_greedy"]
    for j, token in enumerate(greedy["tokens"]):
        before = greedy["tokens"][:j]
        row = [
            v + 2.0 * before.count(t) + 1.0 * (t in before)
            for t, v in enumerate(logits[len(PROMPT) - 1 + j])
        ]
        assert token == max(range(len(row)), key=lambda t: row[t])
    assert greedy["tokens"] != plain  # the penalty changed something
    # negative penalties: it repeats itself
    assert len(set(greedy["tokens"])) < len(greedy["tokens"])
    sampled, logits = ran["got"]["penalised_sampled"], ran["forward"]["penalised_sampled"]
    # the loop below checks every token
    assert len(sampled["logprobs"]) == len(sampled["tokens"]) > 0
    for j, (token, (lp, top)) in enumerate(zip(sampled["tokens"], sampled["logprobs"])):
        before, row = sampled["tokens"][:j], list(logits[len(PROMPT) - 1 + j])
        row[5] += 3.0
        for t in range(len(row)):
            if t in PROMPT or t in before:
                row[t] = row[t] / 1.4 if row[t] > 0 else row[t] * 1.4
            row[t] -= 0.7 * before.count(t)
        assert lp == pytest.approx(log_softmax(row)[token], abs=1e-4)
        assert top == []


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(ran):
    got = ran["got"]
    assert got["again_plain"]["hits"] == 64  # the plain request found the first block cached
    assert got["again"]["hits"] == 0
    first, again = got["logprobs"]["prompt_logprobs"], got["again"]["prompt_logprobs"]
    assert len(again) == len(PROMPT) and again[0] is None
    for (lp, top), (lp2, top2) in zip(first[1:], again[1:]):
        assert lp2 == pytest.approx(lp, abs=1e-5) and [t for t, _ in top2] == [t for t, _ in top]
