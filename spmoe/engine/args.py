"""Every engine option, declared once: `EngineArgs`, its command-line flags (`add_cli_args` /
`from_cli`) and its checks; what the options build is `build.py`'s. `spmoe generate`, `spmoe serve`,
`spmoe demo` and the benchmarks build their engines from it; options only one command needs (addresses,
output paths, input ids, max_new_tokens, sampling) stay with that command.

Each option is a dataclass field declared with `options.option`, which names its flags: adding a flag name
(an alias) is adding it to that field's `flags`.

The checks come in two steps: what the options say alone (`__post_init__`: ranges and combinations), and
what needs the checkpoint's config (`check`: the parallel layout, the device, the MTP layer, CUDA graphs,
positions, the paged cache's budget), both before any rank starts.
"""

import argparse
import os
from dataclasses import dataclass, fields, replace

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.config.model import read_config
from spmoe.config.parallel import EP_BACKENDS, MOE_BACKENDS, SP_MODES, SP_SCOPES
from spmoe.engine.cache.paged import DEFAULT_GPU_MEMORY_UTILIZATION, check_paged_budget
from spmoe.engine.engine import check_positions
from spmoe.engine.options import (
    help_groups,
    memory_option,
    model_option,
    parallel_option,
    speculation_option,
)
from spmoe.engine.runner.static_step import deployment_problems
from spmoe.engine.speculation import Speculation
from spmoe.engine.vllm_values import (
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
from spmoe.models.deepseek_v32 import weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
KV_CACHES = ("paged", "dense")
SPECULATIVE_METHODS = ("mtp",)
# `spmoe forward`'s options
LAYOUT_OPTIONS = ("tp", "dp", "sp", "sp_scope", "ep_backend", "moe_backend", "dtype", "device")


def check_device(device: str, ranks: int) -> None:
    """Raise unless `device` can hold `ranks` local ranks (one GPU each on CUDA). Under torchrun every process
    is one rank, so one GPU is enough."""
    if device == "cpu":
        return
    needed = 1 if "WORLD_SIZE" in os.environ else ranks
    if not torch.cuda.is_available() or torch.cuda.device_count() < needed:
        raise ValueError(
            f"--device cuda with {ranks} ranks needs {needed} visible GPU(s), found "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )


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


@dataclass(frozen=True)
class EngineArgs:
    # the parallel layout
    tp: int = parallel_option(
        1,
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="tensor-parallel size (default 1)",
    )
    dp: int = parallel_option(
        1,
        "--dp",
        "--data-parallel-size",
        "-dp",
        type=int,
        help="data-parallel size (default 1): DP groups of --tp ranks each take a share of the requests; "
        "the experts are split over all dp * tp ranks",
    )
    sp: str = parallel_option(
        "auto",
        "--sp",
        choices=SP_MODES,
        help="sequence-parallel MoE (default auto: on when tp > 1 and dp > 1)",
    )
    sp_scope: str = parallel_option(
        "moe", "--sp-scope", choices=SP_SCOPES, help="which layers are SP (default moe)"
    )
    ep_backend: str = parallel_option(
        "allgather_reducescatter",
        "--ep-backend",
        choices=EP_BACKENDS,
        help="how SP layers dispatch tokens to experts (default allgather_reducescatter)",
    )
    moe_backend: str = parallel_option(
        "auto",
        "--moe-backend",
        choices=MOE_BACKENDS,
        help="expert kernels (default auto: the first that fits, see docs/serving.md)",
    )
    enable_expert_parallel: bool = parallel_option(
        False,
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="accepted for vLLM's command lines: the routed experts are always expert-parallel over all "
        "tp * dp ranks",
    )
    simulate_rank: bool = parallel_option(
        False,
        "--simulate-rank",
        action="store_true",
        help="measurement only: run rank 0 of the --tp x --dp layout on this one device, the other ranks "
        "simulated (collectives move no data; seeded routing; outputs are not the model's). Needs "
        "--load-format dummy. See docs/deployment-sizing.md",
    )
    simulated_load: str = parallel_option(
        "rank0",
        "--simulated-load",
        choices=("rank0", "busiest"),
        help="with --simulate-rank: the experts' rows of rank 0 (default) or, per layer, of the busiest "
        "EP rank",
    )
    # the model
    dtype: str = model_option(
        "float32",
        "--dtype",
        type=argparse_type(parse_dtype, "--dtype"),
        metavar="{auto,bfloat16,float32,float}",
        cli_default="auto",
        help="compute dtype (default auto: bfloat16 on CUDA; on the CPU the checkpoint's torch_dtype, "
        "float32 if it states none); float is float32",
    )
    device: str = model_option(
        "cpu",
        "--device",
        type=argparse_type(parse_device, "--device"),
        metavar="{auto,cpu,cuda}",
        cli_default=None,
        help="default (auto): cuda when a GPU is visible, else cpu",
    )
    load_format: str = model_option(
        "auto",
        "--load-format",
        choices=weights.LOAD_FORMATS,
        help="auto / safetensors (default: the checkpoint's weights) or dummy (random weights from "
        "config.json alone, no weight file read)",
    )
    hf_overrides: dict | None = model_option(
        None,
        "--hf-overrides",
        type=argparse_type(
            lambda text: parse_json_object(text, "--hf-overrides"), "--hf-overrides"
        ),
        metavar="JSON",
        help="JSON object merged into config.json, nested objects key by key (also as dotted keys: "
        "--hf-overrides.num_hidden_layers 4)",
    )
    quantization: str | None = model_option(
        None,
        "--quantization",
        "-q",
        metavar="METHOD",
        help="accepted when it is the method the checkpoint declares (fp8); spmoe does not quantize at load",
    )
    # the scheduler
    max_num_seqs: int | None = memory_option(
        None,
        "--max-num-seqs",
        type=int,
        help="sequences running at once per DP group; more wait (default: generate every prompt; serve 256 on "
        "CUDA, 8 on the CPU)",
    )
    max_model_len: int | None = memory_option(
        None,
        "--max-model-len",
        type=argparse_type(parse_length, "--max-model-len"),
        metavar="LEN",
        help="KV cache positions per sequence: prompt + output + drafts; 2048, 128k (x1000), 128K (x1024) "
        "(default: generate the longest "
        "prompt + max new tokens + drafts; serve the model's max_position_embeddings, on the CPU at most 2048)",
    )
    max_num_batched_tokens: int = memory_option(
        8192,
        "--max-num-batched-tokens",
        type=int,
        help="tokens one step feeds (default 8192): decode tokens first, then prompts in chunks",
    )
    # the KV cache
    kv_cache: str = memory_option(
        "paged",
        "--kv-cache",
        choices=KV_CACHES,
        help="paged (default): blocks of 64 tokens handed out as sequences grow, sparse DSA attention; "
        "dense: one slot of --max-model-len positions per sequence, dense attention (the reference)",
    )
    kv_cache_memory: float | None = memory_option(
        None,
        "--kv-cache-memory",
        type=float,
        metavar="GIB",
        help=f"paged cache size in GiB per rank (default: on CUDA --gpu-memory-utilization "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION}; on CPU --max-num-seqs x --max-model-len tokens)",
    )
    gpu_memory_utilization: float | None = memory_option(
        None,
        "--gpu-memory-utilization",
        "--device-memory-utilization",
        type=float,
        metavar="F",
        help="paged cache as this share of the GPU memory free once the weights are loaded (CUDA)",
    )
    kv_cache_dtype: str = memory_option(
        "auto",
        "--kv-cache-dtype",
        type=argparse_type(parse_kv_cache_dtype, "--kv-cache-dtype"),
        metavar="{auto,fp8,fp8_e4m3}",
        help="paged cache: auto (the model dtype, default) or fp8 = fp8_e4m3 (the latent in e4m3 with a "
        "scale per 128 values, the indexer key in e4m3 with one scale)",
    )
    enable_prefix_caching: bool | None = memory_option(
        None,
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="paged cache: keep full blocks after their request ends, so that a later request with the same "
        "prefix reuses them instead of computing it again (default on; --no-enable-prefix-caching: off)",
    )
    # speculation and CUDA graphs
    speculative: str | None = speculation_option(
        None,
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="draft tokens with the checkpoint's MTP layer (greedy and sampled requests)",
    )
    num_speculative_tokens: int | None = speculation_option(
        None,
        "--num-speculative-tokens",
        type=int,
        help="MTP drafts per step (default 1 with --speculative; alone it turns MTP on, as vLLM 0.7 "
        "took it)",
    )
    speculative_config: dict | None = speculation_option(
        None,
        "--speculative-config",
        type=argparse_type(SpeculativeConfig.checked_json, "--speculative-config"),
        metavar="JSON",
        help='vLLM\'s form of --speculative: {"method": "mtp", "num_speculative_tokens": 1} (method also '
        "deepseek_mtp or glm4_moe_mtp; ngram, suffix with vLLM's keys; mtp+ngram, mtp+suffix: both in "
        "one draft), or as dotted keys: --speculative-config.method mtp",
    )
    cuda_graphs: bool | None = speculation_option(
        False,
        "--cuda-graphs",
        action="store_true",
        cli_default=None,
        help="replay decode steps, speculative ones too, from CUDA graphs (CUDA; default: where they apply)",
    )
    enforce_eager: bool = speculation_option(
        False,
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: every step runs eagerly",
    )
    block_size: int | None = memory_option(
        None,
        "--block-size",
        type=int,
        help="the paged cache's block: 64, the only size spmoe has (another is noted and 64 used)",
    )

    def __post_init__(self):
        """The checks that need nothing but the options; one-line errors naming the flag."""
        for name in ("tp", "dp", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{self.flag(name)} must be >= 1, got {value}")
        for f in fields(self):
            choices = f.metadata["argparse"].get("choices")
            value = getattr(self, f.name)
            unset = value is None and f.default is None
            if choices is not None and value not in choices and not unset:
                raise ValueError(
                    f"{self.flag(f.name)} must be one of {tuple(choices)}, got {value!r}"
                )
        if note := block_size_note(self.block_size):
            raise ValueError(note)
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"--dtype must be one of {tuple(DTYPES)} here, got {self.dtype!r} (from_cli settles auto)"
            )
        if self.speculative_config is not None:
            if self.speculative is not None or self.num_speculative_tokens is not None:
                raise ValueError(
                    "--speculative-config says what --speculative does; pass one or the other"
                )
            SpeculativeConfig.parse(self.speculative_config)
        if self.simulate_rank and self.load_format != "dummy":
            raise ValueError(
                f"--simulate-rank needs --load-format dummy (its outputs are not the model's), got "
                f"--load-format {self.load_format}"
            )
        if self.simulated_load != "rank0" and not self.simulate_rank:
            raise ValueError(f"--simulated-load {self.simulated_load} needs --simulate-rank")
        if self.cuda_graphs and self.enforce_eager:
            raise ValueError("--cuda-graphs and --enforce-eager contradict each other; pass one")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"--num-speculative-tokens must be >= 1 (MTP drafts per step), got "
                f"{self.num_speculative_tokens}"
            )
        paged_sizes = (self.kv_cache_memory, self.gpu_memory_utilization, self.kv_cache_dtype)
        if self.kv_cache == "dense" and paged_sizes != (None, None, "auto"):
            raise ValueError(
                "--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged cache; "
                "got them with --kv-cache dense"
            )
        if self.kv_cache == "dense" and self.enable_prefix_caching:
            raise ValueError(
                "--enable-prefix-caching needs --kv-cache paged: the dense cache keeps nothing between requests"
            )

    # The command line.

    @staticmethod
    def flag(name: str) -> str:
        """The flag that names field `name` in error messages."""
        return EngineArgs.__dataclass_fields__[name].metadata["flags"][0]

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None
    ) -> None:
        """Every engine option (or those named in `only`) as a flag of `parser`, with its default and help."""
        groups = help_groups(parser)
        for f in fields(cls):
            if only is None or f.name in only:
                meta = f.metadata
                default = meta.get("cli_default", f.default)
                kwargs = {**meta["argparse"], "help": meta["help"]}
                group = groups[meta["section"]]
                group.add_argument(*meta["flags"], dest=f.name, default=default, **kwargs)

    @classmethod
    def from_cli(
        cls, args: argparse.Namespace, model_dir: str | None = None, notes: list | None = None
    ) -> "EngineArgs":
        """The options `add_cli_args` parsed (the defaults for those it did not add), checked alone, then
        the command line's `auto`s settled: the device (CUDA when a GPU is visible), the dtype (from the
        checkpoint in `model_dir`: `resolve_dtype`), CUDA graphs off where they cannot apply (else None:
        `use_cuda_graphs` settles them); `--quantization` checked against the checkpoint. A vLLM option
        that cannot apply here (`inapplicable`) is dropped and its note appended to `notes`."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if given.get("device", "cpu") is None:
            given["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        for name, note in inapplicable(given).items():
            given[name] = None
            if notes is not None:
                notes.append(note)
        dtype = given.get("dtype", "float32")
        options = cls(**{**given, "dtype": dtype if dtype in DTYPES else "float32"})
        if options.cuda_graphs is None and not options.graphs_may_apply():
            options = replace(options, cuda_graphs=False)
        raw = None
        if model_dir is not None and (dtype == "auto" or options.quantization):
            raw = read_config(model_dir, options.hf_overrides)
            check_quantization(options.quantization, raw)
        return replace(options, dtype=resolve_dtype(dtype, raw or {}, options.device))

    # What the options mean.

    @property
    def drafts(self) -> int:
        """Draft tokens per sequence and step; 0: no speculation."""
        return self.speculation.num_speculative_tokens

    @property
    def speculation(self) -> Speculation:
        """What drafts: --speculative-config, or --speculative mtp with its drafts (the drafts alone:
        MTP, as vLLM 0.7 took them)."""
        if self.speculative_config is not None:
            return SpeculativeConfig.parse(self.speculative_config)
        if self.speculative is None and self.num_speculative_tokens is None:
            return Speculation()
        drafts = 1 if self.num_speculative_tokens is None else self.num_speculative_tokens
        return Speculation(num_speculative_tokens=drafts)

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine keeps full blocks for later requests: on for the paged cache unless turned off."""
        return self.kv_cache == "paged" and self.enable_prefix_caching is not False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tp,
            data_parallel_size=self.dp,
            sp=self.sp,
            sp_scope=self.sp_scope,
            ep_backend=self.ep_backend,
            moe_backend=self.moe_backend,
            simulate_rank=self.simulate_rank,
            simulated_load=self.simulated_load,
        )

    def use_cuda_graphs(self, model) -> bool:
        """Whether decode steps replay CUDA graphs: as --cuda-graphs / --enforce-eager say, or, left to the
        default (None), wherever they apply: CUDA, the all-gather dispatch, experts that a
        graph can capture (`model.graph_capturable`)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.graphs_may_apply() and model.graph_capturable[0]

    def graphs_may_apply(self) -> bool:
        """Whether the deployment can have CUDA graphs (known before any rank starts): not --enforce-eager,
        CUDA, the all-gather dispatch."""
        return not (self.enforce_eager or deployment_problems(self.device, self.ep_backend))

    def model_config(self, model_dir: str) -> ModelConfig:
        """The checkpoint's config with `--hf-overrides` merged in."""
        return ModelConfig.from_file(model_dir, self.hf_overrides)

    # The checks that need the checkpoint, before any rank starts.

    def check(self, cfg: ModelConfig, longest: int) -> None:
        """Raise a one-line error unless the checkpoint `cfg` can run under these options: the parallel layout,
        the device, the MTP layer, CUDA graphs, `max_model_len` against the model's positions, and (paged)
        a cache budget that holds a sequence of `longest` positions."""
        parallel = self.parallel_config()
        cfg.check_parallel(parallel)
        check_device(self.device, 1 if self.simulate_rank else parallel.world_size)
        if self.speculation.mtp_drafts and not cfg.num_nextn_predict_layers:
            raise ValueError(
                "--speculative mtp needs an MTP layer; the checkpoint has num_nextn_predict_layers = 0"
            )
        if self.cuda_graphs:
            problems = deployment_problems(self.device, self.ep_backend)
            if problems:
                raise ValueError("--cuda-graphs needs " + "; ".join(problems))
        if self.max_model_len is not None:
            check_positions(self.max_model_len, cfg.max_position_embeddings, "--max-model-len")
        if self.kv_cache == "paged":
            check_paged_budget(
                cfg,
                self.speculation.mtp_drafts > 0,
                self.torch_dtype,
                self.kv_cache_dtype,
                self.kv_cache_memory,
                self.gpu_memory_utilization,
                self.device,
                longest,
            )
