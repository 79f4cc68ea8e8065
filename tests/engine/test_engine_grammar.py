"""Structured output inside the engine, on 2 TP ranks (gloo): 10 schemas x 5 sampled requests, two
greedy requests per schema (with an eos id and without) and 2 free ones in one continuous batch of
the random-weight model, without and with MTP speculation (k = 2; the checkpoint's MTP layer agrees
with the target often, `write_random_checkpoint`); every constrained output is valid under its
schema, speculation changes no token, and every rank commits the same tokens."""

import json

import jsonschema
import pytest

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from tests.engine.conftest import ENGINE_CONFIG
from tests.engine.test_cuda_graphs import GRAPH_CONFIG
from tests.engine.test_grammar import SCHEMAS
from tests.multigpu import requires_gpus

# the demo tokenizer's vocabulary
CONFIG = {
    **ENGINE_CONFIG,
    "vocab_size": 264,
    "max_position_embeddings": 1024,
}
# the GPU's Triton kernels want wider layers (as in test_paged_engine_gpu.py)
GPU_CONFIG = {
    **GRAPH_CONFIG,
    "index_topk": 64,
    "kv_lora_rank": 128,
    "vocab_size": 264,
    "max_position_embeddings": 1024,
}
PROMPT = [11, 42, 7, 99]
MAX_NEW = 300
DRAFTS = 2  # MTP drafts per step in the speculating engine
# the random model closes a free string after ~200 bytes on average: the one unbounded string gets a
# bound here
UNBOUNDED = 8
BOUNDED = dict(
    SCHEMAS[UNBOUNDED],
    properties={**SCHEMAS[UNBOUNDED]["properties"], "label": {"type": "string", "maxLength": 16}},
)
ENGINE_SCHEMAS = [BOUNDED if i == UNBOUNDED else schema for i, schema in enumerate(SCHEMAS)]


