"""The engine's options on the command line: each `EngineArgs` field's flags, `--help` section and
what argparse takes (`ENGINE_FLAGS`), added to a parser (`add_engine_args`) and read back into
checked options (`engine_args_from_cli`), vLLM's value forms read on the way (vllm_values.py).
Adding a flag name (an alias) is adding it to its option's names here; an option's first name is
its field's with dashes (`EngineArgs.flag`), as the engine's errors name it.
"""

import argparse
from dataclasses import fields, replace

import torch

from spmoe.config.model import read_config
from spmoe.engine.args import CHOICES, DTYPES, EngineArgs
from spmoe.engine.cache.paged import DEFAULT_GPU_MEMORY_UTILIZATION
from spmoe.entrypoints.options import (
    memory_option,
    model_option,
    parallel_option,
    speculation_option,
)
from spmoe.entrypoints.vllm_values import (
    SpeculativeConfig,
    argparse_type,
    block_size_note,
    check_quantization,
    parse_device,
    parse_dtype,
    parse_json_object,
    parse_kv_cache_dtype,
    parse_length,
    resolve_dtype,
)

# `spmoe forward`'s options
LAYOUT_OPTIONS = ("tp", "dp", "sp", "sp_scope", "ep_backend", "moe_backend", "dtype", "device")

ENGINE_FLAGS = {
    "tp": parallel_option(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="tensor-parallel size (default 1)",
    ),
    "dp": parallel_option(
        "--dp",
        "--data-parallel-size",
        "-dp",
        type=int,
        help="data-parallel size (default 1): DP groups of --tp ranks each take a share of the "
        "requests; the experts are split over all dp * tp ranks",
    ),
    "sp": parallel_option(
        "--sp",
        choices=CHOICES["sp"],
        help="sequence-parallel MoE (default auto: on when tp > 1 and dp > 1)",
    ),
    "sp_scope": parallel_option(
        "--sp-scope",
        choices=CHOICES["sp_scope"],
        help="which layers are SP (default moe)",
    ),
    "ep_backend": parallel_option(
        "--ep-backend",
        choices=CHOICES["ep_backend"],
        help="how SP layers dispatch tokens to experts (default allgather_reducescatter)",
    ),
    "moe_backend": parallel_option(
        "--moe-backend",
        choices=CHOICES["moe_backend"],
        help="expert kernels (default auto: the first that fits, see docs/serving.md)",
    ),
    "enable_expert_parallel": parallel_option(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="accepted for vLLM's command lines: the routed experts are always expert-parallel "
        "over all tp * dp ranks",
    ),
    "simulate_rank": parallel_option(
        "--simulate-rank",
        action="store_true",
        help="measurement only: run rank 0 of the --tp x --dp layout on this one device, the other "
        "ranks simulated (collectives move no data; seeded routing; outputs are not the "
        "model's). Needs --load-format dummy. See docs/deployment-sizing.md",
    ),
    "simulated_load": parallel_option(
        "--simulated-load",
        choices=CHOICES["simulated_load"],
        help="with --simulate-rank: the experts' rows of rank 0 (default) or, per layer, of the "
        "busiest EP rank",
    ),
    "dtype": model_option(
        "--dtype",
        type=argparse_type(parse_dtype, "--dtype"),
        metavar="{auto,bfloat16,float32,float}",
        cli_default="auto",
        help="compute dtype (default auto: bfloat16 on CUDA; on the CPU the checkpoint's "
        "torch_dtype, float32 if it states none); float is float32",
    ),
    "device": model_option(
        "--device",
        type=argparse_type(parse_device, "--device"),
        metavar="{auto,cpu,cuda}",
        cli_default=None,
        help="default (auto): cuda when a GPU is visible, else cpu",
    ),
    "load_format": model_option(
        "--load-format",
        choices=CHOICES["load_format"],
        help="auto / safetensors (default: the checkpoint's weights) or dummy (random weights from "
        "config.json alone, no weight file read)",
    ),
    "hf_overrides": model_option(
        "--hf-overrides",
        type=argparse_type(
            lambda text: parse_json_object(text, "--hf-overrides"), "--hf-overrides"
        ),
        metavar="JSON",
        help="JSON object merged into config.json, nested objects key by key (also as dotted keys: "
        "--hf-overrides.num_hidden_layers 4)",
    ),
    "quantization": model_option(
        "--quantization",
        "-q",
        metavar="METHOD",
        help="accepted when it is the method the checkpoint declares (fp8); spmoe does not "
        "quantize at load",
    ),
    "max_num_seqs": memory_option(
        "--max-num-seqs",
        type=int,
        help="sequences running at once per DP group; more wait (default: generate every prompt; "
        "serve 256 on CUDA, 8 on the CPU)",
    ),
    "max_model_len": memory_option(
        "--max-model-len",
        type=argparse_type(parse_length, "--max-model-len"),
        metavar="LEN",
        help="KV cache positions per sequence: prompt + output + drafts; 2048, 128k (x1000), 128K "
        "(x1024) (default: generate the longest prompt + max new tokens + drafts; serve the "
        "model's max_position_embeddings, on the CPU at most 2048)",
    ),
    "max_num_batched_tokens": memory_option(
        "--max-num-batched-tokens",
        type=int,
        help="tokens one step feeds (default 8192): decode tokens first, then prompts in chunks",
    ),
    "kv_cache": memory_option(
        "--kv-cache",
        choices=CHOICES["kv_cache"],
        help="paged (default): blocks of 64 tokens handed out as sequences grow, sparse DSA "
        "attention; dense: one slot of --max-model-len positions per sequence, dense "
        "attention (the reference)",
    ),
    "kv_cache_memory": memory_option(
        "--kv-cache-memory",
        type=float,
        metavar="GIB",
        help=f"paged cache size in GiB per rank (default: on CUDA --gpu-memory-utilization "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION}; on CPU --max-num-seqs x --max-model-len tokens)",
    ),
    "gpu_memory_utilization": memory_option(
        "--gpu-memory-utilization",
        "--device-memory-utilization",
        type=float,
        metavar="F",
        help="paged cache as this share of the GPU memory free once the weights are loaded (CUDA)",
    ),
    "kv_cache_dtype": memory_option(
        "--kv-cache-dtype",
        type=argparse_type(parse_kv_cache_dtype, "--kv-cache-dtype"),
        metavar="{auto,fp8,fp8_e4m3}",
        help="paged cache: auto (the model dtype, default) or fp8 = fp8_e4m3 (the latent in e4m3 "
        "with a scale per 128 values, the indexer key in e4m3 with one scale)",
    ),
    "enable_prefix_caching": memory_option(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="paged cache: keep full blocks after their request ends, so that a later request with "
        "the same prefix reuses them instead of computing it again (default on; "
        "--no-enable-prefix-caching: off)",
    ),
    "speculative": speculation_option(
        "--speculative",
        choices=CHOICES["speculative"],
        help="draft tokens with the checkpoint's MTP layer (greedy and sampled requests)",
    ),
    "num_speculative_tokens": speculation_option(
        "--num-speculative-tokens",
        type=int,
        help="MTP drafts per step (default 1 with --speculative; alone it turns MTP on, as vLLM "
        "0.7 took it)",
    ),
    "speculative_config": speculation_option(
        "--speculative-config",
        type=argparse_type(SpeculativeConfig.checked_json, "--speculative-config"),
        metavar="JSON",
        help="vLLM's form of --speculative: "
        '{"method": "mtp", "num_speculative_tokens": 1} (method '
        "also deepseek_mtp or glm4_moe_mtp; ngram, suffix with vLLM's keys; mtp+ngram, "
        "mtp+suffix: both in one draft), or as dotted keys: --speculative-config.method mtp",
    ),
    "cuda_graphs": speculation_option(
        "--cuda-graphs",
        action="store_true",
        cli_default=None,
        help="replay decode steps, speculative ones too, from CUDA graphs (CUDA; default: where "
        "they apply)",
    ),
    "enforce_eager": speculation_option(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: every step runs eagerly",
    ),
    "block_size": memory_option(
        "--block-size",
        type=int,
        help="the paged cache's block: 64, the only size spmoe has (another is noted and 64 used)",
    ),
}


