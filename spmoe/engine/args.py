"""Every engine option, declared once with its checks: `EngineArgs`; what the options build is
`build.py`'s. `spmoe generate`, `spmoe serve`, `spmoe demo` and the benchmarks build their engines
from it; options only one command needs (addresses, output paths, input ids, max_new_tokens,
sampling) stay with that command. The command line (flags, `--help`, vLLM's value forms) is the
entry points' (`spmoe/entrypoints/engine_flags.py`); each option's flag is its field's name with
dashes (`EngineArgs.flag`), which is how the errors here name it.

The checks come in two steps: what the options say alone (`__post_init__`: ranges and combinations),
and what needs the checkpoint's config (`check`: the parallel layout, the device, the MTP layer,
CUDA graphs, positions, the paged cache's budget), both before any rank starts.
"""

import os
from dataclasses import dataclass

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.config.parallel import EP_BACKENDS, MOE_BACKENDS, SP_MODES, SP_SCOPES
from spmoe.engine.cache.paged import BLOCK_SIZE, check_paged_budget
from spmoe.engine.engine import check_positions
from spmoe.engine.runner.static_step import deployment_problems
from spmoe.engine.speculation import Speculation
from spmoe.models.deepseek_v32 import weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
KV_CACHES = ("paged", "dense")
SPECULATIVE_METHODS = ("mtp",)
SIMULATED_LOADS = ("rank0", "busiest")
# the values an option may take, where they are few
CHOICES = {
    "sp": SP_MODES,
    "sp_scope": SP_SCOPES,
    "ep_backend": EP_BACKENDS,
    "moe_backend": MOE_BACKENDS,
    "simulated_load": SIMULATED_LOADS,
    "load_format": weights.LOAD_FORMATS,
    "kv_cache": KV_CACHES,
    "speculative": SPECULATIVE_METHODS,
}


def check_device(device: str, ranks: int) -> None:
    """Raise unless `device` can hold `ranks` local ranks (one GPU each on CUDA). Under torchrun
    every process is one rank, so one GPU is enough."""
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
    tp: int = 1
    dp: int = 1
    sp: str = "auto"
    sp_scope: str = "moe"
    ep_backend: str = "allgather_reducescatter"
    moe_backend: str = "auto"
    enable_expert_parallel: bool = False
    simulate_rank: bool = False
    simulated_load: str = "rank0"
    # the model
    dtype: str = "float32"
    device: str = "cpu"
    load_format: str = "auto"
    hf_overrides: dict | None = None
    quantization: str | None = None
    # the scheduler
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    # the KV cache
    kv_cache: str = "paged"
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool | None = None
    # speculation and CUDA graphs
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    # --speculative-config: what drafts, read from vLLM's form by the command line
    speculative_config: Speculation | None = None
    cuda_graphs: bool | None = False
    enforce_eager: bool = False
    block_size: int | None = None

    def __post_init__(self):
        """The checks that need nothing but the options; one-line errors naming the flag."""
        for name in ("tp", "dp", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{self.flag(name)} must be >= 1, got {value}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            unset = value is None and EngineArgs.__dataclass_fields__[name].default is None
            if value not in choices and not unset:
                raise ValueError(
                    f"{self.flag(name)} must be one of {tuple(choices)}, got {value!r}"
                )
        if self.block_size not in (None, BLOCK_SIZE):
            raise ValueError(
                f"--block-size must be {BLOCK_SIZE}, the paged cache's only block size, got "
                f"{self.block_size}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"--dtype must be one of {tuple(DTYPES)} here, got {self.dtype!r} (the command "
                "line settles auto)"
            )
        drafts_given = self.speculative is not None or self.num_speculative_tokens is not None
        if self.speculative_config is not None and drafts_given:
            raise ValueError(
                "--speculative-config says what --speculative does; pass one or the other"
            )
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
                "--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged "
                "cache; got them with --kv-cache dense"
            )
        if self.kv_cache == "dense" and self.enable_prefix_caching:
            raise ValueError(
                "--enable-prefix-caching needs --kv-cache paged: the dense cache keeps nothing "
                "between requests"
            )

    @staticmethod
    def flag(name: str) -> str:
        """The flag that names field `name` in error messages: its name with dashes."""
        return "--" + name.replace("_", "-")

    # What the options mean.

    @property
    def drafts(self) -> int:
        """Draft tokens per sequence and step; 0: no speculation."""
        return self.speculation.num_speculative_tokens

    @property
    def speculation(self) -> Speculation:
        """What drafts: --speculative-config, or --speculative mtp with its drafts (the drafts
        alone: MTP, as vLLM 0.7 took them)."""
        if self.speculative_config is not None:
            return self.speculative_config
        if self.speculative is None and self.num_speculative_tokens is None:
            return Speculation()
        drafts = 1 if self.num_speculative_tokens is None else self.num_speculative_tokens
        return Speculation(num_speculative_tokens=drafts)

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine keeps full blocks for later requests: on for the paged cache unless
        turned off."""
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
        """Whether decode steps replay CUDA graphs: as --cuda-graphs / --enforce-eager say, or, left
        to the default (None), wherever they apply: CUDA, the all-gather dispatch, experts that a
        graph can capture (`model.graph_capturable`)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.graphs_may_apply() and model.graph_capturable[0]

    def graphs_may_apply(self) -> bool:
        """Whether the deployment can have CUDA graphs (known before any rank starts): not
        --enforce-eager, CUDA, the all-gather dispatch."""
        return not (self.enforce_eager or deployment_problems(self.device, self.ep_backend))

    def model_config(self, model_dir: str) -> ModelConfig:
        """The checkpoint's config with `--hf-overrides` merged in."""
        return ModelConfig.from_file(model_dir, self.hf_overrides)

    # The checks that need the checkpoint, before any rank starts.

    def check(self, cfg: ModelConfig, longest: int) -> None:
        """Raise a one-line error unless the checkpoint `cfg` can run under these options: the
        parallel layout, the device, the MTP layer, CUDA graphs, `max_model_len` against the model's
        positions, and (paged) a cache budget that holds a sequence of `longest` positions."""
        parallel = self.parallel_config()
        cfg.check_parallel(parallel)
        check_device(self.device, 1 if self.simulate_rank else parallel.world_size)
        if self.speculation.mtp_drafts and not cfg.num_nextn_predict_layers:
            raise ValueError(
                "--speculative mtp needs an MTP layer; the checkpoint has num_nextn_predict_layers "
                "= 0"
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
