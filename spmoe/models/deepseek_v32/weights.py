"""Load a Hugging Face safetensors checkpoint into one rank's model.

Each rank reads only its slice of every TP-sharded tensor and only its own experts. Missing tensors,
unexpected tensors and wrong shapes are errors that name the tensor.

FP8 checkpoints (e4m3 weights with one scale per block: DeepSeek / GLM `weight_scale_inv`,
compressed-tensors `weight_scale`): on the GPU with 128 x 128 blocks every FP8 linear keeps the
stored values and scales (the experts, `Linear`, the FP8 parts of a `MergedLinear`), so the weights
take the checkpoint's bytes; on the CPU, with other blocks, or when asked (`keep_fp8=False`: the
reference the FP8 path is measured against) they are dequantised into the model dtype. Which linears
are FP8 is what the checkpoint stores, checked against the quantization config: a linear it leaves
unquantised (`modules_to_not_convert` / `ignore`) must not be FP8, a compressed-tensors linear
outside `ignore` must be, and an FP8 weight needs its scales, of its block grid's shape; each is a
one-line error naming the layer.

MTP layers follow the DeepSeek-V3 / GLM convention: checkpoint layer `num_hidden_layers + i` holds
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block's attention and MoE, and optionally its
own `shared_head.head` and `embed_tokens` (otherwise the main model's are used). They are loaded
with `with_mtp=True` and skipped otherwise.
"""

import dataclasses
import json
import re
import sys
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state
from spmoe.layers.fused import TRITON_INSTALLED
from spmoe.layers.linear import Linear, MergedLinear
from spmoe.layers.moe.experts.base import Experts
from spmoe.layers.quantization.fp8_linear import FP8_BLOCK, block_grid, quantize_blocks
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
# vLLM's names: auto and safetensors read the checkpoint
LOAD_FORMATS = (
    "auto",
    "safetensors",
    "dummy",
)
MTP_MODULE = re.compile(r"^mtp\.(\d+)\.(mtp_block\.)?")  # our module names -> model.layers.{L}.


def load_model(
    model_dir: str | Path,
    parallel: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_mtp: bool = False,
    load_format: str = "auto",
    overrides: dict | None = None,
    keep_fp8: bool | None = None,
) -> DeepseekV32ForCausalLM:
    """Build the model for this rank (with its MTP layers in `model.mtp` if asked) and fill it from
    the checkpoint in `model_dir`, or (`load_format` "dummy") with random weights from its config
    alone. `overrides`: merged into the config (`ModelConfig.from_file`). keep_fp8: whether an FP8
    checkpoint's linears stay FP8 (None: where they can, `fp8_stays_fp8`; False: dequantised, the
    reference). Prints the weights' size on rank 0."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {load_format!r}")
    cfg = ModelConfig.from_file(model_dir, overrides)
    if load_format == "dummy":
        model = random_model(cfg, parallel, dtype, device, with_mtp, keep_fp8=keep_fp8)
    else:
        model = _load_checkpoint(Path(model_dir), cfg, parallel, dtype, device, with_mtp, keep_fp8)
    if get_parallel_state().rank == 0:
        size = weight_bytes(model)
        size = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        print(f"weights: {size} on each rank", file=sys.stderr, flush=True)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s parameters (each shared tensor once)."""
    params = {id(t): t for t in model.parameters()}.values()
    return sum(t.numel() * t.element_size() for t in params)


def _keeps_fp8(cfg: ModelConfig, dtype, device, keep_fp8: bool | None) -> bool:
    """Whether the FP8 linears of `cfg` stay FP8 (`load_model`'s keep_fp8)."""
    if keep_fp8 and cfg.fp8_block_size not in (None, FP8_BLOCK):
        raise ValueError(
            f"FP8 linears can stay FP8 with {FP8_BLOCK} blocks only, the checkpoint has "
            f"{cfg.fp8_block_size}"
        )
    if keep_fp8 is None:
        return fp8_stays_fp8(cfg, dtype, device)
    return keep_fp8 and cfg.fp8_block_size is not None


