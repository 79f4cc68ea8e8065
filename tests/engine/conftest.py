"""The config of a tiny deterministic checkpoint with an MTP layer (dims divide by TP 1, 2 and 3; 12
experts divide by EP 1 to 4; the root conftest's `engine_checkpoint` writes it), and what several
engine tests share: the log-softmax reference, n choices against each alone."""

import math

import torch

from spmoe.engine.ranks import generate

ENGINE_CONFIG = dict(
    model_type="glm_moe_dsa",
    vocab_size=96,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    mlp_layer_types=["dense", "sparse", "sparse"],
    indexer_types=["full", "shared", "full"],
    num_attention_heads=6,
    num_key_value_heads=6,
    n_routed_experts=12,
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
    num_nextn_predict_layers=1,
)


def log_softmax(row: list[float]) -> list[float]:
    """The reference log-probabilities of one row of logits, in float64 (-inf entries stay -inf)."""
    top = max(row)
    total = math.log(sum(math.exp(v - top) for v in row if v != float("-inf")))
    return [v - top - total for v in row]


def choices_and_alone(engine, prompt: list[int], seeds: list[int], max_new: int) -> tuple:
    """One request of len(seeds) sampled choices of `prompt` (the first computes the prompt, the others fork from
    it), then each choice's sampling alone. -> (the choices' tokens, each alone's, their logits `[n, max_new, V]`
    float32 on the CPU, each alone's likewise, the prompt tokens the choices looked up in the prefix cache, the
    cache blocks in use after the last lone run)."""
    from spmoe.engine.request import SamplingParams

    samplings = [SamplingParams(1.0, seed=seed) for seed in seeds]
    queries = engine.scheduler.room.prefix_cache_counts()[0]
    choices = generate(engine, [prompt] * len(seeds), max_new, samplings, record_logits=True)
    queries = engine.scheduler.room.prefix_cache_counts()[0] - queries
    alone = [
        generate(engine, [prompt], max_new, [params], record_logits=True) for params in samplings
    ]
    return (
        choices.outputs,
        [gen.outputs[0] for gen in alone],
        torch.stack(choices.logits).float().cpu(),
        torch.stack([gen.logits[0] for gen in alone]).float().cpu(),
        queries,
        alone[-1].stats["kv_cache"]["blocks_in_use"],
    )


def cache_state(cache) -> dict:
    """A copy of every tensor of every layer of a paged cache: (layer, field) -> rows."""
    return {
        (layer, name): t.clone()
        for layer, rows in cache.layers.items()
        for name, t in vars(rows).items()
        if t is not None
    }


def cache_slot(table: list[int], position: int) -> int:
    """The paged cache row that `position` of a sequence with blocks `table` writes."""
    from spmoe.engine.cache.paged import BLOCK_SIZE

    return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
