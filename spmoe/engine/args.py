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
from dataclasses import dataclass, field, fields

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.config.parallel import EP_BACKENDS, MOE_BACKENDS, SP_MODES, SP_SCOPES
from spmoe.engine.cuda_graphs import deployment_problems
from spmoe.engine.engine import Engine, check_positions
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPES,
    PagedKVCache,
    build_paged_cache,
    check_paged_budget,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHES = ("paged", "dense")
SPECULATIVE_METHODS = ("mtp",)
LAYOUT_OPTIONS = ("tp", "dp", "sp", "sp_scope", "ep_backend", "moe_backend", "dtype", "device")  # `spmoe forward`'s


def option(*flags: str, help: str, **argparse_kwargs) -> dict:
    """A field's command line: its flag names (the first one names it in error messages) and what argparse
    takes beside them (type, choices, metavar, action)."""
    return {"flags": flags, "help": help, "argparse": argparse_kwargs}


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
    tp: int = field(default=1, metadata=option("--tp", type=int, help="tensor-parallel size (default 1)"))
    dp: int = field(
        default=1,
        metadata=option(
            "--dp",
            type=int,
            help="data-parallel size (default 1): DP groups of --tp ranks each take a share of the requests; "
            "the experts are split over all dp * tp ranks",
        ),
    )
    sp: str = field(
        default="auto",
        metadata=option(
            "--sp", choices=SP_MODES, help="sequence-parallel MoE (default auto: on when tp > 1 and dp > 1)"
        ),
    )
    sp_scope: str = field(
        default="moe", metadata=option("--sp-scope", choices=SP_SCOPES, help="which layers are SP (default moe)")
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
            help="expert kernels (default auto: the first that fits, see the README)",
        ),
    )
    # the model
    dtype: str = field(default="float32", metadata=option("--dtype", choices=tuple(DTYPES), help="default float32"))
    device: str = field(default="cpu", metadata=option("--device", choices=("cpu", "cuda"), help="default cpu"))
    # the scheduler
    max_num_seqs: int | None = field(
        default=None,
        metadata=option(
            "--max-num-seqs",
            type=int,
            help="sequences running at once per DP group; more wait (default: generate every prompt, serve 8)",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=option(
            "--max-model-len",
            type=int,
            help="KV cache positions per sequence: prompt + output + drafts (default: generate the longest "
            "prompt + max new tokens + drafts; serve the model's max_position_embeddings, at most 2048)",
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
            type=float,
            metavar="F",
            help="paged cache as this share of the GPU memory free once the weights are loaded (CUDA)",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=option(
            "--kv-cache-dtype",
            choices=KV_CACHE_DTYPES,
            help="paged cache: auto (the model dtype, default) or fp8 (the latent in e4m3 with a scale per 128 "
            "values, the indexer key in e4m3 with one scale)",
        ),
    )
    # speculation and CUDA graphs
    speculative: str | None = field(
        default=None,
        metadata=option(
            "--speculative",
            choices=SPECULATIVE_METHODS,
            help="draft tokens with the checkpoint's MTP layer (greedy requests only)",
        ),
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata=option(
            "--num-speculative-tokens", type=int, help="MTP drafts per step (default 1, with --speculative)"
        ),
    )
    cuda_graphs: bool | None = field(
        default=None,
        metadata=option(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            help="replay decode steps from CUDA graphs, captured before the engine is ready (default: on where "
            "they can run: CUDA, DP 1, no speculation, experts that never sync the host; --no-cuda-graphs: "
            "every step eager)",
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
            if choices is not None and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{self.flag(f.name)} must be one of {tuple(choices)}, got {value!r}")
        if self.speculative is None and self.num_speculative_tokens is not None:
            raise ValueError(f"--num-speculative-tokens {self.num_speculative_tokens} needs --speculative mtp")
        if self.speculative is not None and self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"--speculative mtp needs --num-speculative-tokens >= 1, got {self.num_speculative_tokens}"
            )
        if self.kv_cache == "dense" and (self.kv_cache_memory, self.gpu_memory_utilization, self.kv_cache_dtype) != (
            None,
            None,
            "auto",
        ):
            raise ValueError(
                "--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged cache; "
                "got them with --kv-cache dense"
            )

    # The command line.

    @staticmethod
    def flag(name: str) -> str:
        """The flag that names field `name` in error messages."""
        return EngineArgs.__dataclass_fields__[name].metadata["flags"][0]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
        """Every engine option (or those named in `only`) as a flag of `parser`, with its default and help."""
        group = parser.add_argument_group("engine options")
        for f in fields(cls):
            if only is None or f.name in only:
                meta = f.metadata
                group.add_argument(
                    *meta["flags"], dest=f.name, default=f.default, help=meta["help"], **meta["argparse"]
                )

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        """The options `add_cli_args` parsed (the defaults for those it did not add), checked."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # What the options mean.

    @property
    def drafts(self) -> int:
        """MTP drafts per step; 0: no speculation."""
        if self.speculative is None:
            return 0
        return 1 if self.num_speculative_tokens is None else self.num_speculative_tokens

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
        )

    def describe(self, parallel: ParallelConfig) -> str:
        """One line for the start of a job: the layout, speculation, dtype and device."""
        return (
            f"tp={self.tp}, dp={self.dp}, sequence-parallel MoE {'on' if parallel.use_sequence_parallel_moe else 'off'}"
            f" (--sp {self.sp}, scope {self.sp_scope}), {f'MTP with {self.drafts} drafts, ' if self.drafts else ''}"
            f"{self.dtype} on {self.device}"
        )

    # The checks that need the checkpoint, before any rank starts.

    def check(self, cfg: ModelConfig, longest: int) -> None:
        """Raise a one-line error unless the checkpoint `cfg` can run under these options: the parallel layout,
        the device, the MTP layer, CUDA graphs, `max_model_len` against the model's positions, and (paged)
        a cache budget that holds a sequence of `longest` positions."""
        parallel = self.parallel_config()
        cfg.check_parallel(parallel)
        check_device(self.device, parallel.world_size)
        if self.drafts and not cfg.num_nextn_predict_layers:
            raise ValueError("--speculative mtp needs an MTP layer; the checkpoint has num_nextn_predict_layers = 0")
        if self.cuda_graphs and self.graph_problems():
            raise ValueError("--cuda-graphs needs " + "; ".join(self.graph_problems()))
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

    def graph_problems(self) -> list[str]:
        """What these options lack for CUDA-graph decode steps, known before the model is built."""
        problems = deployment_problems(self.device, self.dp, self.ep_backend)
        return problems + (["no speculative decoding (it runs eagerly)"] if self.drafts else [])

    def use_cuda_graphs(self, model) -> bool:
        """Whether the engine over `model` replays decode steps from CUDA graphs: as asked, or by default
        wherever they can run (the checks above, and experts that never sync the host)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return not self.graph_problems() and model.graph_capturable[0]

    # What the options build, on every rank.

    def build_kv_cache(self, model, max_num_seqs: int, max_len: int) -> KVCache | PagedKVCache:
        """Dense: one slot of `max_len` positions for each of `max_num_seqs` sequences; or paged
        (`build_paged_cache`: on CPU without a size, room for `max_num_seqs` x `max_len` tokens)."""
        if self.kv_cache == "dense":
            return KVCache.for_model(model, max_num_seqs, max_len)
        return build_paged_cache(
            model, self.kv_cache_memory, self.gpu_memory_utilization, self.kv_cache_dtype, max_num_seqs, max_len
        )

    def build_engine(self, model, max_num_seqs: int, cache_len: int, log=None) -> Engine:
        """The engine over a new KV cache for `max_num_seqs` sequences of `cache_len` positions (the dense
        cache's slots; the paged cache's default room on CPU), its CUDA graphs captured (`log(line)`: progress);
        `warmup.warm_up` then makes it ready."""
        return Engine(
            model,
            self.build_kv_cache(model, max_num_seqs, cache_len),
            self.drafts,
            self.use_cuda_graphs(model),
            max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            log,
        )
