"""Load a Hugging Face safetensors checkpoint into one rank's model.

Each rank reads only its slice of every TP-sharded tensor and only its own experts. FP8 e4m3 weights with a
`weight_scale_inv` per block are dequantised on load. Missing tensors, unexpected tensors and wrong shapes
are errors that name the tensor.

MTP layers follow the DeepSeek-V3 / GLM convention: checkpoint layer `num_hidden_layers + i` holds `enorm`,
`hnorm`, `eh_proj`, `shared_head.norm`, the block's attention and MoE, and optionally its own
`shared_head.head` and `embed_tokens` (otherwise the main model's are used). They are loaded with
`with_mtp=True` and skipped otherwise.
"""

import json
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state
from spmoe.layers.linear import MergedLinear
from spmoe.layers.moe.experts.base import Experts
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
MTP_MODULE = re.compile(r"^mtp\.(\d+)\.(mtp_block\.)?")  # our module names -> model.layers.{L}.


def load_model(
    model_dir: str | Path,
    parallel: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_mtp: bool = False,
) -> DeepseekV32ForCausalLM:
    """Build the model for this rank (with its MTP layers in `model.mtp` if asked) and fill it from the
    checkpoint in `model_dir`."""
    cfg = ModelConfig.from_file(model_dir)
    ckpt = Checkpoint(Path(model_dir))
    model = build_model(cfg, parallel, with_mtp, ckpt.keys(), dtype, device)
    load_weights(model, ckpt)
    return model.eval()


def build_model(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    with_mtp: bool,
    checkpoint_keys: set[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DeepseekV32ForCausalLM:
    """The model with uninitialised weights; an MTP layer gets its own embedding / head only where the
    checkpoint has them."""
    if with_mtp and not cfg.num_nextn_predict_layers:
        raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers is 0 or missing)")
    own = tuple(
        (
            f"model.layers.{cfg.num_hidden_layers + i}.embed_tokens.weight" in checkpoint_keys,
            f"model.layers.{cfg.num_hidden_layers + i}.shared_head.head.weight" in checkpoint_keys,
        )
        for i in range(cfg.num_nextn_predict_layers if with_mtp else 0)
    )
    return DeepseekV32ForCausalLM(cfg, parallel, dtype, device, own)


def write_random_checkpoint(raw_config: dict, folder: Path, seed: int) -> None:
    """Write `config.json` and a `model.safetensors` of deterministic random weights (main and MTP layers) in
    the Hugging Face layout, for the demo and tests. Runs on one rank (TP = 1)."""
    cfg = ModelConfig.from_dict(raw_config)
    model = build_model(
        cfg,
        ParallelConfig(tensor_parallel_size=1, moe_backend="torch"),  # never run: no choice
        cfg.num_nextn_predict_layers > 0,
        set(),
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, (dest, _, _) in sorted(_plan(model).items()):
        noise = torch.randn(dest.shape, generator=gen)
        if key.endswith("norm.weight"):
            tensors[key] = 1.0 + 0.2 * noise
        elif dest.dim() == 1:  # biases: the router's score correction, the indexer's k_norm
            tensors[key] = 0.1 * noise
        elif key.endswith("eh_proj.weight"):
            hidden_part = 0.3 * noise[:, cfg.hidden_size :] * cfg.hidden_size**-0.5
            tensors[key] = torch.cat([torch.eye(cfg.hidden_size), hidden_part], 1)
        else:
            tensors[key] = noise * (1.0 if "embed_tokens" in key else dest.shape[1] ** -0.5)
    # Structure for MTP to find: the LM head is a permutation of the embedding, so each token has a likely
    # successor (which the layers perturb), and eh_proj passes the next token's embedding through.
    perm = torch.randperm(cfg.vocab_size, generator=gen)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][perm] * cfg.hidden_size**-0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2))


