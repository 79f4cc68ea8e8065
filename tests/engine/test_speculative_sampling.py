"""Sampled requests with MTP speculation follow the target's own distribution, end to end.

One spawned rank runs a speculating engine (k = 2) on the tiny checkpoint whose MTP layer agrees with the
target often (`conftest.py`: the LM head is a permutation of the embedding), so drafts are both accepted and
rejected: thousands of seeded requests for the same one-token prompt in one batch, in two sampled settings,
with greedy requests mixed in. The two tokens of the sampled requests are compared with the exact
distribution p(t1) p(t2 | t1), enumerated from transformers' forward of every continuation and
processed with the same temperature and top-p, by a chi-square test; the same counts against the other
setting's distribution fail it (the test can tell distributions apart). Greedy rows give the plain greedy
tokens, and a seeded request gives the same tokens in a smaller batch and without speculation.

The same again with mixed draft sources in one batch: the hybrid (MTP + n-gram lookup, k = 2) on a
prompt that holds its own greedy continuation, so that the lookup leads the drafts after the first
tokens it has seen in the prompt and MTP the others; both sources' drafts are accepted and rejected."""

import pytest
import torch
from msgspec.structs import replace

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.request import SamplingParams

from .test_rejection import drawn_probs

PROMPT, NEW, K = [23], 2, 2  # a prompt whose continuations MTP often drafts right
SETTINGS = {
    "cool": SamplingParams(temperature=0.3),
    "nucleus": SamplingParams(temperature=0.5, top_p=0.8),
}
PER_SETTING, GREEDY = 600, 16
LOGPROB_REQUESTS = [  # logprobs with penalties and a bias: the processed rows, drafts counted as generated
    SamplingParams(0.8, seed=7, logprobs=2, frequency_penalty=0.5, logit_bias=((5, 2.0),)),
    SamplingParams(logprobs=1, presence_penalty=-1.0),
    SamplingParams(1.0, seed=8, top_k=4, logprobs=0),
]


def requests(per_setting: int) -> list[SamplingParams]:
    """Every setting's seeded requests and the greedy ones, interleaved (a mixed batch)."""
    out = []
    for i in range(per_setting):
        out += [replace(params, seed=1000 * j + i) for j, params in enumerate(SETTINGS.values())]
        if i < GREEDY:
            out.append(SamplingParams())
    return out


def hybrid(k: int):
    """MTP and the n-gram lookup (n = 1, 2) with k draft slots."""
    from spmoe.engine.speculation import NgramConfig, Speculation

    lookup = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=2)
    return Speculation(num_speculative_tokens=k, lookup=lookup)


def generate_all(folder: str, prompt: list[int], mixed_sources: bool) -> dict:
    """Every sampled and greedy request for `prompt`, speculating with MTP (or, `mixed_sources`, the
    hybrid), then the checks' smaller runs."""
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import generate
    from spmoe.engine.request import Request
    from spmoe.engine.speculation import Speculation
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    params = requests(PER_SETTING)

    def speculation(k: int):
        return hybrid(k) if mixed_sources and k else Speculation(num_speculative_tokens=k)

    def run(sampling: list[SamplingParams], k: int):
        cache = KVCache.for_model(model, len(sampling), len(prompt) + NEW + K)
        engine = Engine(model, cache, speculation=speculation(k))
        return generate(engine, [prompt] * len(sampling), NEW, sampling)

    def with_logprobs(k: int) -> list[tuple[list[int], list]]:
        """Each of LOGPROB_REQUESTS' (tokens, logprobs), 8 tokens each, in one batch."""
        cache = KVCache.for_model(model, len(LOGPROB_REQUESTS), len(prompt) + 8 + K)
        engine = Engine(model, cache, speculation=speculation(k))
        for i, sampling in enumerate(LOGPROB_REQUESTS):
            engine.add_request(Request(str(i), prompt, 8, sampling))
        got = [([], []) for _ in LOGPROB_REQUESTS]
        while engine.has_unfinished():
            for out in engine.step():
                got[int(out.request_id)][0].extend(out.new_token_ids)
                got[int(out.request_id)][1].extend(out.logprobs or [])
        return got

    spec = run(params, K)
    return {
        "params": params,
        "outputs": spec.outputs,
        "speculative": spec.stats["speculative"],
        "plain_greedy": run([SamplingParams()], 0).outputs[0],
        "subset": run(params[:40], K).outputs,
        "unspeculated": run(params[:40], 0).outputs,
        "logprobs": with_logprobs(K),
        "logprobs_unspeculated": with_logprobs(0),
    }


