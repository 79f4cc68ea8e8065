"""The engine's CUDA-graph steps (`graphs.StepGraphs`: decode, drafter and mixed-step graphs) driven on
the CPU, each "graph" replayed by running its captured function again on its static inputs (`EagerReplay`:
what a replay computes, without CUDA), against the eager engine: the same tokens, logprobs and prompt
logprobs, over prompt chunks beside decoding sequences, a cached conversation's next turn, n = 3 forks,
greedy and sampled requests with penalties, without speculation, with MTP (k = 2), with the hybrid (MTP
+ n-gram, k = 2: the drafter's graph fed the lookup's leading drafts) and with the n-gram lookup alone
(its varying draft counts on mixed steps). The graph engine must have replayed both decode and mixed
steps. What this leaves to the GPU tests: the capture itself and the kernels inside a real graph
(`test_paged_engine_gpu.py`)."""

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn

from .conftest import ENGINE_CONFIG

BUDGET = 48  # tokens a step feeds: prompts are chunked beside the decoding sequences
PROMPT_LENS = (5, 40, 70, 130)


class EagerReplay:
    """Stands in for a captured graph: `replay()` runs the captured function again and writes what it returns
    into the tensors the capture returned (the graph's outputs)."""

    def __init__(self, run, outputs):
        self.run, self.outputs = run, outputs

    def replay(self) -> None:
        fresh = self.run()
        pairs = zip(self.outputs, fresh) if isinstance(fresh, tuple) else [(self.outputs, fresh)]
        for static, new in pairs:
            static.copy_(new)


def cpu_step_graphs():
    """`StepGraphs` whose captures are `EagerReplay`s, allowed on the CPU."""
    from spmoe.distributed import CommStats
    from spmoe.engine.runner import graphs

    class CpuStepGraphs(graphs.StepGraphs):
        # calls of each kind of replay, for the test
        replays = {
            "step": 0,
            "mixed_step": 0,
            "draft": 0,
        }

        def _warm(self, run) -> None:
            pass

        def step(self, *args):
            CpuStepGraphs.replays["step"] += 1
            return super().step(*args)

        def mixed_step(self, *args):
            CpuStepGraphs.replays["mixed_step"] += 1
            return super().mixed_step(*args)

        def draft(self, *args):
            CpuStepGraphs.replays["draft"] += 1
            return super().draft(*args)

        def _record(self, run):
            with torch.no_grad():
                outputs = run()
            self.captures += 1
            return EagerReplay(run, outputs), outputs, CommStats()

    return CpuStepGraphs


def run_waves(engine, prompts: list[list[int]], extra: list[int]) -> dict:
    """Three waves, each run to its end: four requests at once (greedy; sampled with top_p and logprobs;
    greedy with prompt logprobs; sampled with penalties), the next turn of the longest conversation (its
    prompt and output cached, `extra` new tokens), then n = 3 sampled choices of one prompt. -> request id ->
    (tokens, logprobs of the chosen tokens, prompt logprobs), and the graph replays per phase."""
    from spmoe.engine.request import Request, SamplingParams
    from spmoe.engine.stats import PHASES

    settings = [
        SamplingParams(),
        SamplingParams(1.0, top_p=0.9, seed=5, logprobs=2),
        SamplingParams(prompt_logprobs=1),
        SamplingParams(1.0, seed=6, presence_penalty=0.5, frequency_penalty=0.3),
    ]
    got = {}

    def wave(requests):
        for request in requests:
            engine.add_request(request)
            got[request.request_id] = ([], [], None)
        while engine.has_unfinished():
            for out in engine.step():
                tokens, logprobs, prompt = got[out.request_id]
                tokens += out.new_token_ids
                # (logprob, top entries) per token
                logprobs += [chosen for chosen, _ in out.logprobs or []]
                if out.prompt_logprobs is not None:
                    prompt = [None if entry is None else entry[0] for entry in out.prompt_logprobs]
                got[out.request_id] = (tokens, logprobs, prompt)

    wave([Request(f"first-{i}", p, 10, s) for i, (p, s) in enumerate(zip(prompts, settings))])
    turn = prompts[3] + got["first-3"][0] + extra
    wave([Request("turn", turn, 8, SamplingParams(logprobs=1))])
    wave(
        [Request(f"choice-{i}", prompts[1], 6, SamplingParams(1.0, seed=20 + i)) for i in range(3)]
    )
    return {"outputs": got, "replays": {name: engine.stats.phases[name].replays for name in PHASES}}


