"""A NaN in the weights ends generation with an error naming the step and the sequence, never a run of
token 0: greedy, sampled and speculative steps, in prefill and in decode; and `spmoe generate` prints it as
one line."""

import json
import re

import torch
from safetensors.torch import load_file, save_file

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.sampling import SamplingParams
from spmoe.entrypoints.cli import main

PROMPT = [5, 17, 33]
MESSAGE = ("non-finite logits (NaN or inf) at step {step} ({phase}) for sequence 0 after {done} generated tokens: "
           "no token can be chosen, so the run stops (check the checkpoint for NaN / inf weights)")


def generate_with_nan(folder: str) -> dict:
    from spmoe.engine.engine import Engine
    from spmoe.engine.kv_cache import KVCache
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), with_mtp=True)

    def attempt(sampling=SamplingParams(), k=0):
        engine = Engine(model, KVCache.for_model(model, 1, 16), sampling, (), k)
        try:
            return engine.generate([PROMPT], 4).outputs[0]
        except FloatingPointError as e:
            return str(e)

    results = {}
    with torch.no_grad():
        for name, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=0.8, seed=1))):
            first = attempt(sampling)[0]  # the clean model's first token (same seed, same draw), fed at step 2
            results[f"{name}: first token"] = first
            row = model.model.embed_tokens.weight[first].clone()
            model.model.embed_tokens.weight[first, 3] = float("nan")  # only that token's embedding
            results[f"{name}, NaN from decode on"] = attempt(sampling)
            model.model.embed_tokens.weight[first] = row
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")  # every token, from prefill on
        results["greedy, NaN from prefill on"] = attempt()
        results["speculative, NaN from prefill on"] = attempt(k=2)
    return results


def test_nan_weights_stop_the_run_naming_the_step(engine_checkpoint):
    results = spawn(generate_with_nan, 1, engine_checkpoint)[0]
    assert results["greedy: first token"] not in PROMPT and results["sampled: first token"] not in PROMPT
    decode = MESSAGE.format(step=2, phase="decode", done=1)
    prefill = MESSAGE.format(step=1, phase="prefill", done=0)
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
    (model / "config.json").write_text(json.dumps(json.loads(open(f"{engine_checkpoint}/config.json").read())))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([PROMPT, [9]]))
    assert main(["generate", "--model", str(model), "--tp", "2", "--sp", "on", "--input-ids", str(ids),
                 "--max-new-tokens", "4", "--output", str(tmp_path / "out.json")]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"spmoe generate: error: rank [01] of 2 failed: FloatingPointError: " +
                        re.escape(MESSAGE.format(step=1, phase="prefill", done=0)), last), last
    assert not (tmp_path / "out.json").exists()