def exact_distributions(folder: str, prompt: list[int]) -> dict[str, torch.Tensor]:
    """setting -> `[V, V]` the exact probability of each two first tokens after `prompt`, from
    transformers' logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        vocab = model.config.vocab_size
        grid = torch.arange(vocab)
        first = model(torch.tensor([prompt])).logits[0, -1:]  # [1, V]
        contexts = torch.cat([torch.tensor(prompt).expand(vocab, -1), grid[:, None]], 1)
        second = model(contexts).logits[:, -1]  # [V, V]
    out = {}
    for name, params in SETTINGS.items():
        out[name] = (
            drawn_probs(first, params).double()[0][:, None] * drawn_probs(second, params).double()
        )
    return out


def chi_square_p(tokens: list[list[int]], exact: torch.Tensor) -> float:
    """The chi-square test's p-value of the observed pairs against `exact` `[V, V]`: cells expected at least 5
    times on their own, the others pooled into one."""
    vocab, n = exact.shape[0], len(tokens)
    index = torch.tensor([a * vocab + b for a, b in tokens])
    observed = torch.bincount(index, minlength=vocab**2).double()
    expected = exact.reshape(-1) * n
    big = expected >= 5
    observed = torch.cat([observed[big], observed[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(observed) - 1), dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, statistic / 2).item()


def plain_greedy(folder: str) -> list[int]:
    """PROMPT's greedy tokens (no speculation)."""
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import generate
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    return generate(Engine(model, KVCache.for_model(model, 1, 16)), [PROMPT], 3).outputs[0]


@pytest.fixture(scope="module", params=["mtp", "mixed sources"])
def sampled(engine_checkpoint, request):
    """(the runs, the exact distributions, whether the drafts mixed sources)."""
    mixed = request.param == "mixed sources"
    prompt = PROMPT
    if mixed:
        # PROMPT, its first 3 greedy tokens, PROMPT again: the n-gram lookup finds its matches
        prompt = PROMPT + spawn(plain_greedy, 1, engine_checkpoint)[0] + PROMPT
    got = spawn(generate_all, 1, engine_checkpoint, prompt, mixed)[0]
    return got, exact_distributions(engine_checkpoint, prompt), mixed


def test_sampled_continuations_follow_the_target_distribution(sampled):
    got, exact, mixed = sampled
    by_setting = {name: [] for name in SETTINGS}
    for params, tokens in zip(got["params"], got["outputs"]):
        for name, setting in SETTINGS.items():
            if not params.greedy and replace(params, seed=0) == replace(setting, seed=0):
                by_setting[name].append(tokens)
    assert [len(v) for v in by_setting.values()] == [PER_SETTING] * len(SETTINGS)
    spec = got["speculative"]
    assert 0.05 < spec["per_position"][0] < 0.95, spec  # first drafts both accepted and rejected
    print("drafts by source:", spec["by_source"])
    for source in ("mtp", "ngram") if mixed else ("mtp",):
        counts = spec["by_source"][source]  # each source led drafts, accepted and rejected
        assert counts["chosen"] > 0 and 0 < counts["accepted"] < counts["proposed"], source
    for name, tokens in by_setting.items():
        assert chi_square_p(tokens, exact[name]) > 1e-3, name
    # the test tells the settings apart
    assert chi_square_p(by_setting["cool"], exact["nucleus"]) < 1e-6


def test_greedy_rows_and_seeds_in_a_speculating_batch(sampled):
    got, *_ = sampled
    greedy = [tokens for params, tokens in zip(got["params"], got["outputs"]) if params.greedy]
    assert greedy == [got["plain_greedy"]] * GREEDY
    # a request's seed decides its tokens, whatever the batch
    assert got["subset"] == got["outputs"][:40]
    assert got["unspeculated"] == got["outputs"][:40]  # and the same tokens without speculation


def test_logprobs_with_speculation_are_those_without(sampled):
    got, *_ = sampled
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(
        got["logprobs"], got["logprobs_unspeculated"]
    ):
        assert tokens == plain_tokens and len(logprobs) == len(tokens) == 8
        for (lp, top), (plain_lp, plain_top) in zip(logprobs, plain_logprobs):
            assert lp == pytest.approx(plain_lp, abs=1e-4) and lp <= 0
            assert [t for t, _ in top] == [t for t, _ in plain_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in plain_top], abs=1e-4)
