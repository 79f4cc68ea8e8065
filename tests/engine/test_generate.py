"""Generation across TP 1, 2, 3 and SP off / on (both scopes): greedy output identical everywhere, with
sequences that finish at different steps, queued admission, a single live sequence (N < t at TP 3), MTP
speculation equal to plain greedy decoding with identical acceptance statistics, seeded sampling, the KV
cache against a cache-less forward, and the static decode view (the CUDA graphs' padded step) against the
engine's own view.

One spawned group per TP size runs every case; the comparisons happen here.
"""

import os
import signal
import time

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import RankFailed, get_parallel_state, spawn
from spmoe.engine.ranks import channel, generate
from spmoe.engine.request import SamplingParams
from spmoe.entrypoints.jobs import flatten

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [79, 32], [38], [46, 26, 43, 38]]
LOOKUP_PROMPTS = [
    [3, 14, 15, 92, 65, 3, 14, 15, 92, 65, 3, 14],
    [79, 32, 79, 32, 79],
    [38],
    [4, 5] * 4,
]
EOS = (51, 74, 39)  # with this checkpoint the four sequences stop after 3, 10, 5 and 7 tokens
MAX_NEW = 10
MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3),
    SamplingParams(),
    SamplingParams(temperature=1.2, seed=4),
]
CASES = {  # name -> (prompts, engine / generate arguments)
    "greedy": (PROMPTS, dict(eos=EOS, record=True)),
    "greedy_full": (PROMPTS, dict()),
    "queued": (PROMPTS, dict(eos=EOS, max_seqs=2)),
    "single": ([[38]], dict()),
    "spec1": (PROMPTS, dict(eos=EOS, k=1)),
    "spec3": (PROMPTS, dict(k=3)),
    "spec2_queued": (PROMPTS, dict(eos=EOS, k=2, max_seqs=3)),
    "sampled": (PROMPTS, dict(sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=3))),
    "sampled_again": (PROMPTS, dict(sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=3))),
    # speculation with sampled and greedy requests in one batch: prompts 0 and 2 greedy, 1 and 3 sampled
    "spec_mixed": (PROMPTS, dict(k=2, sampling=MIXED)),
    "spec_mixed_again": (PROMPTS, dict(k=2, sampling=MIXED)),
    # lookups in the context (prompts that repeat themselves, 24 tokens): alone, and beside MTP
    "lookup_plain": (LOOKUP_PROMPTS, dict(new=24)),
    "spec_ngram": (LOOKUP_PROMPTS, dict(new=24, spec=("ngram", False, 3))),
    "spec_suffix": (LOOKUP_PROMPTS, dict(new=24, spec=("suffix", False, 4))),
    "spec_hybrid": (LOOKUP_PROMPTS, dict(new=24, spec=("ngram", True, 3))),
    "spec_hybrid_suffix": (LOOKUP_PROMPTS, dict(new=24, eos=EOS, spec=("suffix", True, 4))),
    "lookup_mixed": (LOOKUP_PROMPTS, dict(new=24, sampling=MIXED)),
    "spec_hybrid_mixed": (LOOKUP_PROMPTS, dict(new=24, sampling=MIXED, spec=("ngram", True, 3))),
}


def speculation(kw: dict):
    """A case's draft sources: `spec` (lookup, with MTP, k), else MTP with `k` drafts (or none)."""
    from spmoe.engine.speculation import NgramConfig, Speculation, SuffixConfig

    if "spec" not in kw:
        return Speculation(num_speculative_tokens=kw.get("k", 0))
    lookup, mtp, k = kw["spec"]
    config = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3) if lookup == "ngram" else None
    return Speculation(num_speculative_tokens=k, mtp=mtp, lookup=config or SuffixConfig())


def run_engine(folder: str, modes: list[tuple[str, str]]):
    """Every case under every SP mode -> {(sp, scope, case): (outputs, speculative stats, cache error)}."""
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    state, results = get_parallel_state(), {}
    for sp, scope in modes:
        parallel = ParallelConfig(tensor_parallel_size=state.tp_size, sp=sp, sp_scope=scope)
        model = load_model(folder, parallel, with_mtp=True)
        for name, (prompts, kw) in CASES.items():
            cache = KVCache.for_model(model, kw.get("max_seqs", len(prompts)), 48)
            engine = Engine(model, cache, ranks=channel(), speculation=speculation(kw))
            gen = generate(
                engine,
                prompts,
                kw.get("new", MAX_NEW),
                kw.get("sampling", SamplingParams()),
                kw.get("eos", ()),
                record_logits=kw.get("record", False),
            )
            assert cache.free_slots == cache.max_seqs  # every finished sequence gave its slot back
            results[(sp, scope, name)] = (
                gen.outputs,
                gen.stats.get("speculative"),
                cacheless_error(model, prompts, gen) if kw.get("record") else None,
            )
        results[(sp, scope, "static_decode")] = (None, None, static_decode_error(model))
    return results


