"""Every engine option, declared once: `EngineArgs`, its command-line flags (`add_cli_args` / `from_cli`), its
checks, and what it builds (the parallel layout, the KV cache, the engine). `spmoe generate`, `spmoe serve`,
`spmoe demo` and the benchmarks build their engines from it; options only one command needs (addresses,
output paths, input ids, max_new_tokens, sampling) stay with that command.

Each option is a dataclass field whose metadata names its flags: adding a flag name (an alias) is adding it to
that field's `flags`.

The checks come in two steps: what the options say alone (`__post_init__`: ranges and combinations), and
what needs the checkpoint's config (`check`: the parallel layout, the device, the MTP layer, CUDA graphs,
positions, the paged cache's budget), both before any rank starts.
"""

import argparse
import os
from dataclasses import dataclass, field, fields, replace

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.config.model import read_config
from spmoe.config.parallel import EP_BACKENDS, MOE_BACKENDS, SP_MODES, SP_SCOPES
from spmoe.engine.cache.paged import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    PagedKVCache,
    build_paged_cache,
    check_paged_budget,
)
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.engine import Engine, check_positions
from spmoe.engine.runner.graphs import deployment_problems
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.engine.vllm_values import (
    SpeculativeConfig,
    check_block_size,
    check_quantization,
    parse_json_object,
    parse_kv_cache_dtype,
    parse_length,
    resolve_dtype,
)
from spmoe.models.deepseek_v32 import weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHES = ("paged", "dense")
SPECULATIVE_METHODS = ("mtp",)
LAYOUT_OPTIONS = (
    "tp",
    "dp",
    "sp",
    "sp_scope",
    "ep_backend",
    "moe_backend",
    "dtype",
    "device",
)  # `spmoe forward`'s


HELP_GROUPS = (
    "model",
    "parallelism",
    "memory and cache",
    "speculation and CUDA graphs",
    "chat and tools",
    "server",
    "logging",
)  # `--help`'s sections, in the order users look for a flag
ENGINE_HELP_GROUPS = {
    "parallelism": (
        "tp",
        "dp",
        "sp",
        "sp_scope",
        "ep_backend",
        "moe_backend",
        "enable_expert_parallel",
        "simulate_rank",
        "simulated_load",
    ),
    "model": ("dtype", "device", "load_format", "hf_overrides", "quantization"),
    "memory and cache": (
        "max_num_seqs",
        "max_model_len",
        "max_num_batched_tokens",
        "kv_cache",
        "kv_cache_memory",
        "gpu_memory_utilization",
        "kv_cache_dtype",
        "enable_prefix_caching",
        "block_size",
    ),
    "speculation and CUDA graphs": (
        "speculative",
        "num_speculative_tokens",
        "speculative_config",
        "cuda_graphs",
        "enforce_eager",
    ),
}  # each engine option's section of `--help`


def help_groups(parser: argparse.ArgumentParser) -> dict:
    """`parser`'s sections of `--help` by title (HELP_GROUPS), made on the first call; empty ones print
    nothing."""
    made = {group.title: group for group in parser._action_groups}
    return {title: made.get(title) or parser.add_argument_group(title) for title in HELP_GROUPS}


def option(*flags: str, help: str, cli_default=field, **argparse_kwargs) -> dict:
    """A field's command line: its flag names (the first one names it in error messages; vLLM's names are
    aliases), what argparse takes beside them (type, choices, metavar, action), and, where the command line's
    default differs from the field's (an `auto` that `from_cli` settles), `cli_default`."""
    meta = {"flags": flags, "help": help, "argparse": argparse_kwargs}
    if cli_default is not field:
        meta["cli_default"] = cli_default
    return meta


