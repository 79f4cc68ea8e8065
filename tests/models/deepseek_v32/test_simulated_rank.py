"""The simulated rank (`ParallelConfig.simulate_rank`): rank 0 of a TP x DP x EP layout run in one process
with the other ranks simulated. Its per-step collectives (count and bytes of each kind) and its MoE work equal
rank 0's in a real 8-process gloo run of the same layout and seeded routing, SP off and on, TP 8 and DP 2 x TP
4; with the busiest load it computes, per layer, what the busiest real rank computes. The simulated
collectives keep shapes and stay finite, and count the path the real group would take by size."""

import json

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import count_collectives, spawn
from spmoe.distributed.comm import (
    all_gather_rows,
    all_reduce,
    all_to_all_rows,
    node_path,
    reduce_scatter_rows,
)
from spmoe.distributed.simulated import (
    DP_STRIDE,
    SimulatedGroup,
    block_tokens,
    seeded_routing,
)
from spmoe.entrypoints.jobs import flatten
from spmoe.layers.moe.work import count_moe_work

from .conftest import TP8_WIDTHS

# Widths that divide over 8 TP ranks; 16 experts, 2 a rank; a dense layer, then MoE layers with IndexShare.
CONFIG = dict(
    model_type="glm_moe_dsa",
    **TP8_WIDTHS,
    num_hidden_layers=3,
    mlp_layer_types=["dense", "sparse", "sparse"],
    indexer_types=["full", "shared", "full"],
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
)
SEQS = [[5, 17, 3, 90, 41, 8, 1, 2, 3, 4, 5], [60, 2]]  # every DP group runs this batch (N = 13)


def _steps(folder: str, layouts: list[ParallelConfig]) -> list[tuple]:
    """One forward of SEQS per layout -> (collectives per kind, MoE rows dispatched, rows per local expert
    of each MoE layer)."""
    from spmoe.models.deepseek_v32.weights import load_model

    results = []
    for parallel in layouts:
        model = load_model(folder, parallel, load_format="dummy")
        ids, positions, lens = flatten(SEQS, "cpu")
        with torch.no_grad(), count_collectives() as counted, count_moe_work() as work:
            logits = model(ids, positions, lens)
        assert torch.isfinite(logits).all()
        results.append((counted.as_dict(), work.rows_dispatched, [c.tolist() for c in work.calls]))
    return results


def _layouts(tp: int, dp: int, **kw) -> list[ParallelConfig]:
    return [
        ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sp=sp, **kw)
        for sp in ("off", "on")
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("simrank")
    (path / "config.json").write_text(json.dumps(CONFIG))  # dummy weights: nothing else is read
    return str(path)


@pytest.mark.parametrize("tp, dp", [(8, 1), (4, 2)])
def test_simulated_rank_equals_rank_0_of_a_real_8_rank_run(folder, tp, dp):
    real = spawn(
        _steps,
        8,
        folder,
        _layouts(tp, dp, routing_seed=0),
        config=_layouts(tp, dp, routing_seed=0)[0],
    )
    sim_layouts = _layouts(tp, dp, simulate_rank=True)
    simulated = spawn(_steps, 1, folder, sim_layouts, config=sim_layouts[0])[0]
    assert simulated == real[0]
    counts = [step[0] for step in simulated]
    assert counts[1]["reduce_scatter"]["count"] > 0 and counts[0] != counts[1]  # SP on really ran
    assert sum(sum(map(sum, step[2])) for step in simulated) > 0  # experts computed rows
    if tp == 8:  # the busiest load: per MoE layer, the most rows any real rank computed
        busiest_layouts = _layouts(tp, dp, simulate_rank=True, simulated_load="busiest")
        busiest = spawn(_steps, 1, folder, busiest_layouts, config=busiest_layouts[0])[0]
        for mode in range(2):
            per_rank = [[sum(rows) for rows in rank[mode][2]] for rank in real]
            assert [sum(rows) for rows in busiest[mode][2]] == [max(c) for c in zip(*per_rank)]
            assert busiest[mode][0] == simulated[mode][0]


def test_simulated_collectives_keep_shapes_and_count_the_node_path():
    tp = SimulatedGroup("tp", 8)
    x = torch.arange(6.0).reshape(3, 2)
    with count_collectives() as counted:
        gathered = all_gather_rows(x, tp)
        scattered = reduce_scatter_rows(torch.ones(16, 2), tp)
        reduced = all_reduce(x.clone(), tp)
        big = all_gather_rows(torch.zeros(64 * 1024, 8, dtype=torch.bfloat16), tp)
    assert gathered.shape == (24, 2) and torch.equal(gathered[3:6], x)  # this rank's rows repeated
    assert scattered.shape == (2, 2) and torch.equal(reduced, x) and big.shape[0] == 8 * 64 * 1024
    assert counted.as_dict()["all_gather"] == {"count": 2, "bytes": 24 * 2 * 4 + 8 * 2**20}
    paths = {(r["kind"], r["path"]): r["count"] for r in counted.path_rows()}
    assert paths == {
        ("all_gather", "one_shot"): 1,
        ("all_gather", "nccl"): 1,  # 8 MiB of buffer: past the one-shot kernel's 4 MiB
        ("reduce_scatter", "one_shot"): 1,
        ("all_reduce", "one_shot"): 1,
    }
    assert node_path("all_reduce", torch.zeros(1, dtype=torch.int64), 8, "max") == "nccl"
    with pytest.raises(ValueError, match="all-gather dispatch only"):
        all_to_all_rows(x, [3] * 8, [3] * 8, tp)
    with pytest.raises(ValueError, match="filled output must be"):
        all_gather_rows(x, tp, torch.zeros(3, 2))


def test_seeded_routing_gives_k_distinct_experts_per_token_and_pads_with_minus_one():
    starts, valid = block_tokens(13, True, 4, 8, 0, "cpu")  # DP 2 x TP 4, SP: shards of 4 rows
    assert starts.tolist() == [0, 4, 8, 12, DP_STRIDE, DP_STRIDE + 4, DP_STRIDE + 8, DP_STRIDE + 12]
    assert valid.tolist() == [4, 4, 4, 1] * 2
    ids, weights = seeded_routing(0, 3, starts, valid, 4, 256, 8, 2.5)
    assert ids.shape == (32, 8) and weights.shape == (32, 8)
    real = ids[ids[:, 0] >= 0]
    assert len(real) == 26 and all(len(set(row)) == 8 for row in real.tolist())
    assert (ids[13:16] == -1).all() and (weights[13:16] == 0).all()  # TP rank 3's pad rows
    assert torch.allclose(weights[0], torch.full((8,), 2.5 / 8))
    again, _ = seeded_routing(0, 3, starts, valid, 4, 256, 8, 2.5)
    other_layer, _ = seeded_routing(0, 4, starts, valid, 4, 256, 8, 2.5)
    assert torch.equal(again, ids) and not torch.equal(other_layer, ids)
    counts = torch.bincount(
        seeded_routing(1, 3, starts[:1], torch.tensor([4096]), 4096, 256, 8, 1.0)[0].reshape(-1),
        minlength=256,
    )
    assert counts.min() > 64 and counts.max() < 192  # about uniform: 128 a expert


def test_the_simulated_rank_is_refused_where_it_cannot_be_exact():
    with pytest.raises(ValueError, match="allgather_reducescatter"):
        ParallelConfig(tensor_parallel_size=8, simulate_rank=True, ep_backend="all_to_all")
    with pytest.raises(ValueError, match="needs simulate_rank"):
        ParallelConfig(tensor_parallel_size=8, simulated_load="busiest")
