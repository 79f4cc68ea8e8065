"""benchmarks/size_rank.py end to end on the CPU: GLM-5.2's config cut to tiny widths and 4 layers, rank 0 of
TP 8 simulated; the raw JSON holds the weights and their full-depth projection, the KV capacity, the warm-up,
each decode case (with MTP) against its floor with its collectives and expert hits, and the prefill."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
TINY = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 16,
    "moe_intermediate_size": 32,
    "intermediate_size": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 256,
    "quantization_config": None,
    "eos_token_id": [1],
}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    # as when run from benchmarks/ (its rank process imports it too)
    sys.path.insert(0, str(BENCHMARKS))
    import size_rank

    out = tmp_path_factory.mktemp("size") / "rank.json"
    argv = [
        "--tp",
        "8",
        "--layers",
        "4",
        "--batches",
        "1",
        "3",
        "--contexts",
        "40",
        "--mtp",
        "0",
        "2",
    ]
    argv += ["--prefill", "48", "--chunk", "32", "--max-model-len", "128", "--device", "cpu"]
    argv += ["--dtype", "float32", "--reps", "2", "--timing-kv-gib", "0.01", "--warmup"]
    argv += ["--graph-sizes", "3", "--warmup-kv-gib", "0.01", "--hf-overrides", json.dumps(TINY)]
    try:
        size_rank.main([*argv, "--out", str(out)])
    finally:
        sys.path.remove(str(BENCHMARKS))
    return json.loads(out.read_text())


def test_size_rank_writes_every_figure_of_one_rank(raw):
    (record,) = raw["records"]
    assert (raw["tp"], raw["dp"], raw["sp"], raw["load"]) == (8, 1, "off", "busiest")
    weights, kv = record["weights"], record["kv"]
    # 3 dense + 1 MoE layer measured; 78 layers projected: 3 dense + 75 MoE
    assert weights["full_depth_bytes"] == (
        weights["other_bytes"] + 3 * weights["dense_layer_bytes"] + 75 * weights["moe_layer_bytes"]
    )
    assert weights["moe_layer_bytes"] > weights["dense_layer_bytes"] > 0
    room = (kv["memory_gib"] - kv["reserve_gib"]) * 2**30 - weights["full_depth_bytes"]
    assert kv["rank_tokens_full_depth"] == int(room // kv["bytes_per_token_full_depth"])
    assert kv["bytes_per_token_full_depth"] > kv["bytes_per_token"] > 0  # 79 layers' rows vs 5
    assert record["warmup"]["total_s"] > 0
    cases = {(c["batch"], c["mtp_k"]): c for c in record["decode"]}
    assert set(cases) == {(1, 0), (1, 2), (3, 0), (3, 2)}
    for (batch, k), case in cases.items():
        assert case["target_ms"] > 0 and case["floor_ms"] > 0
        assert (case["drafter_ms"] > 0) == (k > 0)
        assert case["step_ms"] == case["target_ms"] + case["drafter_ms"]
        paths = {(c["kind"], c["path"]) for c in case["collectives"]}
        assert ("all_reduce", "one_shot") in paths and ("all_gather", "one_shot") in paths
        (hits,) = case["experts"]  # one MoE layer
        assert 1 <= hits["experts_hit"] <= 2 and hits["rows"] >= batch * (k + 1) * 4 // 8
    assert record["prefill"][0]["tokens"] == 48 and record["prefill"][0]["ms"] > 0
