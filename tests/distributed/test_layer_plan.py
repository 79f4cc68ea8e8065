"""The layer plan: every layer's layouts for each SP mode and scope, written out from the layout contract
(docs/layout-contract.md), and the GLM-5.2 tables in docs/architecture.md. Pure rules: no process group needed."""

from pathlib import Path

import pytest

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed.layer_plan import build_layer_plan
from spmoe.distributed.layout import Layout

P, F, S = Layout.PARTIAL, Layout.FULL, Layout.SHARDED
DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def config(mlp_layer_types: list[str], mtp: int = 1) -> ModelConfig:
    layers = len(mlp_layer_types)
    return ModelConfig.from_dict(
        dict(
            model_type="glm_moe_dsa",
            vocab_size=96,
            hidden_size=48,
            intermediate_size=72,
            moe_intermediate_size=12,
            num_hidden_layers=layers,
            mlp_layer_types=mlp_layer_types,
            indexer_types=["full"] * layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            index_topk=4,
            index_n_heads=4,
            index_head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            num_nextn_predict_layers=mtp,
        )
    )


# Pattern dense, MoE, dense, MoE, then one MTP layer (MoE). Per layer: (input, MLP input, output, MoE output).
CASES = {
    ("off", "moe", 1): (
        [(P, F, P, None), (P, F, P, P), (P, F, P, None), (P, F, P, P)],
        P,
        (F, F, P, P),
    ),
    # DP > 1 without SP: the dispatch returns complete rows to every TP rank
    ("off", "moe", 2): (
        [(P, F, P, None), (P, F, P, F), (P, F, P, None), (P, F, P, F)],
        P,
        (F, F, P, F),
    ),
    # only MoE layers SP: the dense layer after an MoE layer takes SHARDED rows and gathers them
    ("on", "moe", 1): (
        [(P, F, P, None), (P, S, S, S), (S, F, P, None), (P, S, S, S)],
        S,
        (S, S, S, S),
    ),
    ("on", "all", 1): (
        [(S, S, S, None), (S, S, S, S), (S, S, S, None), (S, S, S, S)],
        S,
        (S, S, S, S),
    ),
    ("on", "moe", 2): (
        [(P, F, P, None), (P, S, S, S), (S, F, P, None), (P, S, S, S)],
        S,
        (S, S, S, S),
    ),
}


@pytest.mark.parametrize("sp, scope, dp", sorted(CASES))
def test_plan_follows_the_layout_contract(sp, scope, dp):
    layers, exit_layout, mtp = CASES[(sp, scope, dp)]
    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=dp, sp=sp, sp_scope=scope)
    plan = build_layer_plan(config(["dense", "sparse", "dense", "sparse"]), parallel)
    assert [(p.input, p.mlp_input, p.output, p.moe_output) for p in plan.layers] == layers
    assert [p.layer_idx for p in plan.layers] == [0, 1, 2, 3]
    assert [p.use_sequence_parallel_moe for p in plan.layers] == [lay[1] is S for lay in layers]
    assert plan.exit is exit_layout
    assert [(p.layer_idx, p.input, p.mlp_input, p.output, p.moe_output) for p in plan.mtp] == [
        (4, *mtp)
    ]


def test_moe_first_layer_is_sharded_from_the_embedding():
    parallel = ParallelConfig(tensor_parallel_size=2, sp="on")
    plan = build_layer_plan(config(["sparse", "dense"], mtp=0), parallel)
    assert [(p.input, p.mlp_input, p.output) for p in plan.layers] == [(S, S, S), (S, F, P)]
    assert plan.exit is P and plan.mtp == ()


@pytest.mark.parametrize("scope", ["moe", "all"])
def test_docs_show_the_glm_plan(scope):
    """docs/architecture.md prints the GLM-5.2 plan (78 layers, the first 3 dense, 1 MTP layer) as built."""
    parallel = ParallelConfig(tensor_parallel_size=8, sp="on", sp_scope=scope)
    table = build_layer_plan(config(["dense"] * 3 + ["sparse"] * 75), parallel).table()
    assert table in DOCS.read_text(), (
        f"docs/architecture.md lacks the scope {scope!r} table:\n{table}"
    )
