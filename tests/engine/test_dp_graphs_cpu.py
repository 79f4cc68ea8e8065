"""CUDA-graph steps under DP 2 (TP 1 and TP 2), driven on the CPU as `test_step_graphs_cpu.py`
drives them (each graph a captured function run again on its static inputs), in real gloo processes:
every rank replays the graph the DP ranks agreed on (`ranks.agree_step`), also where one rank feeds
a prompt chunk while the other decodes with MTP, and where one rank has nothing left to run.
Checked: each replay's collectives equal its capture's, nothing in a captured function reads a
tensor back to the host, the tokens equal the eager engine's at DP 2 (paged and slot cache), and an
engine not connected to its ranks refuses to step. The CPU experts loop over the experts present (a
host sync the GPU's never make): here they are swapped for a dense form that reads nothing back.
What this leaves to the GPU: the capture itself and NCCL inside a real graph."""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn

from .conftest import ENGINE_CONFIG
from .test_step_graphs_cpu import EagerReplay, cpu_step_graphs

BUDGET = 48  # tokens a step feeds: the 130-token prompt takes three chunks
# DP rank -> its prompts' lengths: rank 1 decodes beside rank 0's chunks, then has nothing to run
PROMPTS = {0: (130, 9), 1: (5,)}
MAX_NEW = 10
# (cache, drafts k): the slot cache has no mixed graphs, so its prompt steps are eager on every rank
CASES = (("paged", 0), ("paged", 2), ("slots", 2))
# calls that read a tensor back to the host (on a GPU: a sync, which a captured graph cannot hold)
HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
HOST_READS |= {"nonzero", "unique", "masked_select"}  # their output's shape is read back


class HostReads(TorchFunctionMode):
    """Records the name of every call in `HOST_READS` run while active, and any indexing by a bool
    mask (its shape depends on the data)."""

    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        index = args[1] if name == "__getitem__" else None
        if name in HOST_READS or (isinstance(index, torch.Tensor) and index.dtype == torch.bool):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def dense_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`TorchExperts.forward` without reading the routing back: every local expert on every row,
    weighted by the rows' gates for it (zero where a row did not pick it). x `[m, H]` ->
    `[m, H]`."""
    local, out = self.local_ids(ids), torch.zeros_like(x)
    for e in range(self.count):
        gate = ((local == e) * weights).sum(-1, keepdim=True).to(x.dtype)  # [m, 1]
        g, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        out += F.linear(F.silu(g) * up, self.down_proj[e]) * gate
    return out


def watched_step_graphs(log: dict):
    """`cpu_step_graphs()` whose captures and replays run under `HostReads` (names into
    log["reads"]) and count their collectives: each replay's that differ from its capture's go into
    log["mismatches"], log["checked"] counts the replays."""
    from spmoe.distributed import count_collectives

    @contextmanager
    def watched():
        with torch.no_grad(), count_collectives() as collectives, HostReads(log["reads"]):
            yield collectives

    class CheckedReplay(EagerReplay):
        def __init__(self, run, outputs, captured):
            super().__init__(run, outputs)
            self.captured = captured

        def replay(self) -> None:
            with watched() as replayed:
                super().replay()
            log["checked"] += 1
            if replayed.as_dict() != self.captured.as_dict():
                log["mismatches"].append((self.captured.as_dict(), replayed.as_dict()))

    class WatchedStepGraphs(cpu_step_graphs()):
        def _record(self, run):
            with watched() as captured:
                outputs = run()
            self.captures += 1
            return CheckedReplay(run, outputs, captured), outputs, captured

    return WatchedStepGraphs


def dp_engines(folder: str) -> dict:
    """On each rank: this DP rank's prompts run to completion with and without graphs (`CASES`)
    -> the tokens, what each graph step agreed (this rank's needs, every rank's shape) and the
    checks' log."""
    from spmoe.distributed import get_parallel_state
    from spmoe.distributed.layout import largest_dp_batch
    from spmoe.engine import ranks
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.runner import graphs, model_runner
    from spmoe.layers.moe.experts.torch_ref import TorchExperts
    from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    # the CPU is no CUDA device: allowed here, where nothing is captured
    graphs.deployment_problems = lambda *args: []
    DeepseekV32ForCausalLM.graph_capturable = property(lambda self: (True, "replayed eagerly"))
    TorchExperts.forward = dense_experts
    log = {"reads": [], "mismatches": [], "checked": 0}
    model_runner.StepGraphs = watched_step_graphs(log)
    probe = []  # the checker finds the host read of the eager agreement
    with HostReads(probe):
        largest_dp_batch(3)
    steps, agree = [], ranks.agree_step

    def logged_agree(needs):
        agreed = agree(needs)
        steps.append((needs, engine.runner.graphs.shape(agreed)))
        return agreed

    ranks.agree_step = logged_agree
    parallel = ParallelConfig(tensor_parallel_size=state.tp_size, data_parallel_size=state.dp_size)
    model = load_model(folder, parallel, with_mtp=True)
    gen = torch.Generator().manual_seed(state.dp_rank)
    vocab = ENGINE_CONFIG["vocab_size"]
    prompts = [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPTS[state.dp_rank]
    ]
    out = {"probe": probe, "log": log}
    for cache, k in CASES:
        for use_graphs in (False, True):
            steps = []
            engine = Engine(
                model,
                PagedKVCache.for_model(model, 2**22)
                if cache == "paged"
                else KVCache.for_model(model, 4, 160),
                num_speculative_tokens=k, cuda_graphs=use_graphs, max_num_seqs=4,
                max_num_batched_tokens=BUDGET, max_model_len=256, ranks=ranks.channel(),
            )  # fmt: skip
            out[cache, k, use_graphs] = ranks.generate(engine, prompts, MAX_NEW).outputs
            out[cache, k, use_graphs, "steps"] = steps
    # without its channel to the ranks, which must agree on each step's graph
    try:
        Engine(
            model, PagedKVCache.for_model(model, 2**22), cuda_graphs=True, max_num_seqs=4,
            max_num_batched_tokens=BUDGET, max_model_len=256,
        )  # fmt: skip
    except ValueError as e:
        out["alone"] = str(e)
    return out