def _arg(parse, option_name: str):
    """An argparse `type` from a value parser that raises ValueError("OPTION: why"): argparse's one line
    then names the option once."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{option_name}: ")) from None

    convert.__name__ = option_name
    return convert


def _speculative_config(text: str) -> dict:
    """`--speculative-config`'s JSON, checked as a whole (`SpeculativeConfig.parse`) while parsing."""
    config = parse_json_object(text, "--speculative-config")
    SpeculativeConfig.parse(config)
    return config


def default_device() -> str:
    """CUDA when a GPU is visible, else the CPU: the device `--device` leaves to spmoe."""
    return "cuda" if torch.cuda.is_available() else "cpu"


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


@dataclass(frozen=True)
class EngineArgs:
    # the parallel layout
    tp: int = field(
        default=1,
        metadata=option(
            "--tp",
            "--tensor-parallel-size",
            "-tp",
            type=int,
            help="tensor-parallel size (default 1)",
        ),
    )
    dp: int = field(
        default=1,
        metadata=option(
            "--dp",
            "--data-parallel-size",
            "-dp",
            type=int,
            help="data-parallel size (default 1): DP groups of --tp ranks each take a share of the requests; "
            "the experts are split over all dp * tp ranks",
        ),
    )
    sp: str = field(
        default="auto",
        metadata=option(
            "--sp",
            choices=SP_MODES,
            help="sequence-parallel MoE (default auto: on when tp > 1 and dp > 1)",
        ),
    )
    sp_scope: str = field(
        default="moe",
        metadata=option("--sp-scope", choices=SP_SCOPES, help="which layers are SP (default moe)"),
    )
    ep_backend: str = field(
        default="allgather_reducescatter",
        metadata=option(
            "--ep-backend",
            choices=EP_BACKENDS,
            help="how SP layers dispatch tokens to experts (default allgather_reducescatter)",
        ),
    )
    moe_backend: str = field(
        default="auto",
        metadata=option(
            "--moe-backend",
            choices=MOE_BACKENDS,
            help="expert kernels (default auto: the first that fits, see docs/serving.md)",
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=option(
            "--enable-expert-parallel",
            "-ep",
            action="store_true",
            help="accepted for vLLM's command lines: the routed experts are always expert-parallel over all "
            "tp * dp ranks",
        ),
    )
    simulate_rank: bool = field(
        default=False,
        metadata=option(
            "--simulate-rank",
            action="store_true",
            help="measurement only: run rank 0 of the --tp x --dp layout on this one device, the other ranks "
            "simulated (collectives move no data; seeded routing; outputs are not the model's). Needs "
            "--load-format dummy. See docs/deployment-sizing.md",
        ),
    )
    simulated_load: str = field(
        default="rank0",
        metadata=option(
            "--simulated-load",
            choices=("rank0", "busiest"),
            help="with --simulate-rank: the experts' rows of rank 0 (default) or, per layer, of the busiest "
            "EP rank",
        ),
    )
    # the model
    dtype: str = field(
        default="float32",
        metadata=option(
            "--dtype",
            choices=("auto", *DTYPES, "float"),
            cli_default="auto",
            help="compute dtype (default auto: bfloat16 on CUDA; on the CPU the checkpoint's torch_dtype, "
            "float32 if it states none); float is float32",
        ),
    )
    device: str = field(
        default="cpu",
        metadata=option(
            "--device",
            choices=("cpu", "cuda"),
            cli_default=None,
            help="default: cuda when a GPU is visible, else cpu",
        ),
    )
    load_format: str = field(
        default="auto",
        metadata=option(
            "--load-format",
            choices=weights.LOAD_FORMATS,
            help="auto / safetensors (default: the checkpoint's weights) or dummy (random weights from "
            "config.json alone, no weight file read)",
        ),
    )
    hf_overrides: dict | None = field(
        default=None,
        metadata=option(
            "--hf-overrides",
            type=_arg(lambda text: parse_json_object(text, "--hf-overrides"), "--hf-overrides"),
            metavar="JSON",
            help="JSON object merged into config.json, nested objects key by key (also as dotted keys: "
            "--hf-overrides.num_hidden_layers 4)",
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=option(
            "--quantization",
            "-q",
            metavar="METHOD",
            help="accepted when it is the method the checkpoint declares (fp8); spmoe does not quantize at load",
        ),
    )
    # the scheduler
    max_num_seqs: int | None = field(
        default=None,
        metadata=option(
            "--max-num-seqs",
            type=int,
            help="sequences running at once per DP group; more wait (default: generate every prompt; serve 256 on "
            "CUDA, 8 on the CPU)",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=option(
            "--max-model-len",
            type=_arg(parse_length, "--max-model-len"),
            metavar="LEN",
            help="KV cache positions per sequence: prompt + output + drafts; 2048, 128k (x1000), 128K (x1024) "
            "(default: generate the longest "
            "prompt + max new tokens + drafts; serve the model's max_position_embeddings, on the CPU at most 2048)",
        ),
    )
    max_num_batched_tokens: int = field(
        default=8192,
        metadata=option(
            "--max-num-batched-tokens",
            type=int,
            help="tokens one step feeds (default 8192): decode tokens first, then prompts in chunks",
        ),
    )
    # the KV cache
    kv_cache: str = field(
        default="paged",
        metadata=option(
            "--kv-cache",
            choices=KV_CACHES,
            help="paged (default): blocks of 64 tokens handed out as sequences grow, sparse DSA attention; "
            "dense: one slot of --max-model-len positions per sequence, dense attention (the reference)",
        ),
    )
    kv_cache_memory: float | None = field(
        default=None,
        metadata=option(
            "--kv-cache-memory",
            type=float,
            metavar="GIB",
            help=f"paged cache size in GiB per rank (default: on CUDA --gpu-memory-utilization "
            f"{DEFAULT_GPU_MEMORY_UTILIZATION}; on CPU --max-num-seqs x --max-model-len tokens)",
        ),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=option(
            "--gpu-memory-utilization",
            "--device-memory-utilization",
            type=float,
            metavar="F",
            help="paged cache as this share of the GPU memory free once the weights are loaded (CUDA)",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=option(
            "--kv-cache-dtype",
            type=_arg(parse_kv_cache_dtype, "--kv-cache-dtype"),
            metavar="{auto,fp8,fp8_e4m3}",
            help="paged cache: auto (the model dtype, default) or fp8 = fp8_e4m3 (the latent in e4m3 with a "
            "scale per 128 values, the indexer key in e4m3 with one scale)",
        ),
    )
    enable_prefix_caching: bool | None = field(
        default=None,
        metadata=option(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            help="paged cache: keep full blocks after their request ends, so that a later request with the same "
            "prefix reuses them instead of computing it again (default on; --no-enable-prefix-caching: off)",
        ),
    )
    # speculation and CUDA graphs
    speculative: str | None = field(
        default=None,
        metadata=option(
            "--speculative",
            choices=SPECULATIVE_METHODS,
            help="draft tokens with the checkpoint's MTP layer (greedy and sampled requests)",
        ),
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata=option(
            "--num-speculative-tokens",
            type=int,
            help="MTP drafts per step (default 1, with --speculative)",
        ),
    )
    speculative_config: dict | None = field(
        default=None,
        metadata=option(
            "--speculative-config",
            type=_arg(_speculative_config, "--speculative-config"),
            metavar="JSON",
            help='vLLM\'s form of --speculative: {"method": "mtp", "num_speculative_tokens": 1} (method also '
            "deepseek_mtp or glm4_moe_mtp), or as dotted keys: --speculative-config.method mtp",
        ),
    )
    cuda_graphs: bool | None = field(
        default=False,
        metadata=option(
            "--cuda-graphs",
            action="store_true",
            cli_default=None,
            help="replay decode steps, speculative ones too, from CUDA graphs (CUDA, DP 1; default: where they apply)",
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=option(
            "--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly"
        ),
    )
    block_size: int | None = field(
        default=None,
        metadata=option(
            "--block-size", type=int, help="the paged cache's block: 64 (the only size spmoe has)"
        ),
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
            if (
                choices is not None
                and value not in choices
                and not (value is None and f.default is None)
            ):
                raise ValueError(
                    f"{self.flag(f.name)} must be one of {tuple(choices)}, got {value!r}"
                )
        check_block_size(self.block_size)
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
        if self.speculative is None and self.num_speculative_tokens is not None:
            raise ValueError(
                f"--num-speculative-tokens {self.num_speculative_tokens} needs --speculative mtp"
            )
        if (
            self.speculative is not None
            and self.num_speculative_tokens is not None
            and self.num_speculative_tokens < 1
        ):
            raise ValueError(
                f"--speculative mtp needs --num-speculative-tokens >= 1, got {self.num_speculative_tokens}"
            )
        if self.kv_cache == "dense" and (
            self.kv_cache_memory,
            self.gpu_memory_utilization,
            self.kv_cache_dtype,
        ) != (
            None,
            None,
            "auto",
        ):
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
        section = {name: title for title, names in ENGINE_HELP_GROUPS.items() for name in names}
        unplaced = [f.name for f in fields(cls) if f.name not in section]
        if unplaced:
            raise ValueError(
                f"engine options without a --help section in ENGINE_HELP_GROUPS: {unplaced}"
            )
        for f in fields(cls):
            if only is None or f.name in only:
                meta = f.metadata
                default = meta.get("cli_default", f.default)
                groups[section[f.name]].add_argument(
                    *meta["flags"],
                    dest=f.name,
                    default=default,
                    help=meta["help"],
                    **meta["argparse"],
                )

    @classmethod
    def from_cli(cls, args: argparse.Namespace, model_dir: str | None = None) -> "EngineArgs":
        """The options `add_cli_args` parsed (the defaults for those it did not add), checked, with the
        command line's `auto`s settled: the device (`default_device`), the dtype (from the checkpoint in
        `model_dir`: `resolve_dtype`), and CUDA graphs off where they cannot apply (elsewhere None:
        `use_cuda_graphs` settles them once the model is built); `--quantization` is checked against the
        checkpoint. The options are checked alone before the checkpoint is read."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if given.get("device", "cpu") is None:
            given["device"] = default_device()
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
        """MTP drafts per step; 0: no speculation."""
        if self.speculative_config is not None:
            return SpeculativeConfig.parse(self.speculative_config).num_speculative_tokens
        if self.speculative is None:
            return 0
        return 1 if self.num_speculative_tokens is None else self.num_speculative_tokens

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

    def describe(self, parallel: ParallelConfig) -> str:
        """One line for the start of a job: the layout, speculation, dtype and device."""
        return (
            f"tp={self.tp}, dp={self.dp}, sequence-parallel MoE {'on' if parallel.use_sequence_parallel_moe else 'off'}"
            f" (--sp {self.sp}, scope {self.sp_scope}), {f'MTP with {self.drafts} drafts, ' if self.drafts else ''}"
            f"{self.dtype} on {self.device}{self._graphs_said()}"
            f"{', dummy weights' if self.load_format == 'dummy' else ''}"
            f"{', SIMULATED RANK (rank 0 alone; measurement only)' if self.simulate_rank else ''}"
        )

    def _graphs_said(self) -> str:
        if self.cuda_graphs:
            return ", CUDA graphs"
        if self.cuda_graphs is None and not self.enforce_eager and self.device == "cuda":
            return ", CUDA graphs where they apply"
        return ""

    def use_cuda_graphs(self, model) -> bool:
        """Whether decode steps replay CUDA graphs: as --cuda-graphs / --enforce-eager say, or, left to the
        default (None), wherever they apply: CUDA, DP 1, the all-gather dispatch, experts that a
        graph can capture (`model.graph_capturable`)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.graphs_may_apply() and model.graph_capturable[0]

    def graphs_may_apply(self) -> bool:
        """Whether the deployment can have CUDA graphs (known before any rank starts): not --enforce-eager,
        CUDA, DP 1, the all-gather dispatch."""
        return not (
            self.enforce_eager or deployment_problems(self.device, self.dp, self.ep_backend)
        )

    def model_config(self, model_dir: str) -> ModelConfig:
        """The checkpoint's config with `--hf-overrides` merged in."""
        return ModelConfig.from_file(model_dir, self.hf_overrides)

    def load_model(self, model_dir: str, device: torch.device):
        """This rank's model: the checkpoint's weights, or random ones (`--load-format dummy`), under
        `--hf-overrides`."""
        return weights.load_model(
            model_dir,
            self.parallel_config(),
            self.torch_dtype,
            device,
            with_mtp=self.drafts > 0,
            load_format=self.load_format,
            overrides=self.hf_overrides,
        )

    # The checks that need the checkpoint, before any rank starts.

    def check(self, cfg: ModelConfig, longest: int) -> None:
        """Raise a one-line error unless the checkpoint `cfg` can run under these options: the parallel layout,
        the device, the MTP layer, CUDA graphs, `max_model_len` against the model's positions, and (paged)
        a cache budget that holds a sequence of `longest` positions."""
        parallel = self.parallel_config()
        cfg.check_parallel(parallel)
        check_device(self.device, 1 if self.simulate_rank else parallel.world_size)
        if self.drafts and not cfg.num_nextn_predict_layers:
            raise ValueError(
                "--speculative mtp needs an MTP layer; the checkpoint has num_nextn_predict_layers = 0"
            )
        if self.cuda_graphs:
            problems = deployment_problems(self.device, self.dp, self.ep_backend)
            if problems:
                raise ValueError("--cuda-graphs needs " + "; ".join(problems))
        if self.max_model_len is not None:
            check_positions(self.max_model_len, cfg.max_position_embeddings, "--max-model-len")
        if self.kv_cache == "paged":
            check_paged_budget(
                cfg,
                self.drafts > 0,
                self.torch_dtype,
                self.kv_cache_dtype,
                self.kv_cache_memory,
                self.gpu_memory_utilization,
                self.device,
                longest,
            )

    # What the options build, on every rank.

    def build_kv_cache(self, model, max_num_seqs: int, max_len: int) -> KVCache | PagedKVCache:
        """Dense: one slot of `max_len` positions for each of `max_num_seqs` sequences; or paged
        (`build_paged_cache`: on CPU without a size, room for `max_num_seqs` x `max_len` tokens; on CUDA, room
        for at least one sequence of `max_len`)."""
        if self.kv_cache == "dense":
            return KVCache.for_model(model, max_num_seqs, max_len)
        return build_paged_cache(
            model,
            self.kv_cache_memory,
            self.gpu_memory_utilization,
            self.kv_cache_dtype,
            max_num_seqs,
            max_len,
        )

    def build_engine(
        self,
        model,
        max_num_seqs: int,
        cache_len: int,
        grammars: GrammarCompiler | None = None,
        log=None,
    ) -> Engine:
        """The engine over a new KV cache for `max_num_seqs` sequences of `cache_len` positions (the dense
        cache's slots; the paged cache's default room on CPU; without --max-model-len, the longest sequence, which
        sets the width of the graphs' block tables), its CUDA graphs captured (`log(line)`: progress);
        `grammars`: for structured-output requests. `warmup.warm_up` then makes it ready."""
        return Engine(
            model,
            self.build_kv_cache(model, max_num_seqs, cache_len),
            self.drafts,
            self.use_cuda_graphs(model),
            max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len
            or cache_len,  # the graphs' block tables: as wide as the job's longest sequence
            self.prefix_caching,
            grammars,
            log,
        )