def _load_checkpoint(
    folder: Path, cfg: ModelConfig, parallel, dtype, device, with_mtp, keep_fp8
) -> DeepseekV32ForCausalLM:
    ckpt = Checkpoint(folder, cfg.fp8_block_size, cfg.fp8_scale_suffix)
    keep = _keeps_fp8(cfg, dtype, device, keep_fp8)
    # dequantised: built as a model without FP8 (the experts' backends decide from the config)
    build_cfg = cfg if keep else dataclasses.replace(cfg, fp8_block_size=None)
    model = build_model(build_cfg, parallel, with_mtp, ckpt.keys(), dtype, device)
    fp8 = fp8_linears(model, cfg, ckpt)
    if keep:
        keep_fp8_linears(model, fp8)
    load_weights(model, ckpt)
    return model


def fp8_stays_fp8(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether an FP8 checkpoint's linears keep their FP8 weights: 128 x 128 blocks, 16-bit
    activations, on CUDA with Triton (the kernels that compute them); elsewhere they are
    dequantised."""
    return (
        cfg.fp8_block_size == FP8_BLOCK
        and dtype in (torch.bfloat16, torch.float16)
        and torch.device(device).type == "cuda"
        and TRITON_INSTALLED
    )


def _linear_parts(model: torch.nn.Module):
    """-> (checkpoint module name, module, part name or None) of every `Linear` and every part of
    every `MergedLinear` of `model`, checkpoint names as in `_plan`."""
    for module_name, module in _named_modules(model):
        if isinstance(module, Linear):
            yield module_name, module, None
        elif isinstance(module, MergedLinear):
            owner = module_name.rpartition(".")[0]
            for part in module.parts:
                yield f"{owner}.{part}", module, part


def fp8_linears(model: DeepseekV32ForCausalLM, cfg: ModelConfig, ckpt: "Checkpoint") -> set[str]:
    """The checkpoint names of `model`'s linears that the checkpoint stores in FP8, checked against
    the quantization config of `cfg` (see the module docstring); raises naming the first misfit."""
    if cfg.fp8_block_size is None:
        return set()
    found = set()
    for name, _, _ in _linear_parts(model):
        key = f"{name}.weight"
        if key not in ckpt.weight_map:
            continue  # reported as missing by the loader
        stored = ckpt.dtype(key) == torch.float8_e4m3fn
        expected = cfg.fp8_expected(name)
        if stored and expected is False:
            raise ValueError(
                f"layer {name}: the quantization config leaves it unquantised, but {key} is FP8"
            )
        if not stored and expected:
            raise ValueError(
                f"layer {name}: FP8 by the quantization config (not in its ignore list), but {key} "
                f"is {ckpt.dtype(key)}"
            )
        if stored:
            scale_key = f"{name}.{cfg.fp8_scale_suffix}"
            if scale_key not in ckpt.weight_map:
                raise ValueError(
                    f"layer {name}: {key} is FP8 but the checkpoint has no {scale_key}"
                )
            found.add(name)
    return found


def keep_fp8_linears(model: DeepseekV32ForCausalLM, fp8: set[str]) -> None:
    """Switch the linears named in `fp8` (checkpoint names) to FP8 weights; raises naming a layer
    whose TP shard cuts through a block."""
    merged: dict[int, tuple[str, MergedLinear, set[str]]] = {}
    for name, module, part in _linear_parts(model):
        if name not in fp8:
            continue
        if part is None:
            if reason := module.fp8_misfit():
                raise ValueError(f"layer {name} cannot keep its FP8 weight: {reason}")
            module.keep_fp8()
        else:
            merged.setdefault(id(module), (name, module, set()))[2].add(part)
    for name, module, parts in merged.values():
        if reason := module.fp8_misfit(parts):
            raise ValueError(
                f"layer {name.rpartition('.')[0]} cannot keep its FP8 weights: {reason}"
            )
        module.keep_fp8(parts)


def build_model(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    with_mtp: bool,
    checkpoint_keys: set[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DeepseekV32ForCausalLM:
    """The model with uninitialised weights; an MTP layer gets its own embedding / head only where
    the checkpoint has them."""
    if with_mtp and not cfg.num_nextn_predict_layers:
        raise ValueError(
            "the checkpoint has no MTP layer (num_nextn_predict_layers is 0 or missing)"
        )
    own = tuple(
        (
            f"model.layers.{cfg.num_hidden_layers + i}.embed_tokens.weight" in checkpoint_keys,
            f"model.layers.{cfg.num_hidden_layers + i}.shared_head.head.weight" in checkpoint_keys,
        )
        for i in range(cfg.num_nextn_predict_layers if with_mtp else 0)
    )
    return DeepseekV32ForCausalLM(cfg, parallel, dtype, device, own)


def write_random_checkpoint(raw_config: dict, folder: Path, seed: int) -> None:
    """Write `config.json` and a `model.safetensors` of deterministic random weights (main and MTP
    layers) in the Hugging Face layout, for the demo and tests. Runs on one rank (TP = 1)."""
    cfg = ModelConfig.from_dict(raw_config)
    model = build_model(
        cfg,
        ParallelConfig(tensor_parallel_size=1, moe_backend="torch"),  # never run: no choice
        cfg.num_nextn_predict_layers > 0,
        set(),
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        key: random_init(key, torch.randn(dest.shape, generator=gen), cfg.hidden_size)
        for key, (dest, _, _) in sorted(_plan(model).items())
    }
    # Structure for MTP to find: the LM head is a permutation of the embedding, so each token has a
    # likely successor (which the layers perturb), and eh_proj passes the next token's embedding
    # through.
    perm = torch.randperm(cfg.vocab_size, generator=gen)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][perm] * cfg.hidden_size**-0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2))


def random_init(key: str, noise: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The random value of the whole checkpoint tensor `key` from standard normal `noise` of its
    shape: norms near 1, small biases, linears scaled by 1/sqrt(fan-in), an MTP eh_proj that passes
    the embedding through."""
    if key.endswith("norm.weight"):
        return 1.0 + 0.2 * noise
    if noise.dim() == 1:  # biases: the router's score correction, the indexer's k_norm
        return 0.1 * noise
    if key.endswith("eh_proj.weight"):
        hidden_part = 0.3 * noise[:, hidden_size:] * hidden_size**-0.5
        return torch.cat([torch.eye(hidden_size, device=noise.device), hidden_part], 1)
    return noise * (1.0 if "embed_tokens" in key else noise.shape[1] ** -0.5)


def random_model(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_mtp: bool = False,
    seed: int = 0,
    keep_fp8: bool | None = None,
) -> DeepseekV32ForCausalLM:
    """This rank's model with random weights from the config alone (`--load-format dummy`): no file
    is read. Every tensor is drawn whole on this rank's device from a generator seeded by `seed` and
    its checkpoint key (`random_init`), and this rank keeps its slice, so TP ranks hold the slices
    of one tensor and the weights do not depend on the number of ranks.

    An FP8 config builds the modules and dtypes its checkpoint would (`keep_fp8` as in
    `load_model`): kept FP8, every linear the DeepSeek / GLM FP8 checkpoints store in FP8 (all but
    `BF16_IN_FP8_CHECKPOINTS` and those the quantization config leaves unquantised) holds e4m3
    weights with scales of 1; otherwise the dequantised model."""
    keep = _keeps_fp8(cfg, dtype, device, keep_fp8)
    build_cfg = cfg if keep else dataclasses.replace(cfg, fp8_block_size=None)
    model = build_model(build_cfg, parallel, with_mtp, set(), dtype, device)
    if keep:
        keep_fp8_linears(
            model,
            {
                name
                for name, _, _ in _linear_parts(model)
                if cfg.fp8_expected(name) is not False
                and not name.endswith(BF16_IN_FP8_CHECKPOINTS)
            },
        )
    state = get_parallel_state()
    with torch.no_grad():
        for key, (dest, dim, _) in sorted(_plan(model).items()):
            if key.endswith(cfg.fp8_scale_suffix):
                dest.fill_(1.0)
                continue
            full = list(dest.shape)
            if dim is not None:
                full[dim] *= state.tp_size
            gen = torch.Generator(device=dest.device).manual_seed(
                seed * 2**32 + zlib.crc32(key.encode())
            )
            value = random_init(
                key, torch.randn(full, generator=gen, device=dest.device), cfg.hidden_size
            )
            if dim is not None:
                value = value.narrow(dim, dest.shape[dim] * state.tp_rank, dest.shape[dim])
            dest.copy_(value)
    return model.eval()


FP8_SCHEMES = ("fp8", "compressed-tensors")
# The linears that DeepSeek-V3.2's and GLM-5's FP8 checkpoints keep in bf16 without naming them in
# the quantization config: the indexer's per-head weights.
BF16_IN_FP8_CHECKPOINTS = ("indexer.weights_proj",)


def write_fp8_checkpoint(
    model: DeepseekV32ForCausalLM,
    raw_config: dict,
    folder: Path,
    scheme: str = "fp8",
    unquantized: tuple[str, ...] = BF16_IN_FP8_CHECKPOINTS,
) -> None:
    """Write the FP8 twin of a TP 1 `model`'s weights to `folder` (with `raw_config`, its
    config.json, plus the quantization config): every linear (the experts', `Linear`s,
    `MergedLinear` parts) as e4m3 with 128 x 128 block scales, but those whose name ends with one of
    `unquantized` (listed in the config); everything else as it is. scheme "fp8": DeepSeek / GLM
    (`weight_scale_inv`); "compressed-tensors": llm-compressor's FP8 block (`weight_scale`, an
    `ignore` list)."""
    if scheme not in FP8_SCHEMES:
        raise ValueError(f"scheme must be one of {FP8_SCHEMES}, got {scheme!r}")
    plan = _plan(model)
    linears = {f"{name}.weight" for name, _, _ in _linear_parts(model)}
    linears |= {key for key in plan if EXPERT_KEY.match(key)}
    suffix = "weight_scale_inv" if scheme == "fp8" else "weight_scale"
    # each tensor leaves the model's device as it is made: the FP8 twin of a model that fills most
    # of a GPU does not fit beside it
    tensors = {}
    for key, (dest, _, _) in plan.items():
        if key in linears and not key.removesuffix(".weight").endswith(unquantized):
            q, scale = quantize_blocks(dest.detach())
            tensors[key], tensors[key.removesuffix("weight") + suffix] = q.cpu(), scale.cpu()
        else:
            tensors[key] = dest.detach().cpu().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    block = list(FP8_BLOCK)
    if scheme == "fp8":
        quantization = dict(
            quant_method="fp8",
            fmt="e4m3",
            activation_scheme="dynamic",
            weight_block_size=block,
            modules_to_not_convert=list(unquantized),
        )
    else:
        weights = dict(
            num_bits=8,
            type="float",
            strategy="block",
            block_structure=block,
            symmetric=True,
            dynamic=False,
        )
        acts = dict(
            num_bits=8, type="float", strategy="group", group_size=128, symmetric=True, dynamic=True
        )
        quantization = dict(
            quant_method="compressed-tensors",
            format="float-quantized",
            config_groups={
                "group_0": dict(targets=["Linear"], weights=weights, input_activations=acts)
            },
            ignore=["lm_head", "model.embed_tokens", r"re:.*mlp\.gate$"]
            + [f"re:.*{re.escape(u)}$" for u in unquantized],
        )
    (folder / "config.json").write_text(
        json.dumps({**raw_config, "quantization_config": quantization}, indent=2)
    )


class Checkpoint:
    """The tensors of a checkpoint folder: one `model.safetensors`, or shards listed in the index
    file. FP8 weights' scales are `{module}.{scale_suffix}`, one per `block`."""

    def __init__(
        self,
        folder: Path,
        block: tuple[int, int] | None = None,
        scale_suffix: str = "weight_scale_inv",
    ):
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
        self.block, self.scale_suffix = block, scale_suffix

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _slice(self, key: str):
        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = _open(self.folder / name)
        return self._handles[name].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        name = self._slice(key).get_dtype()
        return SAFETENSORS_DTYPES.get(name) or getattr(torch, name.lower(), None) or name

    def read(
        self, key: str, dim: int | None, start: int, stop: int, raw: bool = False
    ) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) `[start, stop)` of a tensor, or all of it (dim None); FP8
        weights are dequantised with their block scales unless `raw`."""
        view = self._slice(key)
        index = (slice(None),) if dim is None else (slice(None),) * dim + (slice(start, stop),)
        tensor = view[index]
        if raw or tensor.dtype != torch.float8_e4m3fn:
            return tensor
        scale_key, block = key.removesuffix("weight") + self.scale_suffix, self.block
        if block is None or scale_key not in self.weight_map:
            raise ValueError(
                f"{key} is FP8 but the checkpoint has no {scale_key} / "
                "quantization_config block size"
            )
        if self.shape(scale_key) != block_grid(*self.shape(key), block):
            raise ValueError(
                f"tensor {scale_key}: checkpoint shape {self.shape(scale_key)} does not match the "
                f"expected {block_grid(*self.shape(key), block)} (one scale per {block[0]} x "
                f"{block[1]} block of {key})"
            )
        row0, col0 = (start, 0) if dim == 0 else (0, start) if dim == 1 else (0, 0)
        scale = self._slice(scale_key)[
            (slice(row0 // block[0], None), slice(col0 // block[1], None))
        ]
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        r, c = row0 % block[0], col0 % block[1]
        return tensor.float() * scale[r : r + tensor.shape[0], c : c + tensor.shape[1]]


SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}


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
        raise ValueError(
            f"checkpoint {folder} is missing {len(missing)} tensor(s), first: {missing[0]}"
        )
    mtp_first = cfg.num_hidden_layers
    loaded_layers = mtp_first + len(model.mtp)
    suffix = ckpt.scale_suffix
    for key in sorted(present - set(plan)):
        if key.endswith(f".{suffix}") and key.removesuffix(suffix) + "weight" in present:
            continue  # read together with its weight
        expert = EXPERT_KEY.match(key)
        if (
            expert
            and int(expert.group(1)) < loaded_layers
            and int(expert.group(2)) < cfg.n_routed_experts
        ):
            continue  # another EP rank's expert
        layer = LAYER_KEY.match(key)
        if (
            layer
            and loaded_layers <= int(layer.group(1)) < mtp_first + cfg.num_nextn_predict_layers
        ):
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
                f"tensor {key}: checkpoint shape {ckpt.shape(key)} does not match the "
                f"expected {tuple(full)}"
            )
        dtype = ckpt.dtype(key)
        # copying would make integers weights
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"tensor {key}: checkpoint dtype {dtype}; expected a floating-point tensor (F32, "
                "BF16, F16 or F8_E4M3)"
            )
        if raw and dest.dtype == torch.float8_e4m3fn and dtype != dest.dtype:
            raise ValueError(
                f"tensor {key}: the layer holds FP8 e4m3 weights, the checkpoint stores {dtype}"
            )
        with torch.no_grad():
            dest.copy_(
                ckpt.read(key, dim, start, start + (dest.shape[dim] if dim is not None else 0), raw)
            )
        if show and (done % max(1, len(plan) // 20) == 0 or done == len(plan)):
            print(
                f"\rloading weights: {done}/{len(plan)} tensors",
                end="\n" if done == len(plan) else "",
                file=sys.stderr,
                flush=True,
            )


def _named_modules(model: DeepseekV32ForCausalLM):
    """(checkpoint module name, module) of every module; shared modules appear once, under
    their first name."""
    for module_name, module in model.named_modules():
        yield (
            MTP_MODULE.sub(
                lambda m: f"model.layers.{model.cfg.num_hidden_layers + int(m.group(1))}.",
                module_name,
            ),
            module,
        )


def _plan(model: DeepseekV32ForCausalLM) -> dict:
    """Checkpoint key -> (this rank's destination tensor, TP dim or None, raw: copy FP8
    values as stored)."""
    plan, suffix = {}, model.cfg.fp8_scale_suffix
    for module_name, module in _named_modules(model):
        # their checkpoint tensors are not their parameters
        if isinstance(module, Experts):
            plan |= {
                key: (dest, None, raw)
                for key, (dest, raw) in module.checkpoint_plan(module_name).items()
            }
            continue
        if isinstance(module, MergedLinear):
            plan |= module.checkpoint_plan(module_name.rpartition(".")[0], suffix)
            continue
        if isinstance(module, Linear):
            plan |= module.checkpoint_plan(module_name, suffix)
            continue
        for name, param in module.named_parameters(recurse=False):
            dim = getattr(module, "tp_dim", None) if name == "weight" else None
            plan[f"{module_name}.{name}"] = (param.data, dim, False)
    return plan