def static_decode_error(model) -> float:
    """Prefill 3 prompts, then one decode step two ways: the engine's view, and `decode_view` padded to 4
    rows with a pad row in the scratch slot, as a CUDA graph replays it. -> largest relative logit difference
    over the 3 real rows."""
    from spmoe.engine.cache.slots import KVCache

    prompts, cache = [[5, 6, 7], [8], [9, 10]], KVCache.for_model(model, 3, 8)
    slots = [cache.allocate() for _ in prompts]
    with torch.no_grad():
        view = cache.view(slots, [0] * 3, [len(p) for p in prompts])
        model(
            torch.tensor([t for p in prompts for t in p]),
            view.positions,
            [len(p) for p in prompts],
            view,
        )
        starts, new = [len(p) for p in prompts], torch.tensor([11, 12, 13])
        view = cache.view(slots, starts, [1] * 3)
        want = model(new, view.positions, [1] * 3, view)
        positions = torch.tensor(starts + [0])
        padded = cache.decode_view(torch.tensor(slots + [cache.scratch_slot]), positions)
        got = model(torch.cat([new, torch.zeros(1, dtype=torch.long)]), positions, [1] * 4, padded)[
            :3
        ]
    return ((got - want).abs().max() / want.abs().max()).item()


def cacheless_error(model, prompts, gen) -> float:
    """Largest relative difference between the logits recorded while generating (KV cache) and one cache-less
    forward over each prompt plus its output."""
    seqs = [p + out[:-1] for p, out in zip(prompts, gen.outputs)]
    with torch.no_grad():
        logits = model(*flatten(seqs, model.lm_head.weight.device))
    worst, start = 0.0, 0
    for prompt, seq, recorded in zip(prompts, seqs, gen.logits):
        want = logits[start + len(prompt) - 1 : start + len(seq)]
        worst = max(worst, ((recorded - want).abs().max() / want.abs().max()).item())
        start += len(seq)
    return worst


@pytest.fixture(scope="module")
def generations(engine_checkpoint):
    """{tp: per-rank results of run_engine}."""
    modes = {1: [("off", "moe")], 2: [("off", "moe"), ("on", "moe"), ("on", "all")]}
    modes[3] = modes[2]
    return {tp: spawn(run_engine, tp, engine_checkpoint, modes[tp]) for tp in (1, 2, 3)}


def test_greedy_identical_across_tp_and_sp(generations):
    reference = generations[1][0][("off", "moe", "greedy")][0]
    assert len({len(out) for out in reference}) == 4, (
        f"sequences should finish at different steps: {reference}"
    )
    assert all(out[-1] in EOS for out in reference if len(out) < MAX_NEW)
    full = generations[1][0][("off", "moe", "greedy_full")][0]
    for tp, ranks in generations.items():
        for (sp, scope, name), (outputs, _, _) in ranks[0].items():
            if name in ("greedy", "queued", "spec1", "spec2_queued"):
                assert outputs == reference, (tp, sp, scope, name)
            elif name in ("greedy_full", "spec3"):
                assert outputs == full, (tp, sp, scope, name)
            elif name == "single":
                assert outputs == generations[1][0][("off", "moe", "single")][0], (tp, sp, scope)
        assert all(rank == ranks[0] for rank in ranks[1:]), f"tp={tp}: ranks disagree"


def test_lookup_drafts_change_no_token(generations):
    """n-gram and suffix drafts, alone and beside MTP (the hybrid), greedy and seeded sampling mixed
    in one batch: the tokens are those without speculation, under every TP size and SP mode; the lookup
    led drafts that were accepted and drafts that were rejected."""
    plain = generations[1][0][("off", "moe", "lookup_plain")][0]
    mixed = generations[1][0][("off", "moe", "lookup_mixed")][0]
    assert mixed != plain  # really sampled
    spec = generations[1][0][("off", "moe", "spec_hybrid")][1]
    print(f"hybrid by source: {spec['by_source']}")
    for source in ("mtp", "ngram"):
        counts = spec["by_source"][source]
        assert counts["chosen"] > 0 and 0 < counts["accepted"] < counts["proposed"], source
    assert spec["mean_accepted_length"] > 1
    for tp, ranks in generations.items():
        for (sp, scope, name), (outputs, _, _) in ranks[0].items():
            if name in ("spec_ngram", "spec_suffix", "spec_hybrid"):
                assert outputs == plain, (tp, sp, scope, name)
            elif name == "spec_hybrid_suffix":
                assert outputs == [cut_at(out, EOS) for out in plain], (tp, sp, scope, name)
            elif name == "spec_hybrid_mixed":
                assert outputs == mixed, (tp, sp, scope, name)