def run_constrained(folder: str, tp: int = 2, device: str = "cpu", bf16: bool = False) -> dict:
    """Every request with and without speculation on `tp` ranks of `device` (float32, or bfloat16
    with `bf16`)."""
    import torch

    from spmoe.distributed import get_parallel_state
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import channel
    from spmoe.engine.request import GrammarSpec, Request, SamplingParams
    from spmoe.engine.sampling.grammar import GrammarCompiler
    from spmoe.engine.speculation import NgramConfig, Speculation
    from spmoe.entrypoints.tokenizer import load_tokenizer
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = load_model(
        folder, ParallelConfig(tensor_parallel_size=tp), dtype, device, with_mtp=True
    )
    tokenizer = load_tokenizer(folder)
    grammars = GrammarCompiler.from_tokenizer(tokenizer, CONFIG["vocab_size"])
    eos = (tokenizer.eos_token_id,)
    requests = [
        Request(
            f"s{i}-{j}",
            PROMPT,
            MAX_NEW,
            SamplingParams(1.0, 1.0, 100 * i + j),
            eos,
            GrammarSpec("json_schema", json.dumps(schema)),
        )
        for i, schema in enumerate(ENGINE_SCHEMAS)
        for j in range(5)
    ]
    requests += [
        Request(
            f"g{i}",
            PROMPT,
            MAX_NEW,
            SamplingParams(),
            eos,
            GrammarSpec("json_schema", json.dumps(schema)),
        )
        for i, schema in enumerate(ENGINE_SCHEMAS)
    ]
    # no eos id (the server's ignore_eos): only the grammar's stop token ends them, drafted or not
    requests += [
        Request(
            f"n{i}",
            PROMPT,
            MAX_NEW,
            SamplingParams(),
            (),
            GrammarSpec("json_schema", json.dumps(schema)),
        )
        for i, schema in enumerate(ENGINE_SCHEMAS)
    ]
    requests += [
        Request("free-0", PROMPT, 12, SamplingParams(1.0, 1.0, 7), ()),
        Request("free-1", PROMPT, 12, SamplingParams(), ()),
    ]

    def run(drafts: int, lookup=None) -> tuple[dict, dict, tuple[int, int, int]]:
        """-> every request's tokens, (finish reason, error), and (tokens generated, drafts
        proposed, accepted) as the engine counted them (with a `lookup` beside MTP: its drafts led,
        proposed and accepted)."""
        cache = PagedKVCache.for_model(model, 64 << 20)
        graphs = device == "cuda"  # on the GPU the decode and verification steps replay CUDA graphs
        speculation = Speculation(num_speculative_tokens=drafts, lookup=lookup)
        # on 2 TP ranks: rank 0 decides the admissions, rank 1 follows
        engine = Engine(
            model, cache, cuda_graphs=graphs, max_num_seqs=64, max_model_len=1024,
            grammars=grammars, ranks=channel(), speculation=speculation,
        )  # fmt: skip
        outputs, reasons = {r.request_id: [] for r in requests}, {}
        for request in requests:
            engine.add_request(request)
        with torch.no_grad():
            while engine.has_unfinished():
                for out in engine.step():
                    outputs[out.request_id] += out.new_token_ids
                    if out.finish_reason:
                        reasons[out.request_id] = (out.finish_reason, out.error)
        metrics = engine.metrics()
        if lookup is not None:
            looked_up = metrics.by_source["ngram"]
            return outputs, reasons, (looked_up.chosen, looked_up.proposed, looked_up.accepted)
        return (
            outputs,
            reasons,
            (metrics.generated_tokens, metrics.draft_proposed, metrics.draft_accepted),
        )

    outputs, reasons, counts = run(0)
    speculated, speculated_reasons, speculated_counts = run(DRAFTS)
    ngram = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3)
    hybrid, hybrid_reasons, hybrid_counts = run(DRAFTS, ngram)
    refusals = []
    try:
        Engine(
            model,
            PagedKVCache.for_model(model, 8 << 20),
            max_num_seqs=4,
            max_model_len=64,
            ranks=channel(),
        ).validate(Request("g", PROMPT, 4, SamplingParams(), eos, GrammarSpec("json_object")))
    except ValueError as e:
        refusals.append(str(e))
    return {
        "rank": state.rank,
        "outputs": outputs,
        "reasons": reasons,
        "speculated": speculated,
        "speculated_reasons": speculated_reasons,
        "counts": counts,
        "speculated_counts": speculated_counts,
        "hybrid": hybrid,
        "hybrid_reasons": hybrid_reasons,
        "hybrid_counts": hybrid_counts,
        "refusals": refusals,
    }


def checkpoint(folder, config: dict):
    """`folder` with a random checkpoint of `config` and the demo tokenizer -> the tokenizer."""
    from spmoe.entrypoints.demo import write_demo_tokenizer
    from spmoe.entrypoints.tokenizer import load_tokenizer
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, config, folder, 1)
    write_demo_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def constrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grammar_ckpt")
    tokenizer = checkpoint(folder, CONFIG)
    results = spawn(
        run_constrained,
        2,
        str(folder),
        config=ParallelConfig(tensor_parallel_size=2),
        timeout_s=600,
    )
    return results, tokenizer


def test_every_constrained_output_is_valid(constrained):
    (rank0, _), tokenizer = constrained
    assert_valid(rank0, tokenizer)


