"""The model configuration, read from a Hugging Face `config.json` (`glm_moe_dsa` or `deepseek_v32`).

Every field that changes the math is either honoured or rejected with an error naming it; bookkeeping fields
(initializer_range, transformers_version, ...) are ignored.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rms_norm_eps: float
    mlp_layer_types: tuple[str, ...]  # "dense" or "sparse" per layer
    indexer_types: tuple[str, ...]  # "full" (runs the indexer) or "shared" (reuses the previous top-k)
    rope_theta: float
    rope_type: str  # "default" or "yarn"
    rope_scaling: tuple  # yarn: (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    #                             mscale_all_dim, truncate); empty for default
    num_nextn_predict_layers: int
    fp8_block_size: tuple[int, int] | None  # FP8 e4m3 checkpoint with one scale per block, or None
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these
    max_position_embeddings: int | None = None  # the longest sequence the model takes; None: not stated

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def indexer_rope_interleaved(self) -> bool:
        """GLM-5 applies interleaved RoPE in the indexer; DeepSeek-V3.2 the half-split form."""
        return self.model_type == "glm_moe_dsa"

    @property
    def attention_scale(self) -> float:
        """Softmax scale: 1/sqrt(qk_head_dim), times yarn's mscale(mscale_all_dim)^2 under yarn."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "yarn":
            factor, mscale_all_dim = self.rope_scaling[0], self.rope_scaling[5]
            if mscale_all_dim and factor > 1:
                m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scale *= m * m
        return scale

    def layer_is_moe(self, layer_idx: int) -> bool:
        """Layers from `num_hidden_layers` on are MTP blocks, which are MoE with their own indexer."""
        return layer_idx >= self.num_hidden_layers or self.mlp_layer_types[layer_idx] == "sparse"

    def layer_has_indexer(self, layer_idx: int) -> bool:
        return layer_idx >= self.num_hidden_layers or self.indexer_types[layer_idx] == "full"

    def check_parallel(self, parallel) -> None:
        """Raise unless every TP/EP-split dimension divides by the sizes of `parallel` (a ParallelConfig)."""
        t, ep = parallel.tensor_parallel_size, parallel.world_size
        splits = [
            ("num_attention_heads", self.num_attention_heads, t, "tensor_parallel_size"),
            ("vocab_size", self.vocab_size, t, "tensor_parallel_size"),
            ("n_routed_experts", self.n_routed_experts, ep, "the expert-parallel size"),
        ]
        if not parallel.use_sequence_parallel_moe or parallel.sp_scope == "moe":  # TP-sharded dense MLPs
            splits.append(("intermediate_size", self.intermediate_size, t, "tensor_parallel_size"))
        if not parallel.use_sequence_parallel_moe:  # TP-sharded shared experts
            splits.append(
                (
                    "moe_intermediate_size * n_shared_experts",
                    self.moe_intermediate_size * self.n_shared_experts,
                    t,
                    "tensor_parallel_size",
                )
            )
        for name, value, size, what in splits:
            if value % size:
                raise ValueError(f"{name} = {value} is not divisible by {what} = {size}")

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """`path`: a checkpoint folder (its config.json is read) or a config.json itself."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        elif path.is_file() and path.suffix != ".json":
            raise ValueError(f"expected a checkpoint folder with config.json, got the file {path}")
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: expected {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"a model config must be a JSON object, got a {type(raw).__name__}: {str(raw)[:40]}")
        try:
            return cls._from_dict(raw)
        except KeyError as e:
            raise ValueError(f"model config is missing the required field {e}") from None

    @classmethod
    def _from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        _check_types(raw)
        _require(raw, "hidden_act", "silu")
        _require(raw, "scoring_func", "sigmoid")
        _require(raw, "topk_method", "noaux_tc")
        _require(raw, "attention_bias", False)
        _require(raw, "mlp_bias", False)
        _require(raw, "tie_word_embeddings", False)
        if raw.get("num_key_value_heads", raw["num_attention_heads"]) != raw["num_attention_heads"]:
            raise ValueError(
                f"MLA needs num_key_value_heads == num_attention_heads, got "
                f"{raw['num_key_value_heads']} and {raw['num_attention_heads']}"
            )
        if raw.get("q_lora_rank") is None:
            raise ValueError("q_lora_rank must be set (the DSA indexer reads the q latent); got None")
        layers = raw["num_hidden_layers"]
        mlp_types = raw.get("mlp_layer_types") or _mlp_types_from_schedule(raw, layers)
        indexer_types = raw.get("indexer_types") or ["full"] * layers
        for name, values, allowed in (
            ("mlp_layer_types", mlp_types, ("dense", "sparse")),
            ("indexer_types", indexer_types, ("full", "shared")),
        ):
            if len(values) != layers or any(v not in allowed for v in values):
                raise ValueError(f"{name} must list one of {allowed} for each of the {layers} layers, got {values}")
        if indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a 'shared' layer reuses the top-k of an earlier one")
        rope_type, rope_theta, rope_scaling = _rope(raw)
        n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
        experts = raw["n_routed_experts"]
        if experts % n_group or topk_group > n_group:
            raise ValueError(
                f"router groups do not fit: n_routed_experts={experts}, n_group={n_group}, topk_group={topk_group}"
            )
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=raw["num_attention_heads"],
            n_routed_experts=experts,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw["num_experts_per_tok"],
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(raw["routed_scaling_factor"]),
            norm_topk_prob=bool(raw["norm_topk_prob"]),
            q_lora_rank=raw["q_lora_rank"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            index_topk=raw["index_topk"],
            index_n_heads=raw["index_n_heads"],
            index_head_dim=raw["index_head_dim"],
            rms_norm_eps=float(raw["rms_norm_eps"]),
            mlp_layer_types=tuple(mlp_types),
            indexer_types=tuple(indexer_types),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
            fp8_block_size=_quantization(raw.get("quantization_config")),
            eos_token_ids=_eos(raw.get("eos_token_id"), raw["vocab_size"]),
            max_position_embeddings=raw.get("max_position_embeddings"),
        )


# Numeric fields and the smallest value each may take; optional ones may be missing or null.
REQUIRED_INTS = {
    name: 1
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "n_routed_experts",
        "num_experts_per_tok",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
    )
}
OPTIONAL_INTS = {
    "q_lora_rank": 1,
    "num_key_value_heads": 1,
    "n_shared_experts": 0,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "max_position_embeddings": 1,
}
REQUIRED_FLOATS = ("routed_scaling_factor", "rms_norm_eps")
OPTIONAL_FLOATS = ("rope_theta",)


def _check_types(raw: dict) -> None:
    """Raise unless every numeric field is a number of the right kind and range (JSON "8" is not 8)."""
    for name, least in {**REQUIRED_INTS, **OPTIONAL_INTS}.items():
        value = raw[name] if name in REQUIRED_INTS else raw.get(name)
        if value is None and name in OPTIONAL_INTS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(
                f"config field {name} must be an integer >= {least}, got {value!r} ({type(value).__name__})"
            )
    for name in REQUIRED_FLOATS + OPTIONAL_FLOATS:
        value = raw[name] if name in REQUIRED_FLOATS else raw.get(name)
        if value is None and name in OPTIONAL_FLOATS:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"config field {name} must be a finite number, got {value!r} ({type(value).__name__})")
    if not isinstance(raw["norm_topk_prob"], bool):
        raise ValueError(f"config field norm_topk_prob must be true or false, got {raw['norm_topk_prob']!r}")


def _require(raw: dict, key: str, supported) -> None:
    if key in raw and raw[key] != supported:
        raise ValueError(f"{key}={raw[key]!r} is not supported; expected {supported!r}")


def _eos(value, vocab_size: int) -> tuple[int, ...]:
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"eos_token_id {outside[0]} is not a token id: expected an int in [0, {vocab_size})")
    return tuple(ids)


def _mlp_types_from_schedule(raw: dict, layers: int) -> list[str]:
    first_dense = raw.get("first_k_dense_replace") or 0
    freq = raw.get("moe_layer_freq") or 1
    return ["sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(layers)]


def _rope(raw: dict) -> tuple[str, float, tuple]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return "default", float(theta), ()
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported; expected 'default' or 'yarn'")
    if params.get("attention_factor") is not None:
        raise ValueError("yarn attention_factor is not supported; expected it derived from mscale / mscale_all_dim")
    return (
        "yarn",
        float(theta),
        (
            float(params["factor"]),
            int(params["original_max_position_embeddings"]),
            float(params.get("beta_fast") or 32),
            float(params.get("beta_slow") or 1),
            float(params.get("mscale") or 0),
            float(params.get("mscale_all_dim") or 0),
            bool(params.get("truncate", True)),
        ),
    )


def _quantization(q: dict | None) -> tuple[int, int] | None:
    if q is None:
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not q.get("weight_block_size"):
        raise ValueError(f"quantization_config {q} is not supported; expected fp8 e4m3 with weight_block_size")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"activation_scheme {q['activation_scheme']!r} is not supported; expected 'dynamic'")
    block = tuple(q["weight_block_size"])
    if len(block) != 2:
        raise ValueError(f"weight_block_size must have two entries, got {block}")
    return block