class Checkpoint:
    """The tensors of a checkpoint folder: one `model.safetensors`, or shards listed in the index file."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {folder}")
            weight_map = {}
            for f in files:
                with _open(f) as handle:
                    weight_map.update({key: f.name for key in handle.keys()})
        self.folder, self.weight_map, self._handles = folder, weight_map, {}

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _slice(self, key: str):
        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = _open(self.folder / name)
        return self._handles[name].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The tensor's safetensors dtype name: "F32", "BF16", "F8_E4M3", "I32", ..."""
        return self._slice(key).get_dtype()

    def read(
        self, key: str, dim: int | None, start: int, stop: int, block: tuple[int, int] | None, raw: bool = False
    ) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) `[start, stop)` of a tensor, or all of it (dim None); FP8 weights
        are dequantised with their block scales unless `raw`."""
        view = self._slice(key)
        index = (slice(None),) if dim is None else (slice(None),) * dim + (slice(start, stop),)
        tensor = view[index]
        if raw or tensor.dtype != torch.float8_e4m3fn:
            return tensor
        scale_key = key.removesuffix("weight") + "weight_scale_inv"
        if block is None or scale_key not in self.weight_map:
            raise ValueError(f"{key} is FP8 but the checkpoint has no {scale_key} / quantization_config block size")
        row0, col0 = (start, 0) if dim == 0 else (0, start) if dim == 1 else (0, 0)
        scale = self._slice(scale_key)[(slice(row0 // block[0], None), slice(col0 // block[1], None))]
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        r, c = row0 % block[0], col0 % block[1]
        return tensor.float() * scale[r : r + tensor.shape[0], c : c + tensor.shape[1]]


def _open(path: Path):
    try:
        return safe_open(path, "pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def load_weights(model: DeepseekV32ForCausalLM, ckpt: Checkpoint) -> None:
    cfg, state, folder = model.cfg, get_parallel_state(), ckpt.folder
    plan = _plan(model)  # checkpoint key -> (destination tensor, tp_dim, raw)
    present = ckpt.keys()
    missing = sorted(set(plan) - present)
    if missing:
        raise ValueError(f"checkpoint {folder} is missing {len(missing)} tensor(s), first: {missing[0]}")
    mtp_first = cfg.num_hidden_layers
    loaded_layers = mtp_first + len(model.mtp)
    for key in sorted(present - set(plan)):
        if key.endswith("weight_scale_inv") and key.removesuffix("_scale_inv") in present:
            continue  # read together with its weight
        expert = EXPERT_KEY.match(key)
        if expert and int(expert.group(1)) < loaded_layers and int(expert.group(2)) < cfg.n_routed_experts:
            continue  # another EP rank's expert
        layer = LAYER_KEY.match(key)
        if layer and loaded_layers <= int(layer.group(1)) < mtp_first + cfg.num_nextn_predict_layers:
            continue  # an MTP layer's weights, not asked for
        raise ValueError(f"checkpoint {folder} has an unexpected tensor: {key}")
    show = state.rank == 0 and len(plan) >= 200
    for done, (key, (dest, dim, raw)) in enumerate(sorted(plan.items()), 1):
        full = list(dest.shape)
        start = 0
        if dim is not None:
            full[dim] *= state.tp_size
            start = dest.shape[dim] * state.tp_rank
        if ckpt.shape(key) != tuple(full):
            raise ValueError(
                f"tensor {key}: checkpoint shape {ckpt.shape(key)} does not match the expected {tuple(full)}"
            )
        if not ckpt.dtype(key).startswith(("F", "BF")):  # copying would turn the integers into weights silently
            raise ValueError(
                f"tensor {key}: checkpoint dtype {ckpt.dtype(key)}; expected a floating-point tensor (F32, BF16, "
                "F16 or F8_E4M3)"
            )
        with torch.no_grad():
            dest.copy_(
                ckpt.read(key, dim, start, start + (dest.shape[dim] if dim is not None else 0), cfg.fp8_block_size, raw)
            )
        if show and (done % max(1, len(plan) // 20) == 0 or done == len(plan)):
            print(
                f"\rloading weights: {done}/{len(plan)} tensors",
                end="\n" if done == len(plan) else "",
                file=sys.stderr,
                flush=True,
            )


def _plan(model: DeepseekV32ForCausalLM) -> dict:
    """Checkpoint key -> (this rank's destination tensor, TP dim or None, raw: copy FP8 values as stored)."""
    plan = {}
    for module_name, module in model.named_modules():  # shared modules appear once, under their first name
        module_name = MTP_MODULE.sub(
            lambda m: f"model.layers.{model.cfg.num_hidden_layers + int(m.group(1))}.", module_name
        )
        # their checkpoint tensors are not their parameters
        if isinstance(module, Experts):
            plan |= {key: (dest, None, raw) for key, (dest, raw) in module.checkpoint_plan(module_name).items()}
            continue
        if isinstance(module, MergedLinear):
            owner = module_name.rpartition(".")[0]
            plan |= {key: (dest, module.tp_dim, False) for key, dest in module.checkpoint_plan(owner).items()}
            continue
        for name, param in module.named_parameters(recurse=False):
            dim = getattr(module, "tp_dim", None) if name == "weight" else None
            plan[f"{module_name}.{name}"] = (param.data, dim, False)
    return plan