def graph_and_eager_engines(folder: str) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.runner import graphs, model_runner
    from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM
    from spmoe.models.deepseek_v32.weights import load_model

    # the CPU is no CUDA device and its experts sync the host: allowed here, where nothing is captured
    graphs.deployment_problems = lambda *args: []
    DeepseekV32ForCausalLM.graph_capturable = property(lambda self: (True, "replayed eagerly"))
    graphs_class = model_runner.StepGraphs = cpu_step_graphs()

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    gen = torch.Generator().manual_seed(0)
    vocab = ENGINE_CONFIG["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    extra = torch.randint(0, vocab, (20,), generator=gen).tolist()
    out = {}
    for name, speculation in SPECULATIONS.items():
        for use_graphs in (False, True):
            engine = Engine(
                model, PagedKVCache.for_model(model, 2**22), cuda_graphs=use_graphs, max_num_seqs=4,
                max_num_batched_tokens=BUDGET, max_model_len=512, speculation=speculation(),
            )  # fmt: skip
            before = dict(graphs_class.replays)
            out[name, use_graphs] = run_waves(engine, prompts, extra)
            out[name, use_graphs, "captures"] = engine.graph_captures()
            out[name, use_graphs, "replays"] = {
                kind: graphs_class.replays[kind] - before[kind] for kind in before
            }
            out[name, use_graphs, "sources"] = engine.metrics().by_source
    return out


def ngram(k: int, mtp: bool):
    from spmoe.engine.speculation import NgramConfig, Speculation

    lookup = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=2)
    return Speculation(num_speculative_tokens=k, mtp=mtp, lookup=lookup)


def mtp(k: int):
    from spmoe.engine.speculation import Speculation

    return Speculation(num_speculative_tokens=k)


SPECULATIONS = {  # name -> its speculation, built in the rank
    "none": lambda: mtp(0),
    "mtp": lambda: mtp(2),
    "hybrid": lambda: ngram(2, mtp=True),
    "ngram": lambda: ngram(2, mtp=False),
}


def test_graph_steps_replayed_on_the_cpu_match_the_eager_engine(engine_checkpoint):
    got = spawn(graph_and_eager_engines, 1, engine_checkpoint)[0]
    for k in SPECULATIONS:
        eager, graphed = got[k, False], got[k, True]
        drafter = k in ("mtp", "hybrid")
        # decode graphs for batches 1, 2, 4 (and their drafters with MTP), mixed steps of 16, 32, 48
        # tokens
        assert got[k, True, "captures"] == 3 * (2 if drafter else 1) + 3
        assert got[k, False, "captures"] == 0
        assert eager["replays"] == {"prefill": 0, "decode": 0, "draft": 0}
        assert got[k, False, "replays"] == {"step": 0, "mixed_step": 0, "draft": 0}
        # each kind of graph replayed: decode steps, mixed steps, the drafter
        kinds = got[k, True, "replays"]
        assert kinds["step"] > 0 and kinds["mixed_step"] > 0, kinds
        assert (kinds["draft"] > 0) == drafter, kinds
        if k in ("hybrid", "ngram"):  # the lookup led drafts (the drafter's graph fed them)
            sources = got[k, True, "sources"]
            assert sources["ngram"].chosen > 0, sources
            assert sources == got[k, False, "sources"]
        assert (
            graphed["replays"]["prefill"] > 0 and graphed["replays"]["draft"] == kinds["draft"]
        ), graphed["replays"]
        assert set(graphed["outputs"]) == set(eager["outputs"])
        for request_id, (tokens, logprobs, prompt) in eager["outputs"].items():
            g_tokens, g_logprobs, g_prompt = graphed["outputs"][request_id]
            assert g_tokens == tokens and tokens, (k, request_id, tokens, g_tokens)
            assert len(g_logprobs) == len(logprobs)
            for a, b in zip(g_logprobs, logprobs):
                assert abs(a - b) < 1e-4, (k, request_id, a, b)
            assert (g_prompt is None) == (prompt is None), request_id
            if prompt is not None:
                assert len(g_prompt) == len(prompt) == PROMPT_LENS[2] and g_prompt[0] is None
                assert max(abs(a - b) for a, b in zip(g_prompt[1:], prompt[1:])) < 1e-4
        # the logprobs asked for were produced (not silently empty)
        assert len(eager["outputs"]["first-1"][1]) == len(eager["outputs"]["first-1"][0]) > 0
        assert len(eager["outputs"]["turn"][1]) == len(eager["outputs"]["turn"][0]) > 0


def test_decode_graph_sizes_pad_at_most_a_quarter_above_32_sequences():
    """Every batch up to the engine's sequences replays a captured size (the smallest that fits, as `StepGraphs`
    picks it): below 2x its rows up to 32, at most a quarter more above; 18 graphs at the CUDA default of 256."""
    from spmoe.engine.runner.graphs import graph_sizes

    for max_batch in (1, 3, 32, 100, 256, 512):
        sizes = graph_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch, sizes
        for n in range(1, max_batch + 1):
            padded = min(s for s in sizes if s >= n)
            assert padded < 2 * n and (n <= 32 or 4 * (padded - n) <= n), (max_batch, n, padded)
    assert len(graph_sizes(256)) == 18
