"""A NaN in the weights ends generation with an error naming the step and the request, never a run of
token 0: greedy, sampled and speculative steps, in prefill and in decode; `spmoe generate` prints it as one
line; through the request API (the server's) only the request with non-finite logits ends, with
finish_reason "error", and the engine keeps serving the others."""

import json
import re

import torch
from safetensors.torch import load_file, save_file

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.ranks import generate
from spmoe.engine.request import Request, SamplingParams
from spmoe.entrypoints.cli import main

PROMPT = [5, 17, 33]
MESSAGE = (
    "non-finite logits (NaN or inf) at step {step} ({phase}) for request {rid!r} after {done} generated "
    "tokens: no token can be chosen (check the checkpoint for NaN / inf weights)"
)


def generate_with_nan(folder: str) -> dict:
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), with_mtp=True)

    def attempt(sampling=SamplingParams(), k=0):
        engine = Engine(model, KVCache.for_model(model, 1, 16), k)
        try:
            return generate(engine, [PROMPT], 4, sampling).outputs[0]
        except FloatingPointError as e:
            return str(e)

    results = {}
    with torch.no_grad():
        for name, sampling in (
            ("greedy", SamplingParams()),
            ("sampled", SamplingParams(temperature=0.8, seed=1)),
        ):
            # the clean model's first token (same seed, same draw), fed at step 2
            first = attempt(sampling)[0]
            results[f"{name}: first token"] = first
            row = model.model.embed_tokens.weight[first].clone()
            model.model.embed_tokens.weight[first, 3] = float("nan")  # only that token's embedding
            results[f"{name}, NaN from decode on"] = attempt(sampling)
            model.model.embed_tokens.weight[first] = row
        # every token, from prefill on
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")
        results["greedy, NaN from prefill on"] = attempt()
        results["speculative, NaN from prefill on"] = attempt(k=2)
    return results


def test_nan_weights_stop_the_run_naming_the_step(engine_checkpoint):
    results = spawn(generate_with_nan, 1, engine_checkpoint)[0]
    assert (
        results["greedy: first token"] not in PROMPT
        and results["sampled: first token"] not in PROMPT
    )
    decode = MESSAGE.format(step=2, phase="decode", rid="generate-0", done=1)
    prefill = MESSAGE.format(step=1, phase="prefill", rid="generate-0", done=0)
    assert results["greedy, NaN from decode on"] == decode
    assert results["sampled, NaN from decode on"] == decode
    assert results["greedy, NaN from prefill on"] == prefill
    assert results["speculative, NaN from prefill on"] == prefill


def test_generate_with_a_nan_weight_is_a_one_line_error(engine_checkpoint, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    tensors = load_file(f"{engine_checkpoint}/model.safetensors")
    key = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    tensors[key][2, 5] = float("nan")
    save_file(tensors, model / "model.safetensors")
    (model / "config.json").write_text(
        json.dumps(json.loads(open(f"{engine_checkpoint}/config.json").read()))
    )
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([PROMPT, [9]]))
    assert (
        main(
            [
                "generate",
                "--model",
                str(model),
                "--tp",
                "2",
                "--sp",
                "on",
                "--input-ids",
                str(ids),
                "--max-new-tokens",
                "4",
                "--output",
                str(tmp_path / "out.json"),
            ]
        )
        == 1
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"spmoe generate: error: rank [01] of 2 failed: FloatingPointError: "
        + re.escape(MESSAGE.format(step=1, phase="prefill", rid="generate-0", done=0)),
        last,
    ), last
    assert not (tmp_path / "out.json").exists()


def serve_with_one_nan_prompt(folder: str) -> dict:
    """Request "clean" runs steps 1 to 3; "nan" (whose prompt's first token has a NaN embedding) joins at step
    4; "after" joins once "nan" has ended (in the cache slot "nan" left). -> per request (tokens,
    finish_reason, error), and "clean"'s and "after"'s tokens from an engine with no NaN.

    They do not share a step: the slot cache's dense attention multiplies the masked-out keys of the other
    sequences by 0, and 0 * NaN is NaN, so a sequence batched with "nan" would get non-finite logits too (and
    end with its own error)."""
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1))
    clean = Request("clean", [9, 40], 3)
    after = Request("after", [12, 3, 7], 4)
    with torch.no_grad():
        engine = Engine(model, KVCache.for_model(model, 1, 16))
        expected = generate(engine, [clean.prompt, after.prompt], 4).outputs
        model.model.embed_tokens.weight[PROMPT[0], 3] = float("nan")
        engine = Engine(model, KVCache.for_model(model, 1, 16))
        got = {}
        for i in range(12):
            if i == 0:
                engine.add_request(clean)
            if i == 3:
                engine.add_request(Request("nan", PROMPT, 4))
            if i == 4:
                engine.add_request(after)
            for out in engine.step():
                tokens, *_ = got.get(out.request_id, ([],))
                got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    return {
        "got": got,
        "expected": {"clean": expected[0][:3], "after": expected[1]},
        "unfinished": engine.has_unfinished(),
        "free_slots": engine.cache.free_slots,
    }


def test_request_api_ends_only_the_request_with_non_finite_logits(engine_checkpoint):
    result = spawn(serve_with_one_nan_prompt, 1, engine_checkpoint)[0]
    got = result["got"]
    assert got["nan"] == ([], "error", MESSAGE.format(step=4, phase="prefill", rid="nan", done=0))
    assert got["clean"] == (result["expected"]["clean"], "length", None)
    assert got["after"] == (result["expected"]["after"], "length", None)
    assert not result["unfinished"] and result["free_slots"] == 1