def check_dp_graphs(got: list[dict], tp: int) -> None:
    by_dp = got[::tp]  # TP rank 0 of each DP group (its TP peers run the same steps)
    for rank, out in enumerate(got):
        assert out["probe"] == ["item"], out["probe"]
        assert "expected its channel, ranks=spmoe.engine.ranks.channel()" in out.get("alone", "")
        assert out["log"]["reads"] == [], (rank, sorted(set(out["log"]["reads"])))
        assert out["log"]["checked"] > 0 and out["log"]["mismatches"] == [], (rank, out["log"])
        for case in CASES:
            assert out[(*case, True)] == out[(*case, False)] and all(out[(*case, False)]), case
            assert out[(*case, False, "steps")] == []  # eager engines agree on nothing
    for cache, k in CASES:
        # each DP rank's (needs, shape) per step
        per_rank = [out[cache, k, True, "steps"] for out in by_dp]
        assert len(per_rank[0]) == len(per_rank[1]) > 0, k
        assert all(shape_0 == shape_1 for (_, shape_0), (_, shape_1) in zip(*per_rank)), k
        steps = [(a, b, shape) for (a, shape), (b, _) in zip(*per_rank)]
        # rank 0 feeds a prompt chunk while rank 1 decodes: both run the mixed graph (paged cache),
        # or both eagerly (slot cache)
        beside = "mixed" if cache == "paged" else "eager"
        assert any(
            not a.decode and b.decode and b.sequences and s.kind == beside for a, b, s in steps
        ), (cache, k, steps)
        # rank 1 has nothing left while rank 0 decodes: it replays the decode graph with pad rows
        idle = [s for a, b, s in steps if a.sequences and not b.sequences]
        assert any(s.kind == "decode" for s in idle), (cache, k, steps)
        assert any(s.kind == "decode" and s.draft_graph == (k > 0) for _, _, s in steps), k
        assert all(s.kind in ("decode", beside) for _, _, s in steps), (cache, k)


def test_dp2_tp1_graph_steps_match_their_capture_and_the_eager_engine(engine_checkpoint):
    config = ParallelConfig(tensor_parallel_size=1, data_parallel_size=2)
    check_dp_graphs(spawn(dp_engines, 2, engine_checkpoint, config=config), tp=1)


def test_dp2_tp2_graph_steps_match_their_capture_and_the_eager_engine(engine_checkpoint):
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    check_dp_graphs(spawn(dp_engines, 4, engine_checkpoint, config=config), tp=2)


def test_an_agreed_dp_batch_smaller_than_the_rank_s_own_is_refused():
    """A step's largest DP batch decided before the forward must hold this rank's rows."""
    import pytest

    from spmoe.distributed.layout import largest_dp_batch

    assert largest_dp_batch(3, 8) == 8
    with pytest.raises(ValueError, match="agreed is 4 rows; this rank has 5"):
        largest_dp_batch(5, 4)