def inapplicable(given: dict) -> dict[str, str]:
    """The options among `given` (field -> value, the device settled) that vLLM's launch lines carry
    but that cannot apply here, each with the note that says so: a --block-size other than 64 (64 is
    used), --gpu-memory-utilization on the CPU (a share of GPU memory) or beside --kv-cache-memory
    (which sizes the cache, as vLLM's --kv-cache-memory-bytes does over it). A share outside (0, 1]
    is an error wherever it is given."""
    out = {}
    if note := block_size_note(given.get("block_size")):
        out["block_size"] = f"{note}; 64 used"
    share = given.get("gpu_memory_utilization")
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {share}")
    if share is not None and given.get("device") == "cpu":
        out["gpu_memory_utilization"] = (
            f"--gpu-memory-utilization {share}: ignored on cpu (a share of GPU memory): the paged "
            "cache is sized by --kv-cache-memory, else --max-num-seqs x --max-model-len"
        )
    elif share is not None and given.get("kv_cache_memory") is not None:
        out["gpu_memory_utilization"] = (
            f"--gpu-memory-utilization {share}: ignored: --kv-cache-memory sizes the paged cache "
            "(vLLM's --kv-cache-memory-bytes likewise wins over it)"
        )
    return out


def add_engine_args(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Every engine option (or those named in `only`) as a flag of `parser`, in its section of
    `--help`, with its default and help."""
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    for name, flag in ENGINE_FLAGS.items():
        if only is None or name in only:
            flag.add_to(parser, name, defaults[name])


def engine_args_from_cli(
    args: argparse.Namespace, model_dir: str | None = None, notes: list | None = None
) -> EngineArgs:
    """The options `add_engine_args` parsed (the defaults for those it did not add), checked, with
    the command line's `auto`s settled: the device (CUDA when a GPU is visible), the dtype (from the
    checkpoint in `model_dir`: `resolve_dtype`), CUDA graphs off where they cannot apply (else None:
    `use_cuda_graphs` settles them); `--speculative-config` read into the engine's draft sources;
    `--quantization` checked against the checkpoint. A vLLM option that cannot apply here
    (`inapplicable`) is dropped and its note appended to `notes`."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineArgs) if hasattr(args, f.name)}
    if given.get("device", "cpu") is None:
        given["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    for name, note in inapplicable(given).items():
        given[name] = None
        if notes is not None:
            notes.append(note)
    if given.get("speculative_config") is not None:
        given["speculative_config"] = SpeculativeConfig.parse(given["speculative_config"])
    dtype = given.get("dtype", "float32")
    options = EngineArgs(**{**given, "dtype": dtype if dtype in DTYPES else "float32"})
    if options.cuda_graphs is None and not options.graphs_may_apply():
        options = replace(options, cuda_graphs=False)
    raw = None
    if model_dir is not None and (dtype == "auto" or options.quantization):
        raw = read_config(model_dir, options.hf_overrides)
        check_quantization(options.quantization, raw)
    return replace(options, dtype=resolve_dtype(dtype, raw or {}, options.device))
