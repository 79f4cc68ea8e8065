"""Both EP dispatch backends against a single-rank reference, on 2, 3 and 4 gloo ranks, for N in
{0, 1, 2, 3, 17} tokens per rank (with SP pad rows, id -1), float32 and bfloat16; and the bytes they move."""

import pytest
import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.layers.moe.dispatch import DISPATCH
from spmoe.layers.moe.experts.torch_ref import TorchExperts

from ..models.deepseek_v32.conftest import COMMON

ROWS = [0, 1, 2, 3, 17]
TOP_K = 3


def config() -> ModelConfig:
    return ModelConfig.from_dict(
        {
            **COMMON,
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-5,
        }
    )


def case(rows: int, world: int, rank: int, dtype):
    """The same random rows, routing and expert weights on every rank; rank r's block is rows `[r*rows, ...)`."""
    cfg = config()
    gen = torch.Generator().manual_seed(rows)
    total, experts, size = rows * world, cfg.n_routed_experts, cfg.hidden_size
    x = torch.randn(total, size, generator=gen).to(dtype)
    ids = (
        torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(total)])
        if total
        else torch.zeros(0, TOP_K, dtype=torch.long)
    )
    pad = torch.rand(total, generator=gen) < 0.2  # SP pad rows: no experts, zero weight
    ids = ids.masked_fill(pad[:, None], -1)
    weights = torch.rand(total, TOP_K, generator=gen).masked_fill(pad[:, None], 0.0)
    w13 = torch.randn(experts, 2 * cfg.moe_intermediate_size, size, generator=gen) * size**-0.5
    w2 = (
        torch.randn(experts, size, cfg.moe_intermediate_size, generator=gen)
        * cfg.moe_intermediate_size**-0.5
    )
    return cfg, x, ids, weights, w13.to(dtype), w2.to(dtype), slice(rank * rows, (rank + 1) * rows)


def run_dispatch(dtypes):
    state = get_parallel_state()
    results = []
    for dtype in dtypes:
        for rows in ROWS:
            cfg, x, ids, weights, w13, w2, mine = case(rows, state.tp_size, state.rank, dtype)
            per_rank = cfg.n_routed_experts // state.ep_size
            experts = TorchExperts(cfg, state.ep_rank * per_rank, per_rank).to(dtype)
            with torch.no_grad():
                experts.gate_up_proj.copy_(w13[experts.first : experts.first + per_rank])
                experts.down_proj.copy_(w2[experts.first : experts.first + per_rank])
                for name, dispatch in DISPATCH.items():
                    with count_collectives() as counted:
                        out = dispatch(
                            x[mine], ids[mine], weights[mine], experts, state.ep_group, rows
                        )
                    results.append((dtype, rows, name, out, counted.as_dict()))
    return results


def reference(x, ids, weights, w13, w2):
    cfg = config()
    experts = TorchExperts(cfg, 0, cfg.n_routed_experts)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13.float())
        experts.down_proj.copy_(w2.float())
        return experts(x.float(), ids, weights)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_backends_match_reference(world):
    dtypes = [torch.float32, torch.bfloat16]
    per_rank = spawn(
        run_dispatch, world, dtypes, config=ParallelConfig(tensor_parallel_size=world, sp="on")
    )
    for i, (dtype, rows, name, _, counted) in enumerate(per_rank[0]):
        cfg, x, ids, weights, w13, w2, _ = case(rows, world, 0, dtype)
        want = reference(x, ids, weights, w13, w2)
        got = torch.cat([per_rank[r][i][3] for r in range(world)]).float()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert got.shape == want.shape
        if rows:
            err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-3)).item()
            assert err < tol, (world, dtype, rows, name, err)
        if name == "all_to_all":
            assert counted["all_to_all"]["count"] == 3 and counted["all_gather"]["count"] == 0
            # rank 0 sends: the counts; each of its rows once per distinct owner rank (pad rows nowhere) with
            # its routing; the partial outputs of the rows it received
            per = cfg.n_routed_experts // world
            owners = [{int(e) // per for e in row if e >= 0} for row in ids]
            sent = sum(len(o) for o in owners[:rows])
            received = sum(0 in o for o in owners)
            row_bytes = cfg.hidden_size * x.element_size()
            assert (
                counted["all_to_all"]["bytes"]
                == world * 8 + sent * (row_bytes + 2 * TOP_K * 4) + received * row_bytes
            )
        else:
            assert counted["all_gather"]["count"] == 1 and counted["reduce_scatter"]["count"] == 1
