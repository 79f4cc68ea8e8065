"""The model configuration, read from a Hugging Face `config.json` (`glm_moe_dsa` or
`deepseek_v32`).

Every field that changes the math is either honoured or rejected with an error naming it;
bookkeeping fields (initializer_range, transformers_version, ...) are ignored.
"""

import json
import math
import re
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
    # "full" (runs the indexer) or "shared" (reuses the previous top-k)
    indexer_types: tuple[str, ...]
    rope_theta: float
    rope_type: str  # "default" or "yarn"
    # yarn: (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    # mscale_all_dim, truncate); empty for default
    rope_scaling: tuple
    num_nextn_predict_layers: int
    fp8_block_size: tuple[int, int] | None  # FP8 e4m3 checkpoint with one scale per block, or None
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these
    # the longest sequence the model takes; None: not stated
    max_position_embeddings: int | None = None
    # FP8 checkpoints: the suffix of a weight's block scales (DeepSeek / GLM `weight_scale_inv`,
    # compressed-tensors `weight_scale`; both multiply the stored values), and the modules the
    # quantization config leaves unquantised (regexes matched from the start of the module name:
    # `modules_to_not_convert` / `ignore`)
    fp8_scale_suffix: str = "weight_scale_inv"
    fp8_unquantized: tuple[str, ...] = ()
    fp8_every_linear: bool = False  # compressed-tensors: every linear not in `ignore` is FP8

    def fp8_expected(self, module: str) -> bool | None:
        """Whether the quantization config says linear `module` is stored in FP8: False where it is
        left unquantised, True where every other linear is FP8 (compressed-tensors), None where the
        stored dtype decides (DeepSeek / GLM `fp8`, whose checkpoints keep a few linears, e.g. the
        indexer's head weights, in bf16 without naming them)."""
        if self.fp8_block_size is None or any(re.match(p, module) for p in self.fp8_unquantized):
            return False
        return True if self.fp8_every_linear else None

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
        """Layers from `num_hidden_layers` on are MTP blocks, which are MoE with their
        own indexer."""
        return layer_idx >= self.num_hidden_layers or self.mlp_layer_types[layer_idx] == "sparse"

    def layer_has_indexer(self, layer_idx: int) -> bool:
        return layer_idx >= self.num_hidden_layers or self.indexer_types[layer_idx] == "full"

    def check_parallel(self, parallel) -> None:
        """Raise unless every TP/EP-split dimension divides by the sizes of `parallel` (a
        ParallelConfig)."""
        t, ep = parallel.tensor_parallel_size, parallel.world_size
        splits = [
            ("num_attention_heads", self.num_attention_heads, t, "tensor_parallel_size"),
            ("vocab_size", self.vocab_size, t, "tensor_parallel_size"),
            ("n_routed_experts", self.n_routed_experts, ep, "the expert-parallel size"),
        ]
        # TP-sharded dense MLPs
        if not parallel.use_sequence_parallel_moe or parallel.sp_scope == "moe":
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
                split = [v for _, v, _, w in splits if w == what]  # every dimension split by it
                fits = [str(n) for n in range(1, min(split) + 1) if all(v % n == 0 for v in split)]
                sizes = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]
                raise ValueError(
                    f"{name} = {value} is not divisible by {what} = {size}; {what} can be {sizes}"
                )

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict | None = None) -> "ModelConfig":
        """`path`: a checkpoint folder (its config.json is read) or a config.json itself;
        `overrides` (vLLM's `--hf-overrides`) are merged into it first, nested
        objects key by key."""
        return cls.from_dict(read_config(path, overrides))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(
                f"a model config must be a JSON object, got a {type(raw).__name__}: {str(raw)[:40]}"
            )
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
            raise ValueError(
                "q_lora_rank must be set (the DSA indexer reads the q latent); got None"
            )
        layers = raw["num_hidden_layers"]
        mlp_types = raw.get("mlp_layer_types") or _mlp_types_from_schedule(raw, layers)
        indexer_types = raw.get("indexer_types") or ["full"] * layers
        for name, values, allowed in (
            ("mlp_layer_types", mlp_types, ("dense", "sparse")),
            ("indexer_types", indexer_types, ("full", "shared")),
        ):
            if len(values) != layers or any(v not in allowed for v in values):
                raise ValueError(
                    f"{name} must list one of {allowed} for each of the {layers} "
                    f"layers, got {values}"
                )
        if indexer_types[0] != "full":
            raise ValueError(
                "indexer_types[0] must be 'full': a 'shared' layer reuses the top-k "
                "of an earlier one"
            )
        rope_type, rope_theta, rope_scaling = _rope(raw)
        n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
        experts = raw["n_routed_experts"]
        if experts % n_group or topk_group > n_group:
            raise ValueError(
                f"router groups do not fit: n_routed_experts={experts}, n_group={n_group}, "
                f"topk_group={topk_group}"
            )
        if raw["num_experts_per_tok"] > experts // n_group * topk_group:
            raise ValueError(
                f"num_experts_per_tok={raw['num_experts_per_tok']} is more than the "
                f"{experts // n_group * topk_group} experts a token's {topk_group} of {n_group} "
                f"router groups hold (n_routed_experts={experts})"
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
            **_quantization(raw.get("quantization_config")),
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
    """Raise unless every numeric field is a number of the right kind and range (JSON
    "8" is not 8)."""
    for name, least in {**REQUIRED_INTS, **OPTIONAL_INTS}.items():
        value = raw[name] if name in REQUIRED_INTS else raw.get(name)
        if value is None and name in OPTIONAL_INTS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(
                f"config field {name} must be an integer >= {least}, got {value!r} "
                f"({type(value).__name__})"
            )
    for name in REQUIRED_FLOATS + OPTIONAL_FLOATS:
        value = raw[name] if name in REQUIRED_FLOATS else raw.get(name)
        if value is None and name in OPTIONAL_FLOATS:
            continue
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise ValueError(
                f"config field {name} must be a finite number, got {value!r} "
                f"({type(value).__name__})"
            )
    if not isinstance(raw["norm_topk_prob"], bool):
        raise ValueError(
            f"config field norm_topk_prob must be true or false, got {raw['norm_topk_prob']!r}"
        )


def _require(raw: dict, key: str, supported) -> None:
    if key in raw and raw[key] != supported:
        raise ValueError(f"{key}={raw[key]!r} is not supported; expected {supported!r}")


def _eos(value, vocab_size: int) -> tuple[int, ...]:
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"eos_token_id {outside[0]} is not a token id: expected an int in [0, {vocab_size})"
        )
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
        raise ValueError(
            "yarn attention_factor is not supported; expected it derived from mscale "
            "/ mscale_all_dim"
        )
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