def cut_at(tokens: list[int], stops: tuple[int, ...]) -> list[int]:
    """`tokens` up to and with the first of `stops` in them."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def test_kv_cache_matches_cacheless_forward(generations):
    for tp, ranks in generations.items():
        for (sp, scope, name), (_, _, error) in ranks[0].items():
            if error is not None:
                assert error < 1e-4, (tp, sp, scope, name, error)
    assert all(("off", "moe", "static_decode") in ranks[0] for ranks in generations.values())


def test_speculation_statistics_identical_with_sp_on_and_off(generations):
    reference = generations[1][0][("off", "moe", "spec3")][1]
    print(f"spec3 acceptance: {reference}")
    assert 0 < reference["acceptance_rate"] < 1, (
        "the checkpoint should give both accepted and rejected drafts"
    )
    assert (
        reference["per_position"][0] >= reference["per_position"][1] >= reference["per_position"][2]
    )
    for tp, ranks in generations.items():
        for (sp, scope, name), (_, spec, _) in ranks[0].items():
            if name.startswith("spec"):
                assert spec == generations[1][0][("off", "moe", name)][1], (tp, sp, scope, name)


def test_seeded_sampling(generations):
    for tp, ranks in generations.items():
        for sp, scope in {(sp, scope) for sp, scope, _ in ranks[0]}:
            sampled = ranks[0][(sp, scope, "sampled")][0]
            assert sampled == ranks[0][(sp, scope, "sampled_again")][0]
            assert sampled != ranks[0][(sp, scope, "greedy_full")][0]
            assert sampled == generations[1][0][("off", "moe", "sampled")][0], (tp, sp, scope)


def test_seeded_sampling_with_speculation(generations):
    """A batch of greedy and sampled requests with MTP drafts: the greedy rows give plain greedy tokens, the
    sampled rows their seed's tokens, again in a second run and under every TP size and SP mode."""
    full = generations[1][0][("off", "moe", "greedy_full")][0]
    reference = generations[1][0][("off", "moe", "spec_mixed")][0]
    assert [reference[0], reference[2]] == [full[0], full[2]]
    assert [reference[1], reference[3]] != [full[1], full[3]]  # really sampled
    for tp, ranks in generations.items():
        for sp, scope in {(sp, scope) for sp, scope, _ in ranks[0]}:
            mixed = ranks[0][(sp, scope, "spec_mixed")][0]
            assert mixed == ranks[0][(sp, scope, "spec_mixed_again")][0] == reference, (
                tp,
                sp,
                scope,
            )


def generate_then_die(folder: str):
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    model = load_model(folder, ParallelConfig(tensor_parallel_size=2, sp="on"))

    def on_step(done: int, live: int, prefilled: int) -> None:
        if state.rank == 1 and done >= 3:
            os.kill(os.getpid(), signal.SIGKILL)

    engine = Engine(model, KVCache.for_model(model, 1, 64), ranks=channel())
    generate(engine, [[1, 2, 3]], 50, on_step=on_step)


def test_killed_rank_ends_the_run(engine_checkpoint):
    start = time.monotonic()
    with pytest.raises(
        RankFailed, match=r"rank 1 of 2 was killed by SIGKILL \(possibly out of memory\)"
    ):
        spawn(generate_then_die, 2, engine_checkpoint)
    assert time.monotonic() - start < 60


def test_data_parallel_generation(engine_checkpoint):
    """TP2 x DP2 (SP off, on, on with MTP) and TP1 x DP2 give TP1's greedy tokens; with a single prompt on
    two DP groups, the idle group keeps stepping with empty batches (speculation included) until the other
    is done."""
    from spmoe.engine.args import EngineArgs
    from spmoe.entrypoints.generate import GenerateOptions, run_generate

    def generate(prompts, tp=1, dp=1, sp="off", k=0):
        args = EngineArgs(
            tp=tp, dp=dp, sp=sp, speculative="mtp" if k else None, num_speculative_tokens=k or None
        )
        return run_generate(
            engine_checkpoint,
            prompts,
            GenerateOptions(MAX_NEW, eos_token_ids=EOS, progress=False, engine=args),
        )

    reference, single = generate(PROMPTS), generate([[38]])
    for tp, dp, sp, k in [(2, 2, "off", 0), (2, 2, "on", 0), (2, 2, "on", 2), (1, 2, "off", 0)]:
        got = generate(PROMPTS, tp, dp, sp, k)
        assert got.outputs == reference.outputs, (tp, dp, sp, k)
        assert got.stats["generated_tokens"] == sum(map(len, reference.outputs))
    assert generate([[38]], 2, 2, "on", 2).outputs == single.outputs
