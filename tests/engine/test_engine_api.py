"""The request API of the engine (add_request / abort / step / has_unfinished / metrics) on one
rank: requests that join at different steps, wait for room and are aborted mid-way get exactly the
tokens each gets alone from `generate`; seeded sampling does not depend on the rest of the batch; an
abort frees the cache room for a waiting request; a speculating engine gives plain greedy tokens;
what only the engine can refuse (a prompt beyond the cache or the model's max_position_embeddings,
an id it holds) is a one-line error (the rest of a request is checked where it is read).

One spawned rank runs every case; the comparisons happen here.
"""

from dataclasses import replace

import pytest

from spmoe.distributed import spawn
from spmoe.engine.ranks import generate
from spmoe.engine.request import Request, SamplingParams
from tests.engine.test_generate import EOS, MAX_NEW, PROMPTS

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
ALONE_MAX_LEN = 32


def alone(model, prompt, sampling=SamplingParams(), eos=EOS) -> list[int]:
    """`generate` with one prompt and nothing else in the engine."""
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine

    engine = Engine(model, KVCache.for_model(model, 1, ALONE_MAX_LEN))
    return generate(engine, [prompt], MAX_NEW, [sampling], eos).outputs[0]


def drive(engine, schedule: dict[int, list], steps: int) -> tuple[dict, list]:
    """Run `steps` steps; before step i apply `schedule[i]` (("add", Request) or ("abort", id)).
    -> ({request id: (tokens, finish reason)}, metrics after every step)."""
    got, metrics = {}, []
    for i in range(steps):
        for kind, arg in schedule.get(i, []):
            if kind == "add":
                engine.add_request(arg)
                got[arg.request_id] = ([], None)
            else:
                engine.abort(arg)
        for out in engine.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        metrics.append(engine.metrics())
    return got, metrics


def run_api_cases(folder: str) -> dict:
    from spmoe.config import ParallelConfig
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    out = {
        "alone": [alone(model, p) for p in PROMPTS],
        "alone_full": [alone(model, p, eos=()) for p in PROMPTS],
        "alone_sampled": [alone(model, p, SAMPLED) for p in PROMPTS[:2]],
    }

    def request(i, sampling=SamplingParams(), eos=EOS, rid=None):
        return Request(rid or f"r{i}", PROMPTS[i], MAX_NEW, sampling, eos)

    # Two slots; r0 and r1 join at steps 0 and 2, r2 and r3 wait for room, r1 is aborted at step 4.
    engine = Engine(model, KVCache.for_model(model, 2, 32))
    schedule = {
        0: [("add", request(0, eos=()))],
        2: [("add", request(1, eos=())), ("add", request(2))],
        3: [("add", request(3))],
        4: [("abort", "r1")],
        9: [("abort", "r1"), ("abort", "unknown")],
    }
    out["staggered"] = drive(engine, schedule, 40)
    out["staggered_done"] = (engine.has_unfinished(), engine.cache.free_slots)

    # Sampling: r0 sampled alone-seeded, joined by other sampled requests at other steps.
    engine = Engine(model, KVCache.for_model(model, 4, 32))
    schedule = {
        0: [("add", request(2, SamplingParams(0.8, 0.9, 11)))],
        1: [("add", request(0, SAMPLED))],
        3: [("add", request(1, SAMPLED)), ("add", request(3, SamplingParams(1.0, 1.0, 5)))],
    }
    out["sampled"] = drive(engine, schedule, 20)[0]

    # A speculating engine: the same greedy tokens.
    engine = Engine(model, KVCache.for_model(model, 2, 32), num_speculative_tokens=2)
    out["spec"] = drive(
        engine,
        schedule={
            0: [("add", request(0))],
            1: [("add", request(1))],
            2: [("add", request(2)), ("add", request(3))],
        },
        steps=40,
    )
    errors = {}
    bad = {"too_long": Request("t", [1] * 20, 11), "duplicate": Request("d", [1], 4)}
    engine.add_request(Request("d", [1], 4))
    for name, req in bad.items():
        try:
            engine.add_request(req)
        except ValueError as e:
            errors[name] = str(e)
    # a model that takes fewer positions than a slot
    model.cfg = replace(model.cfg, max_position_embeddings=24)
    try:
        engine.add_request(Request("p", [1] * 20, 3))
    except ValueError as e:
        errors["beyond_model"] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def api(engine_checkpoint):
    return spawn(run_api_cases, 1, engine_checkpoint)[0]


def test_requests_joining_and_leaving_get_their_own_tokens(api):
    got, metrics = api["staggered"]
    alone, full = api["alone"], api["alone_full"]
    assert got["r0"] == (full[0], "length")
    assert got["r2"][0] == alone[2] and got["r3"][0] == alone[3]
    assert got["r2"][1] == ("stop" if alone[2][-1] in EOS else "length")
    # aborted after two steps: a prefix of its own tokens, no finish output
    tokens, reason = got["r1"]
    assert reason is None and len(tokens) == 2 and full[1][:2] == tokens
    assert api["staggered_done"] == (False, 2)


def test_abort_frees_room_for_a_waiting_request(api):
    _, metrics = api["staggered"]
    # after step 3: r0 and r1 hold both slots, r2 and r3 wait; r1's abort before step 4 lets r2 in
    # at once
    assert (metrics[3].running, metrics[3].waiting, metrics[3].kv_cache_usage) == (2, 2, 1.0)
    assert (metrics[4].running, metrics[4].waiting) == (2, 1)
    assert (metrics[-1].running, metrics[-1].waiting, metrics[-1].kv_cache_usage) == (0, 0, 0.0)
    got = api["staggered"][0]
    assert metrics[-1].generated_tokens == sum(len(tokens) for tokens, _ in got.values())


def test_seeded_sampling_does_not_depend_on_the_batch(api):
    got = api["sampled"]
    assert got["r0"][0] == api["alone_sampled"][0]
    assert got["r1"][0] == api["alone_sampled"][1]
    assert got["r0"][0] != api["alone_full"][0][: len(got["r0"][0])]  # really sampled


def test_speculating_engine_gives_greedy_tokens(api):
    got, metrics = api["spec"]
    assert [got[f"r{i}"][0] for i in range(4)] == api["alone"]
    assert 0 < metrics[-1].draft_accepted < metrics[-1].draft_proposed


def test_what_only_the_engine_knows_is_a_one_line_error(api):
    errors = api["errors"]
    expected = {
        "too_long": "request 't': the prompt has 20 tokens; with max_new_tokens=11 and 2 speculative tokens it "
        "needs 33 KV cache positions, the cache holds 32 per sequence",
        "duplicate": "request id 'd' is already in the engine; expected a new id",
        "beyond_model": "request 'p': the prompt with its new and speculative tokens: 25 positions, more than the "
        "model's max_position_embeddings = 24",
    }
    assert errors == expected
