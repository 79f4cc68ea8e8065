"""The committed GLM-5.2 config.json (benchmarks/configs/glm-5.2, see SOURCE.md there) parses to the
deployment's structure: 78 layers, the first 3 dense, 21 full indexer layers (IndexShare), one MTP layer with
its own indexer, FP8 block-128, and it divides over TP 8 / EP 8."""

from pathlib import Path

from spmoe.config import ModelConfig, ParallelConfig

GLM52 = Path(__file__).parents[3] / "benchmarks" / "configs" / "glm-5.2" / "config.json"


def test_glm52_config_has_the_published_structure():
    cfg = ModelConfig.from_file(GLM52)
    layers = cfg.num_hidden_layers
    assert (layers, cfg.num_nextn_predict_layers, cfg.vocab_size) == (78, 1, 154880)
    assert [cfg.layer_is_moe(i) for i in range(4)] == [False, False, False, True]
    full = [i for i in range(layers) if cfg.layer_has_indexer(i)]
    assert full == [0, 1, 2, *range(6, 78, 4)] and len(full) == 21
    assert cfg.layer_has_indexer(layers) and cfg.layer_is_moe(layers)  # the MTP layer
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (256, 8, 1)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.intermediate_size) == (
        6144,
        2048,
        12288,
    )
    assert cfg.fp8_block_size == (128, 128)
    cfg.check_parallel(ParallelConfig(tensor_parallel_size=8))
    cfg.check_parallel(ParallelConfig(tensor_parallel_size=1, data_parallel_size=8))