def _quantization(q: dict | None) -> dict:
    """quantization_config -> the ModelConfig fields of its FP8 scheme: DeepSeek / GLM `fp8`
    (`weight_block_size`, `weight_scale_inv`, optional `modules_to_not_convert`, matched as
    substrings of module names) or compressed-tensors FP8 block (llm-compressor's FP8_BLOCK:
    `weight_scale`, `ignore` of exact names or `re:` regexes)."""
    if q is None:
        return {"fp8_block_size": None}
    if q.get("quant_method") == "compressed-tensors":
        return _compressed_tensors(q)
    if (
        q.get("quant_method") != "fp8"
        or q.get("fmt", "e4m3") != "e4m3"
        or not q.get("weight_block_size")
    ):
        raise ValueError(
            f"quantization_config {q} is not supported; expected fp8 e4m3 with weight_block_size, "
            "or compressed-tensors FP8 block"
        )
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"activation_scheme {q['activation_scheme']!r} is not supported; expected 'dynamic'"
        )
    block = tuple(q["weight_block_size"])
    if len(block) != 2:
        raise ValueError(f"weight_block_size must have two entries, got {block}")
    skipped = tuple(".*" + re.escape(name) for name in q.get("modules_to_not_convert") or ())
    return {"fp8_block_size": block, "fp8_unquantized": skipped}


def merge_overrides(raw: dict, overrides: dict) -> dict:
    """A copy of `raw` with `overrides` merged in: nested objects merge key by key, anything
    else replaces."""
    merged = dict(raw)
    for key, value in overrides.items():
        both_objects = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merge_overrides(merged[key], value) if both_objects else value
    return merged


def read_config(path: str | Path, overrides: dict | None = None) -> dict:
    """The JSON object of a checkpoint folder's config.json (or of a config.json given itself), with
    `overrides` merged in (`merge_overrides`)."""
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
    if not isinstance(raw, dict):
        raise ValueError(
            f"a model config must be a JSON object, got a {type(raw).__name__}: {str(raw)[:40]}"
        )
    return merge_overrides(raw, overrides or {})


def _compressed_tensors(q: dict) -> dict:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors: expected one config group (FP8 block), got {len(groups)}"
        )
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    block = tuple(weights.get("block_structure") or ())
    fp8_weights = (
        weights.get("type") == "float"
        and weights.get("num_bits") == 8
        and weights.get("strategy") == "block"
    )
    if not fp8_weights or len(block) != 2 or weights.get("dynamic"):
        raise ValueError(
            f"compressed-tensors weights {weights} are not supported; expected static FP8 (type "
            "float, 8 bits) with strategy block and a two-entry block_structure"
        )
    if acts and (
        acts.get("type") != "float" or acts.get("num_bits") != 8 or not acts.get("dynamic")
    ):
        raise ValueError(
            f"compressed-tensors input_activations {acts} are not supported; expected dynamic FP8"
        )
    if q.get("format", "float-quantized") != "float-quantized":
        raise ValueError(
            f"compressed-tensors format {q['format']!r} is not supported; expected "
            "'float-quantized'"
        )
    ignored = tuple(
        p[3:] if p.startswith("re:") else re.escape(p) + "$" for p in q.get("ignore") or ()
    )
    return {
        "fp8_block_size": block,
        "fp8_scale_suffix": "weight_scale",
        "fp8_unquantized": ignored,
        "fp8_every_linear": True,
    }