def assert_valid(got: dict, tokenizer, greedy_may_run_out: bool = False) -> None:
    """Every constrained output of both runs ends with the eos and is valid under its schema. With
    `greedy_may_run_out`, a greedy one may instead reach max_new_tokens (random weights' argmax can
    repeat one item of a schema that allows any number of them), but at most half of them."""
    eos = tokenizer.eos_token_id
    valid, ran_out = 0, 0
    for outputs, reasons in (
        (got["outputs"], got["reasons"]),
        (got["speculated"], got["speculated_reasons"]),
    ):
        for i, schema in enumerate(ENGINE_SCHEMAS):
            for rid in [f"s{i}-{j}" for j in range(5)] + [f"g{i}", f"n{i}"]:
                if greedy_may_run_out and rid[0] in "gn" and reasons[rid] == ("length", None):
                    assert len(outputs[rid]) == MAX_NEW, (rid, len(outputs[rid]))
                    ran_out += 1
                    continue
                assert reasons[rid] == ("stop", None), (rid, reasons[rid])
                tokens = outputs[rid]
                assert tokens[-1] == eos
                # the text the server would send (a byte sequence that is no UTF-8 becomes U+FFFD)
                jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), schema)
                valid += 1
        assert [len(outputs[f"free-{k}"]) for k in (0, 1)] == [12, 12]  # no grammar: untouched
    assert valid + ran_out == 2 * 70 and ran_out <= 2 * 10, (valid, ran_out)


def test_speculation_commits_the_tokens_it_would_without(constrained):
    """MTP drafts (k = 2) change no token of a constrained request, greedy or seeded: each row of a
    sequence that fed drafts is masked by its grammar after those drafts, and a grammar that ends at
    a draft ends the sequence there (the engine counts no token past it). The drafts were both
    accepted and rejected; drafting among the tokens the grammar allows keeps far more of them than
    the 1.3% that unconstrained drafts kept."""
    (rank0, _), _ = constrained
    assert rank0["speculated"] == rank0["outputs"]
    assert rank0["speculated_reasons"] == rank0["reasons"]
    generated, proposed, accepted = rank0["speculated_counts"]
    assert generated == rank0["counts"][0] == sum(map(len, rank0["outputs"].values()))
    assert 0.3 * proposed < accepted < proposed, rank0["speculated_counts"]


def test_lookup_drafts_under_grammars_change_no_token(constrained):
    """The hybrid (MTP + n-gram lookup, k = 2): the lookup's drafts are not masked (a draft the
    grammar refuses is rejected by the masked row before it), and no token changes; it led drafts
    that were accepted and drafts that were rejected."""
    (rank0, _), _ = constrained
    assert rank0["hybrid"] == rank0["outputs"]
    assert rank0["hybrid_reasons"] == rank0["reasons"]
    led, proposed, accepted = rank0["hybrid_counts"]
    assert led > 0 and 0 < accepted < proposed, rank0["hybrid_counts"]


def test_every_rank_commits_the_same_tokens(constrained):
    (rank0, rank1), _ = constrained
    assert rank0["outputs"] == rank1["outputs"]
    assert rank0["speculated"] == rank1["speculated"]
    assert rank0["hybrid"] == rank1["hybrid"]


def test_refused_without_a_compiler(constrained):
    (rank0, _), _ = constrained
    assert rank0["refusals"] == ["request 'g' has a grammar, but this engine has no compiler"]


@pytest.mark.gpu
@requires_gpus(1)
def test_constrained_speculation_on_the_gpu(tmp_path):
    """bfloat16 with the Triton kernels on one GPU, decode and verification steps replayed from CUDA
    graphs, xgrammar's Triton bitmask kernel on the verified rows and on the drafter's logits (the
    drafter eager from the graph's hidden states): every output valid, drafts both accepted and
    rejected. (The tokens with and without speculation may differ: bfloat16 rounds the k + 1 rows of
    a verify step differently from one decode row.)"""
    tokenizer = checkpoint(tmp_path, GPU_CONFIG)
    got = spawn(run_constrained, 1, str(tmp_path), 1, "cuda", True, device="cuda", timeout_s=600)[0]
    print("generated, proposed, accepted:", got["counts"], got["speculated_counts"])
    assert_valid(got, tokenizer, greedy_may_run_out=True)
    _, proposed, accepted = got["speculated_counts"]
    assert 0 < accepted < proposed
