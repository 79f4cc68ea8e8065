"""vLLM's `serve` flags as spmoe sees them: one table that `spmoe serve`'s parser and the flag
tables of docs/vllm-compatibility.md are both made from. It covers every option of the pinned vLLM
release (`vllm_flags_0_34`), every name of each, hidden forms included, and every option of the
releases from 0.6 to 0.33 that the pinned one no longer has (`vllm_flags_before_0_34`).

Each flag is
- `taken`: an spmoe option under vLLM's name, with vLLM's meaning (declared by the engine's or the
  server's options, or here when it only sets one of theirs);
- `noted`: taken, with a difference the note states (declared by the engine's or the server's
  options);
- `ignored`: accepted without effect; `spmoe serve` logs the note once at start, saying why that is
  safe (a tuning knob spmoe has no counterpart for, a feature of other model families, a logging
  detail);
- `refused`: spmoe does not do it. Giving it stops `spmoe serve` before any rank starts, with one
  line: the flag, that spmoe does not support it, and what to use instead (exit status 2). Some are
  refused only for some values (`--pipeline-parallel-size 1` is fine: it asks for what spmoe does).
"""

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spmoe.entrypoints import vllm_flags_0_34, vllm_flags_before_0_34
from spmoe.entrypoints.vllm_flags_read import version_key

MULTI_NODE = (
    "for several machines run spmoe under torchrun, one process per GPU, with TP (x DP) over all "
    "of them: torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --rdzv-backend c10d "
    "--rdzv-endpoint HOST0:29500 -m spmoe serve MODEL --tp 16 (docs/deployment.md)"
)
VERDICTS = ("taken", "noted", "ignored", "refused")
# argparse nargs
ARITIES = {
    "switch": 0,
    "value": None,
    "json": None,
    "values": "+",
    "optional": "?",
}

# a name of vLLM before 0.34 that 0.34 lacks -> the first and last release read with it
OLDER = {
    name: (first, last)
    for names, _, first, last in vllm_flags_before_0_34.options()
    for name in names
    if name not in {n for names, _ in vllm_flags_0_34.options() for n in names}
}
# vLLM before 0.8 took some switches with an optional true or false after them
# (`--enable-chunked-prefill false`): `vllm_argv` reads that value, so they are switches here
BOOLEAN_VALUED = tuple(
    name
    for names, arity, *_ in vllm_flags_before_0_34.options()
    if arity == "optional"
    for name in names
    if not name.startswith("--no-")
)
_ROWS = [
    *vllm_flags_0_34.options(),
    *(
        (names, "switch" if arity == "optional" else arity)
        for names, arity, *_ in vllm_flags_before_0_34.options()
        if set(names) <= set(OLDER)
    ),
]
_OPTIONS = {name: names for names, _ in _ROWS for name in names}
_ARITY = {name: arity for names, arity in _ROWS for name in names}


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # vLLM's names this verdict covers: long, short and hidden forms
    verdict: str  # one of VERDICTS
    note: str  # taken / noted / ignored: what spmoe does with it; refused: what spmoe does not do
    instead: str = ""  # refused: what to do instead
    arity: str = ""  # a key of ARITIES; "" (the default): vLLM's (the pinned release's, or older)
    allowed: Callable[[str | None], bool] | None = None  # refused: values accepted after all
    # taken here: (dest, value -> value)
    store: tuple[str, Callable[[str | None], Any]] | None = None

    def __post_init__(self):
        if not self.arity:
            object.__setattr__(self, "arity", _ARITY[self.names[0]])


def _is(*values: str) -> Callable[[str | None], bool]:
    return lambda value: value in values


def _all_of(name: str) -> tuple[str, ...]:
    """Every name of the vLLM option `name` belongs to (of the pinned release, else an older
    one)."""
    return _OPTIONS[name]


def _off_forms(name: str) -> tuple[str, ...]:
    """The names that turn switch `name` off: `--no-X`, and `--disable-X` for `--enable-X` (and
    back)."""
    inverse = {"--enable-": "--disable-", "--disable-": "--enable-"}
    flipped = {to + name.removeprefix(at) for at, to in inverse.items() if name.startswith(at)}
    return tuple(n for n in _OPTIONS[name] if n.startswith("--no-") or n in flipped)


def _on_forms(name: str) -> tuple[str, ...]:
    return tuple(n for n in _OPTIONS[name] if n not in _off_forms(name))


def _ignored(note: str, *names: str) -> tuple[VllmFlag, ...]:
    """One ignored flag per option named, with all of its names (on and off forms alike)."""
    return tuple(VllmFlag(_all_of(name), "ignored", note) for name in names)


def _refused(note: str, instead: str, *names: str) -> tuple[VllmFlag, ...]:
    """One refused flag per option named; a switch's off forms ask for what spmoe does: ignored."""
    flags = []
    for name in names:
        if _ARITY[name] != "switch" or not _off_forms(name):
            flags.append(VllmFlag(_all_of(name), "refused", note, instead))
            continue
        flags.append(VllmFlag(_on_forms(name), "refused", note, instead))
        flags.append(VllmFlag(_off_forms(name), "ignored", f"off, as always in spmoe: {note}"))
    return tuple(flags)


def _sets(dest: str, value: Any) -> tuple[str, Callable[[str | None], Any]]:
    return dest, lambda _: value


def _gib(text: str | None) -> float:
    """vLLM's byte count (`8589934592`, `8G`, `8g`) -> GiB, as `--kv-cache-memory` takes it."""
    from spmoe.entrypoints.vllm_values import parse_length

    return parse_length(text or "", "--kv-cache-memory-bytes") / 2**30


SAFE_TUNING = "a tuning knob of vLLM's kernels or scheduler; spmoe's output does not depend on it"
OTHER_MODELS = "it applies to model families spmoe does not serve"
MULTIMODAL = "multimodal input: spmoe serves text-only models, so it has nothing to set"
MAMBA = "Mamba / linear-attention state: the models spmoe serves have none"
LORA_OFF = "a LoRA setting: without --enable-lora (which spmoe refuses) it does nothing, as in vLLM"
SLEEP_OFF = (
    "a sleep-mode setting: without --enable-sleep-mode (which spmoe refuses) it does nothing"
)
LOGGING = "what vLLM logs: spmoe prints its own start-up lines; the counters are in /metrics"
TRACING = "tracing and profiling detail: spmoe exports none; the counters are in /metrics"
WEIGHT_LOADING = "how weights are read: spmoe reads the same *.safetensors weights its own way"
NO_CODE = "spmoe loads no code named on its command line"
NO_DOCS = "spmoe serves no /docs, /redoc or /openapi.json pages (its routes are OpenAI's)"
NO_CORS = (
    "spmoe sends no CORS headers: browsers on other origins are refused, which is stricter; "
    "server-side clients are unaffected"
)

VLLM_FLAGS = (
    # The model and where it comes from.
    VllmFlag(
        ("model",),
        "taken",
        "positional, as `vllm serve MODEL` (`--model` too): a folder or a Hugging Face id",
        arity="value",
    ),
    VllmFlag(("--model",), "taken", "the same as the positional MODEL"),
    VllmFlag(("--tokenizer",), "taken", "a folder or Hugging Face id with a separate tokenizer"),
    VllmFlag(("--revision",), "taken", "the Hugging Face branch, tag or commit"),
    VllmFlag(("--download-dir",), "taken", "the Hugging Face cache folder to use"),
    VllmFlag(
        ("--served-model-name",), "taken", "several names: the first is reported, all are listed"
    ),
    VllmFlag(
        ("--trust-remote-code",),
        "ignored",
        "spmoe runs no code from the checkpoint, so none is trusted",
    ),
    VllmFlag(("--no-trust-remote-code",), "ignored", "spmoe runs no code from the checkpoint"),
    VllmFlag(
        ("--tokenizer-mode",),
        "refused",
        "other tokenizer modes",
        "spmoe uses the checkpoint's tokenizer and chat template through transformers; give "
        "--chat-template for another template",
        allowed=_is("auto", "hf"),
    ),
    VllmFlag(("--hf-overrides",), "taken", "JSON (or dotted keys) merged into config.json"),
    VllmFlag(
        ("--generation-config",), "taken", "auto (generation_config.json), vllm (none) or a folder"
    ),
    VllmFlag(("--override-generation-config",), "taken", "JSON set over generation_config.json"),
    VllmFlag(
        ("--load-format",), "noted", "auto, safetensors, or dummy (random weights from the config)"
    ),
    VllmFlag(
        ("--dtype",),
        "noted",
        "auto, bfloat16, float32 or float; auto is bfloat16 on CUDA, on the CPU the checkpoint's; "
        "float16 and half are refused in a line naming bfloat16 (the DeepSeek-V3 family's "
        "activations can pass float16's largest value)",
    ),
    VllmFlag(
        ("--quantization", "-q"),
        "noted",
        "only the method the checkpoint declares (fp8); spmoe does not quantize at load time",
    ),
    *_refused(
        "other runners and conversions (pooling, embedding, scoring)",
        "spmoe generates text only; serve pooling models with vLLM",
        "--runner",
        "--convert",
    ),
    *_ignored(
        "pooling only: spmoe runs the generate runner",
        "--pooler-config",
        "--enable-flash-late-interaction",
        "--io-processor-plugin",
    ),
    VllmFlag(
        ("--hf-config-path",),
        "refused",
        "a config.json apart from the model",
        "put config.json in the model's folder, or change it with --hf-overrides",
    ),
    *_ignored("spmoe runs no code from the checkpoint", "--code-revision"),
    VllmFlag(
        ("--tokenizer-revision",),
        "refused",
        "a tokenizer revision apart from the model's",
        "download that revision and give its folder to --tokenizer",
    ),
    VllmFlag(
        ("--quantization-config",),
        "refused",
        "quantization settings on the command line",
        "spmoe reads the checkpoint's quantization_config; leave the flag out",
    ),
    *_ignored(
        "spmoe keeps its FP8 format whatever vLLM deprecates", "--allow-deprecated-quantization"
    ),
    VllmFlag(
        ("--hf-token",),
        "refused",
        "a Hugging Face token on the command line",
        "set HF_TOKEN in the environment (huggingface_hub reads it, and the cached login)",
        allowed=lambda value: value is None,
    ),
    VllmFlag(
        ("--config-format",),
        "refused",
        "other config formats",
        "spmoe reads Hugging Face's config.json",
        allowed=_is("auto", "hf"),
    ),
    VllmFlag(
        ("--model-impl",),
        "refused",
        "other model implementations",
        "spmoe runs its own; leave the flag out",
        allowed=_is("auto"),
    ),
    VllmFlag(
        ("--model-class-overrides",),
        "refused",
        "model class overrides",
        "spmoe runs its own model classes; leave the flag out",
    ),
    *_refused(
        "custom logits processors",
        NO_CODE + "; use the request fields (logit_bias, min_tokens, penalties)",
        "--logits-processors",
    ),
    *_ignored("spmoe's front end tokenizes in one worker thread", "--renderer-num-workers"),
    *_ignored(WEIGHT_LOADING, "--safetensors-load-strategy", "--safetensors-prefetch-num-threads"),
    *_ignored(WEIGHT_LOADING, "--safetensors-prefetch-block-size", "--model-loader-extra-config"),
    *_ignored(WEIGHT_LOADING, "--use-tqdm-on-load", "--pt-load-map-location"),
    *_ignored(WEIGHT_LOADING, "--shuffle-safetensors-files", "--max-parallel-loading-workers"),
    *_ignored(
        "spmoe downloads only config.json, the tokenizer's files and *.safetensors",
        "--ignore-patterns",
    ),
    # Parallelism.
    VllmFlag(("--tensor-parallel-size", "-tp"), "taken", "ranks per DP group (`--tp`)"),
    VllmFlag(
        ("--data-parallel-size", "-dp"), "taken", "DP groups (`--dp`); experts split over all ranks"
    ),
    VllmFlag(
        ("--enable-expert-parallel", "-ep"),
        "noted",
        "accepted: spmoe's routed experts are always expert-parallel over all TP x DP ranks",
    ),
    VllmFlag(
        ("--disable-expert-parallel", "--no-enable-expert-parallel"),
        "ignored",
        "spmoe's routed experts are always expert-parallel over all ranks; the layout does not "
        "change the answers",
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        "refused",
        "pipeline parallelism",
        MULTI_NODE,
        allowed=_is("1"),
    ),
    VllmFlag(
        ("--distributed-executor-backend",),
        "refused",
        "the ray and external_launcher executors",
        "spmoe starts its own local ranks (mp), or runs under torchrun; " + MULTI_NODE,
        allowed=_is("mp"),
    ),
    VllmFlag(
        _all_of("--data-parallel-backend"),
        "refused",
        "vLLM's ray data parallelism",
        MULTI_NODE,
        allowed=_is("mp"),
    ),
    *_refused(
        "vLLM's multi-node data parallelism",
        MULTI_NODE,
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--data-parallel-size-local",
        "--data-parallel-start-rank",
        "--data-parallel-rank",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--headless",
        "--headless-client-handshake-address",
        "--data-parallel-hybrid-lb",
        "--data-parallel-external-lb",
        "--data-parallel-multi-port-external-lb",
    ),
    *_ignored(
        "vLLM's DP supervisor: spmoe's DP groups live in one server",
        "--data-parallel-supervisor-port",
        "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s",
        "--dp-supervisor-probe-failure-threshold",
    ),
    VllmFlag(
        _all_of("--api-server-count"),
        "noted",
        "N HTTP front end processes share the port; each one's /metrics has the engine's counters "
        "and every front end's request metrics, totalled",
    ),
    VllmFlag(
        ("--moe-backend",),
        "noted",
        "spmoe's own expert kernels: auto, torch, triton or flashinfer_trtllm (another value is an "
        "error that lists these)",
    ),
    *_ignored(
        SAFE_TUNING + " (spmoe's --ep-backend picks how tokens reach the experts)",
        "--all2all-backend",
    ),
    *_ignored(
        "expert load balancing moves experts, not results: spmoe places them statically, an "
        "equal share on every rank",
        "--enable-eplb",
        "--eplb-config",
        "--expert-placement-strategy",
    ),
    *_ignored(
        "dual-batch overlap is a scheduling overlap; spmoe's output does not depend on it",
        "--enable-dbo",
        "--ubatch-size",
        "--dbo-decode-token-threshold",
        "--dbo-prefill-token-threshold",
    ),
    *(
        VllmFlag(
            _all_of(name),
            "refused",
            "context parallelism",
            "spmoe's long-context layout is its sequence-parallel MoE (--sp); leave the flag out",
            allowed=_is("1"),
        )
        for name in ("--decode-context-parallel-size", "--prefill-context-parallel-size")
    ),
    *_ignored(
        "a context-parallel setting: without context parallelism it does nothing",
        "--dcp-comm-backend",
        "--dcp-q-replicate",
        "--dcp-kv-cache-interleave-size",
        "--cp-kv-cache-interleave-size",
    ),
    *_ignored(
        SAFE_TUNING,
        "--distributed-timeout-seconds",
        "--cpu-distributed-timeout-seconds",
        "--numa-bind",
        "--numa-bind-nodes",
        "--numa-bind-cpus",
        "--enable-hc-sp",
        "--enable-batch-sharded-sampling",
        "--enable-ep-weight-filter",
        "--enable-shm-tensor-arena",
        "--dp-sync-interval",
        "--disable-nccl-for-dp-synchronization",
        "--ray-workers-use-nsight",
        "--disable-custom-all-reduce",
    ),
    VllmFlag(
        ("--device-ids",),
        "refused",
        "choosing GPUs by flag",
        "set CUDA_VISIBLE_DEVICES: spmoe's local ranks take the first --tp x --dp GPUs it shows",
    ),
    *_refused(
        "adding ranks while serving (elastic EP)",
        "start spmoe with the --tp and --dp it should have",
        "--enable-elastic-ep",
    ),
    *_ignored(
        "an elastic-EP setting: without elastic EP it does nothing", "--elastic-ep-max-dp-size"
    ),
    *_refused(
        "recovering from a failed rank",
        "a failed rank stops spmoe (its watchdog fails the open requests): run it under a "
        "supervisor that restarts it",
        "--enable-fault-tolerance",
    ),
    *_ignored(
        "a fault-tolerance setting: spmoe has no fault tolerance", "--fault-tolerance-config"
    ),
    VllmFlag(
        ("--worker-cls",),
        "refused",
        "custom worker classes",
        NO_CODE + "; leave the flag out",
        allowed=_is("auto"),
    ),
    VllmFlag(
        ("--worker-extension-cls",),
        "refused",
        "worker extensions",
        NO_CODE + "; leave the flag out",
        allowed=_is(""),
    ),
    # Memory, batching, the KV cache.
    VllmFlag(
        ("--max-model-len",),
        "taken",
        "with vLLM's suffixes: 1k = 1000, 1K = 1024, 128k; default on CUDA the model's "
        "max_position_embeddings, on the CPU at most 2048",
    ),
    VllmFlag(
        ("--max-num-seqs",),
        "taken",
        "requests decoded at once per DP group; default 256 on CUDA, 8 on the CPU",
    ),
    VllmFlag(
        ("--max-num-batched-tokens",), "taken", "tokens one step feeds; prompts prefill in chunks"
    ),
    VllmFlag(
        ("--gpu-memory-utilization", "--device-memory-utilization"),
        "noted",
        "the share of GPU memory free after the weights; on the CPU, or beside "
        "--kv-cache-memory(-bytes), noted at start and ignored",
    ),
    VllmFlag(
        ("--kv-cache-memory-bytes",),
        "taken",
        "the paged cache's size per rank (spmoe's --kv-cache-memory, in GiB)",
        store=("kv_cache_memory", _gib),
    ),
    VllmFlag(
        ("--kv-cache-dtype",), "noted", "auto, fp8 or fp8_e4m3 (e4m3 with a scale per 128 values)"
    ),
    VllmFlag(
        ("--kv-cache-dtype-skip-layers",),
        "refused",
        "keeping some layers' KV cache out of FP8",
        "spmoe's FP8 cache covers every layer: use --kv-cache-dtype auto to keep it all in the "
        "model's dtype",
    ),
    VllmFlag(
        ("--block-size",),
        "noted",
        "64, the paged cache's block; another size is noted at start and 64 used (vLLM uses 64 "
        "for MLA's paged cache too)",
    ),
    VllmFlag(
        ("--enable-chunked-prefill",),
        "ignored",
        "always on in spmoe (prompts longer than --max-num-batched-tokens prefill in chunks)",
    ),
    VllmFlag(
        ("--no-enable-chunked-prefill", "--disable-chunked-prefill"),
        "refused",
        "turning chunked prefill off",
        "leave the flag out: spmoe always prefills long prompts in chunks",
    ),
    VllmFlag(
        ("--enable-prefix-caching",),
        "taken",
        "on by default: full prompt blocks are reused across requests",
    ),
    VllmFlag(("--no-enable-prefix-caching",), "taken", "turns prefix caching off"),
    VllmFlag(
        ("--disable-prefix-caching",),
        "taken",
        "turns prefix caching off",
        store=_sets("enable_prefix_caching", False),
    ),
    *_ignored(
        "spmoe hashes full blocks in its own chain (parent hash + token ids); reuse stays exact",
        "--prefix-caching-hash-algo",
        "--prefix-cache-retention-interval",
        "--prefix-match-unit",
    ),
    *_ignored(
        SAFE_TUNING,
        "--enable-extensible-kv-cache",
        "--kv-sharing-fast-prefill",
        "--disable-hybrid-kv-cache-manager",
        "--disable-cascade-attn",
        "--enable-cumem-allocator",
    ),
    *_ignored(
        "spmoe sizes its cache from --gpu-memory-utilization or --kv-cache-memory; another size "
        "changes how many requests run at once, not their output",
        "--num-gpu-blocks-override",
    ),
    *_ignored(
        "spmoe keeps the KV cache on the GPU; a smaller cache changes how many requests run at "
        "once, not their output",
        "--kv-offloading-size",
        "--kv-offloading-backend",
    ),
    VllmFlag(
        ("--cpu-offload-gb",),
        "refused",
        "offloading weights to the CPU",
        "use more GPUs (--tp, --dp) or FP8 weights",
        allowed=_is("0"),
    ),
    VllmFlag(
        ("--offload-group-size",),
        "refused",
        "offloading weights to the CPU",
        "use more GPUs (--tp, --dp) or FP8 weights",
        allowed=_is("0"),
    ),
    *_ignored(
        "a weight-offloading setting: without --cpu-offload-gb or --offload-group-size (which "
        "spmoe refuses) it does nothing",
        "--offload-backend",
        "--cpu-offload-params",
        "--offload-num-in-group",
        "--offload-prefetch-step",
        "--offload-params",
    ),
    # Scheduling.
    *_ignored(
        SAFE_TUNING + " (spmoe schedules by --max-num-seqs and --max-num-batched-tokens)",
        "--max-num-scheduled-tokens",
        "--max-num-active-seqs",
        "--max-num-inflight-kv-loads",
        "--long-prefill-token-threshold",
        "--long-prefill-token-threshold-adaptive",
        "--scheduler-reserve-full-isl",
        "--watermark",
        "--prefill-schedule-interval",
        "--cache-aware-admission-window",
        "--cache-aware-admission-threshold",
    ),
    *_ignored(
        "spmoe bounds its queue by --max-num-waiting: a request beyond it gets 503, as here",
        "--max-num-queued-reqs",
        "--max-num-queued-tokens",
    ),
    VllmFlag(
        ("--scheduling-policy",),
        "refused",
        "priority scheduling",
        "spmoe serves requests first come, first served; leave the flag out",
        allowed=_is("fcfs"),
    ),
    VllmFlag(
        ("--scheduler-cls",), "refused", "custom schedulers", NO_CODE + "; leave the flag out"
    ),
    *_ignored(
        "spmoe streams every token as it comes; the text is the same",
        "--stream-interval",
    ),
    # Execution.
    VllmFlag(
        ("--seed",),
        "taken",
        "seeds the sampling seeds of requests that give none (a run repeats)",
    ),
    VllmFlag(
        ("--enforce-eager",), "noted", "turns off the decode CUDA graphs (on by default on CUDA)"
    ),
    VllmFlag(
        ("--no-enforce-eager",),
        "taken",
        "keeps the decode CUDA graphs (the default)",
        store=_sets("enforce_eager", False),
    ),
    *_ignored(
        "spmoe does not torch.compile; its decode CUDA graphs are on by default on CUDA, "
        "--enforce-eager turns them off",
        "--compilation-config",
        "--optimization-level",
        "--performance-mode",
    ),
    *_ignored(
        "spmoe captures a decode graph per batch size up to --max-num-seqs",
        "--cudagraph-capture-sizes",
        "--max-cudagraph-capture-size",
    ),
    *_ignored(
        "rank 0 always plans the next step while the front end runs; the output is the same",
        "--async-scheduling",
    ),
    *_ignored(
        SAFE_TUNING + " (spmoe runs its own sparse DSA attention over the paged cache)",
        "--attention-backend",
        "--attention-config",
    ),
    *_ignored(
        SAFE_TUNING,
        "--kernel-config",
        "--ir-op-priority",
        "--enable-flashinfer-autotune",
        "--monokernel",
        "--linear-backend",
        "--sparse-indexer-topk-backend",
        "--use-fp64-gumbel",
        "--additional-config",
        "--fail-on-environ-validation",
    ),
    *_ignored(
        OTHER_MODELS,
        "--disable-sliding-window",
        "--swa-bounded-replay",
        "--gdn-prefill-backend",
        "--kda-prefill-backend",
        "--kda-decode-backend",
        "--diffusion-config",
        "--engram-config",
    ),
    VllmFlag(
        _all_of("--speculative-config"),
        "noted",
        "methods mtp (deepseek_mtp, glm4_moe_mtp), ngram and suffix with vLLM's keys, and "
        "spmoe's mtp+ngram and mtp+suffix (both in one draft), as JSON or dotted keys; greedy and "
        "sampled requests",
    ),
    VllmFlag(
        ("--spec-method", "--spec-model", "--spec-tokens"),
        "noted",
        "the keys method, model and num_speculative_tokens of --speculative-config",
    ),
    *_refused("LoRA adapters", "merge the adapter into the checkpoint", "--enable-lora"),
    VllmFlag(
        ("--lora-modules",), "refused", "LoRA adapters", "merge the adapter into the checkpoint"
    ),
    *_ignored(
        LORA_OFF,
        "--max-loras",
        "--max-lora-rank",
        "--lora-dtype",
        "--enable-tower-connector-lora",
        "--max-cpu-loras",
        "--fully-sharded-loras",
        "--lora-target-modules",
        "--default-mm-loras",
        "--specialize-active-lora",
        "--enable-mixed-moe-lora-format",
        "--enable-moe-shared-loras",
        "--max-lora-cls-labels",
    ),
    *_refused(
        "sleep mode",
        "stop the server (SIGTERM) and start it again",
        "--enable-sleep-mode",
        "--checkpoint-prepare-on-startup",
    ),
    *_ignored(
        SLEEP_OFF,
        "--sleep-mode-backend",
        "--sleep-mode-offload-cudagraph",
        "--sleep-preserve-parameter-names",
        "--enable-nccl-comm-suspend",
    ),
    VllmFlag(
        ("--kv-transfer-config",),
        "refused",
        "disaggregated prefill (KV transfer)",
        "run prefill and decode in one server",
    ),
    *_ignored(
        "spmoe publishes no KV cache events; routers see its load in /metrics",
        "--kv-events-config",
    ),
    *_ignored(
        MULTIMODAL,
        "--trust-request-mm-kwargs",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--language-model-only",
        "--limit-mm-per-prompt",
        "--enable-mm-embeds",
        "--media-io-kwargs",
        "--mm-processor-kwargs",
        "--mm-processor-cache-gb",
        "--mm-processor-cache-type",
        "--mm-hasher-algorithm",
        "--mm-shm-cache-max-object-size-mb",
        "--mm-encoder-only",
        "--mm-encoder-tp-mode",
        "--mm-encoder-attn-backend",
        "--mm-encoder-attn-dtype",
        "--mm-encoder-fp8-scale-path",
        "--mm-encoder-fp8-scale-save-path",
        "--mm-encoder-fp8-scale-save-margin",
        "--interleave-mm-strings",
        "--skip-mm-profiling",
        "--video-pruning-rate",
        "--video-pruning-method",
        "--mm-tensor-ipc",
        "--mm-processor-device",
        "--mm-ipc-gpu-memory-gb",
        "--mm-device-do-normalize",
        "--disable-chunked-mm-input",
        "--ec-transfer-config",
        "--ec-manager-config",
    ),
    *_ignored(
        MAMBA,
        "--mamba-backend",
        "--mamba-ssu-algorithm",
        "--enable-mamba-cache-stochastic-rounding",
        "--mamba-cache-philox-rounds",
        "--mamba-cache-dtype",
        "--mamba-ssm-cache-dtype",
        "--mamba-block-size",
        "--mamba-cache-mode",
        "--enable-mamba-shared-prefix-checkpoint",
        "--replayssm-buffer-len",
        "--use-replayssm",
    ),
    *_refused(
        "returning routed experts or sampling masks",
        "leave the flag out",
        "--enable-return-routed-experts",
        "--return-sampling-mask",
    ),
    *_refused(
        "forcing decoding along a given trace of tokens",
        "leave the flag out",
        "--enable-trace-replay",
    ),
    VllmFlag(
        ("--aux-output-config",),
        "refused",
        "returning routed experts (auxiliary outputs)",
        "leave the flag out",
    ),
    VllmFlag(
        ("--max-logprobs",),
        "refused",
        "another limit of top logprobs",
        "spmoe answers up to 20 top logprobs per token (OpenAI's limit, vLLM's default); leave the "
        "flag out",
        allowed=_is("20"),
    ),
    VllmFlag(
        ("--logprobs-mode",),
        "refused",
        "other logprobs modes",
        "spmoe returns raw log-probabilities (vLLM's default, raw_logprobs); leave the flag out",
        allowed=_is("raw_logprobs"),
    ),
    *_refused(
        "prompts as embeddings or without a tokenizer",
        "send prompts as text or token ids; spmoe's front end needs the tokenizer",
        "--enable-prompt-embeds",
        "--skip-tokenizer-init",
        "--tokens-only",
    ),
    VllmFlag(
        ("--watermark-config",),
        "refused",
        "watermarking outputs",
        "leave the flag out",
    ),
    VllmFlag(
        ("--weight-transfer-config",),
        "refused",
        "updating weights while serving",
        "restart spmoe with the new checkpoint",
    ),
    *_ignored(
        "spmoe constrains every grammar with xgrammar; the output still follows the request's "
        "schema",
        "--structured-outputs-config",
    ),
    *_refused(
        "reasoning and tool parser plugins",
        NO_CODE + "; its parsers are built in (--reasoning-parser glm45, --tool-call-parser glm47)",
        "--reasoning-parser-plugin",
        "--tool-parser-plugin",
    ),
    VllmFlag(
        ("--reasoning-config",),
        "refused",
        "reasoning budgets",
        "use --reasoning-parser glm45 and the request's max_tokens",
    ),
    # The OpenAI front end.
    VllmFlag(("--host",), "taken", "the address to listen on (default 127.0.0.1)"),
    VllmFlag(("--port",), "taken", "the port (default 8000)"),
    VllmFlag(("--api-key",), "noted", "one key (vLLM takes several: more is an error)"),
    VllmFlag(
        ("--chat-template",), "taken", "a Jinja file or the template itself, over the tokenizer's"
    ),
    VllmFlag(
        ("--chat-template-content-format",),
        "noted",
        "string or openai (content as a list of text parts); auto is string",
    ),
    VllmFlag(("--reasoning-parser",), "taken", "GLM's <think> parser"),
    VllmFlag(("--tool-call-parser",), "taken", "GLM's tool-call parser"),
    VllmFlag(("--enable-auto-tool-choice",), "taken", "tool_choice auto"),
    VllmFlag(
        ("--disable-auto-tool-choice", "--no-enable-auto-tool-choice"),
        "taken",
        "tool_choice auto off (the default)",
        store=_sets("enable_auto_tool_choice", False),
    ),
    VllmFlag(("--uvicorn-log-level",), "taken", "uvicorn's log level (default warning)"),
    VllmFlag(
        ("--shutdown-timeout",),
        "taken",
        "after SIGTERM, how long open requests may still run",
    ),
    VllmFlag(
        ("--config",),
        "taken",
        "a YAML file of options, read as vLLM reads it; the command line's own options win",
    ),
    *_refused(
        "gRPC and Unix-socket front ends",
        "spmoe serves HTTP on --host and --port",
        "--grpc",
        "--grpc-port",
        "--uds",
    ),
    *_refused(
        "chat templates sent by requests",
        "give the template with --chat-template",
        "--trust-request-chat-template",
    ),
    VllmFlag(
        ("--default-chat-template-kwargs",),
        "taken",
        "JSON (or dotted keys) the chat template gets for every request, under the request's own "
        'chat_template_kwargs: {"enable_thinking": false} turns thinking off server-wide',
    ),
    VllmFlag(
        ("--reasoning-effort-map",),
        "refused",
        "mapping reasoning_effort to template arguments",
        "send chat_template_kwargs (enable_thinking) in each request, or give them server-wide "
        "with --default-chat-template-kwargs",
    ),
    VllmFlag(
        ("--response-role",),
        "refused",
        "another role for replies",
        "spmoe's replies are the assistant's; leave the flag out",
        allowed=_is("assistant"),
    ),
    *_refused(
        "token ids in place of logprobs' token texts",
        "send return_tokens_as_token_ids: true in the requests that want them",
        "--return-tokens-as-token-ids",
    ),
    *_refused(
        "leaving the tools out of the prompt when tool_choice is none",
        "send no tools in such requests",
        "--exclude-tools-when-tool-choice-none",
    ),
    VllmFlag(
        ("--tool-strict-level",),
        "refused",
        "another floor for constrained tool calls",
        "spmoe constrains calls by the request's tool_choice; leave the flag out",
        allowed=_is("auto"),
    ),
    VllmFlag(
        ("--tool-server",),
        "refused",
        "built-in tool servers (MCP)",
        "send the tools as function tools in each request and run them in the client",
    ),
    *_refused(
        "usage details vLLM adds on request (prompt_tokens_details, per-request metrics, "
        "forced streaming usage, /load)",
        "ask for usage with stream_options.include_usage; the counters are in /metrics",
        "--enable-prompt-tokens-details",
        "--enable-per-request-metrics",
        "--enable-force-include-usage",
        "--enable-server-load-tracking",
    ),
    *_refused(
        "the tokenizer info endpoint and the scale-out endpoints",
        "spmoe serves /tokenize and /detokenize; leave the flag out",
        "--enable-tokenizer-info-endpoint",
        "--enable-scale-out",
    ),
    *_ignored(
        "spmoe keeps its own system_fingerprint; the answers do not depend on it",
        "--fingerprint-mode",
        "--fingerprint-value",
    ),
    *_ignored(
        "spmoe sends no SSE keep-alive comments; a stream's events are the same",
        "--sse-keep-alive-interval",
    ),
    *_ignored(
        "spmoe always sends X-Request-Id (the client's, or one it makes)",
        "--enable-request-id-headers",
    ),
    *_ignored(
        "uvicorn's access lines are below spmoe's default --uvicorn-log-level warning",
        "--disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints",
    ),
    *_ignored(
        NO_CORS,
        "--allow-credentials",
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
    ),
    *_refused(
        "TLS",
        "spmoe serves plain HTTP: put a TLS proxy in front of it",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--enable-ssl-refresh",
        "--ssl-cert-reqs",
        "--ssl-ciphers",
    ),
    VllmFlag(
        ("--root-path",),
        "refused",
        "serving under a path prefix",
        "serve at / and let the proxy in front strip its prefix",
    ),
    VllmFlag(("--middleware",), "refused", "ASGI middleware", NO_CODE + "; leave the flag out"),
    *_ignored(NO_DOCS, "--disable-fastapi-docs", "--enable-offline-docs"),
    *_ignored(
        "uvicorn's HTTP/1.1 limits; spmoe caps request bodies with --max-request-bytes",
        "--h11-max-incomplete-event-size",
        "--h11-max-header-count",
    ),
    *_ignored(
        OTHER_MODELS + " (Cohere's models, Anthropic's messages API)",
        "--cohere-is-reasoning-model",
        "--cohere-format",
        "--anthropic-disabled-thinking-effort",
    ),
    *_ignored(
        "spmoe logs no requests; the counters are in /metrics",
        "--enable-log-requests",
        "--enable-log-outputs",
        "--enable-log-deltas",
        "--max-log-len",
    ),
    VllmFlag(
        ("--disable-log-stats",),
        "ignored",
        "spmoe prints no periodic stats; the counters are in /metrics",
        arity="switch",
    ),
    *_ignored(
        LOGGING,
        "--log-error-stack",
        "--logging-config",
        "--log-level",
        "--log-config-file",
        "--aggregate-engine-logging",
    ),
    *_ignored(
        TRACING,
        "--show-hidden-metrics-for-version",
        "--otlp-traces-endpoint",
        "--collect-detailed-traces",
        "--per-request-spec-decode-metrics",
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "--custom-histogram-buckets",
        "--cudagraph-metrics",
        "--enable-layerwise-nvtx-tracing",
        "--enable-mfu-metrics",
        "--enable-logging-iteration-details",
        "--jit-monitor-mode",
        "--jit-monitor-verbose",
        "--profiler-config",
        "--watchdog-config",
    ),
    # vLLM before 0.34: the flags of older releases that launch scripts still carry.
    VllmFlag(
        ("--device",),
        "noted",
        "auto (the default: cuda when a GPU is visible, else cpu), cuda or cpu; vLLM's other "
        "devices (tpu, xpu, neuron, hpu, openvino) are an error that says so",
    ),
    VllmFlag(
        ("--num-speculative-tokens",),
        "noted",
        "MTP drafts per step; alone it drafts with the checkpoint's MTP layer, as vLLM 0.7 did for "
        "checkpoints with one (same as --speculative-config.num_speculative_tokens)",
    ),
    VllmFlag(
        ("--speculative-model",),
        "noted",
        "the served model (vLLM 0.7's MTP form, with --num-speculative-tokens), or [ngram] (vLLM "
        "0.6's n-gram lookup: with --num-speculative-tokens and --ngram-prompt-lookup-max / -min, "
        "read as --speculative-config's ngram method and keys); a separate draft model is an error "
        "that says what to use",
        store=("speculative_model", lambda value: value),
    ),
    *_ignored(
        "without --speculative-model [ngram] it does nothing, as in vLLM; with it, it is the "
        "n-gram lookup's prompt_lookup_max (min), read as --speculative-config's key",
        "--ngram-prompt-lookup-max",
        "--ngram-prompt-lookup-min",
    ),
    *_ignored(
        "a setting of vLLM's draft-model speculation: spmoe drafts with the MTP layer or a lookup "
        "and accepts drafts by the exact rejection rule, so outputs keep the model's distribution",
        "--speculative-model-quantization",
        "--speculative-draft-tensor-parallel-size",
        "--speculative-max-model-len",
        "--speculative-disable-by-batch-size",
        "--spec-decoding-acceptance-method",
        "--typical-acceptance-sampler-posterior-threshold",
        "--typical-acceptance-sampler-posterior-alpha",
        "--disable-logprobs-during-spec-decoding",
        "--speculative-disable-mqa-scorer",
        "--num-lookahead-slots",
    ),
    VllmFlag(
        ("--task",),
        "refused",
        "other tasks (embedding, scoring, classification, ...)",
        "spmoe generates text only; serve pooling models with vLLM",
        allowed=_is("auto", "generate"),
    ),
    *_ignored(
        "pooling only: spmoe runs the generate task",
        "--override-pooler-config",
    ),
    *_refused(
        "vLLM's ray workers",
        "spmoe starts its own local ranks, or runs under torchrun; " + MULTI_NODE,
        "--worker-use-ray",
        "--engine-use-ray",
    ),
    *_ignored(
        "spmoe's front end always runs in a process of its own (--api-server-count for more)",
        "--disable-frontend-multiprocessing",
    ),
    *_ignored(
        "spmoe constrains every grammar with xgrammar; the output still follows the request's "
        "schema (vLLM 0.11 moved these into --structured-outputs-config)",
        "--guided-decoding-backend",
        "--guided-decoding-disable-fallback",
        "--guided-decoding-disable-any-whitespace",
        "--guided-decoding-disable-additional-properties",
    ),
    *_ignored(
        "vLLM before 0.10 needed it beside --reasoning-parser; spmoe splits the reasoning out "
        "whenever --reasoning-parser is given",
        "--enable-reasoning",
    ),
    *_ignored(
        "spmoe keeps the tools in the prompt whatever tool_choice says; none only means that no "
        "call is read",
        "--expand-tools-even-if-tool-choice-none",
    ),
    VllmFlag(
        ("--rope-scaling",),
        "refused",
        "--rope-scaling as a flag of its own",
        "give it as --hf-overrides '{\"rope_scaling\": {...}}', as vLLM 0.11 and later take it",
    ),
    VllmFlag(
        ("--rope-theta",),
        "refused",
        "--rope-theta as a flag of its own",
        "give it as --hf-overrides '{\"rope_theta\": ...}', as vLLM 0.11 and later take it",
    ),
    VllmFlag(
        ("--override-attention-dtype",),
        "refused",
        "a separate attention dtype",
        "spmoe computes attention in --dtype (the paged cache's is --kv-cache-dtype); leave the "
        "flag out",
    ),
    VllmFlag(
        ("--qlora-adapter-name-or-path",),
        "refused",
        "QLoRA adapters",
        "merge the adapter into the checkpoint",
    ),
    *_refused(
        "prompt adapters", "merge the adapter into the checkpoint", "--enable-prompt-adapter"
    ),
    VllmFlag(
        ("--prompt-adapters",),
        "refused",
        "prompt adapters",
        "merge the adapter into the checkpoint",
    ),
    *_ignored(
        "a prompt-adapter setting: without --enable-prompt-adapter (which spmoe refuses) it does "
        "nothing",
        "--max-prompt-adapters",
        "--max-prompt-adapter-token",
    ),
    *_ignored(
        LORA_OFF,
        "--lora-extra-vocab-size",
        "--long-lora-scaling-factors",
        "--enable-lora-bias",
    ),
    *_ignored(
        "spmoe's FP8 KV cache computes its scales as it writes (one per 128 values)",
        "--quantization-param-path",
        "--calculate-kv-scales",
    ),
    *_ignored(
        "spmoe keeps no CPU swap space; a preempted request is recomputed, with the same output",
        "--swap-space",
        "--preemption-mode",
    ),
    *_ignored(
        SAFE_TUNING,
        "--use-v2-block-manager",
        "--num-scheduler-steps",
        "--multi-step-stream-outputs",
        "--no-multi-step-stream-outputs",
        "--scheduler-delay-factor",
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
        "--disable-async-output-proc",
        "--enable-bf16x3-router-gemm",
    ),
    *_ignored(
        "spmoe captures a decode graph per batch size up to --max-num-seqs, each for every length",
        "--max-context-len-to-capture",
        "--max-seq-len-to-capture",
        "--cuda-graph-sizes",
    ),
    VllmFlag(
        ("-O",),
        "ignored",
        "vLLM's torch.compile settings before 0.12 (-O '{...}'): spmoe does not torch.compile",
    ),
    *_ignored(
        "spmoe's front end tokenizes in its own worker thread",
        "--tokenizer-pool-size",
        "--tokenizer-pool-type",
        "--tokenizer-pool-extra-config",
    ),
    *_ignored(
        "spmoe loads no logits processors named by requests",
        "--logits-processor-pattern",
    ),
    *_ignored(
        "expert load balancing moves experts, not results: spmoe places them statically, an "
        "equal share on every rank",
        "--num-redundant-experts",
        "--eplb-window-size",
        "--eplb-step-interval",
        "--eplb-log-balancedness",
    ),
    *_ignored(
        MULTIMODAL,
        "--disable-mm-preprocessor-cache",
        "--enable-multimodal-encoder-data-parallel",
    ),
    *_ignored(MAMBA, "--enable-mamba-fine-grained-prefix-cache"),
    *_ignored("AWS Neuron devices: spmoe runs on CUDA or the CPU", "--override-neuron-config"),
    *_ignored("spmoe logs no requests; the counters are in /metrics", "--no-disable-log-requests"),
    VllmFlag(("--help", "-h"), "taken", "spmoe serve's own help"),
)


def refusal(flag: VllmFlag, given: str, value: str | None) -> str:
    """The one line that refuses `flag`, as the user wrote it."""
    shown = given if value is None else f"{given} {value}"
    return f"{shown}: spmoe does not support {flag.note}; {flag.instead}"


class _FlagAction(argparse.Action):
    def __init__(self, option_strings, dest, flag: VllmFlag, **kwargs):
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    @staticmethod
    def shown(values) -> str | None:
        """The value(s) as given, one string; None for a switch or an optional value left out."""
        if isinstance(values, list):
            return " ".join(values) if values else None
        return values


class _Refuse(_FlagAction):
    """Stop with the flag's refusal (exit status 2, one line) unless spmoe accepts its value."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.shown(values)
        if self.flag.allowed is not None and self.flag.allowed(value):
            return
        parser.exit(2, f"{parser.prog}: error: {refusal(self.flag, option_string, value)}\n")


class _Ignore(_FlagAction):
    """Remember that an ignored flag was given, so that its note is logged (once) at start."""

    def __call__(self, parser, namespace, values, option_string=None):
        notes = getattr(namespace, "vllm_notes", None) or []
        note = f"{option_string}: ignored: {self.flag.note}"
        namespace.vllm_notes = notes if note in notes else [*notes, note]


class _Store(_FlagAction):
    """A vLLM name that sets one of spmoe's options (`flag.store`: its dest, and the value's
    conversion)."""

    def __call__(self, parser, namespace, values, option_string=None):
        dest, convert = self.flag.store
        try:
            setattr(namespace, dest, convert(self.shown(values)))
        except ValueError as e:
            parser.error(str(e))


class OneOfSeveral(argparse.Action):
    """A flag vLLM gives several values (`nargs="+"`) where spmoe takes one: more is an error."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="+", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) > 1:
            parser.error(
                f"{option_string}: spmoe takes one value, got {len(values)}: {' '.join(values)}"
            )
        setattr(namespace, self.dest, values[0])


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Declare on `parser` the vLLM flags that this table settles by itself: the refused ones,
    the ignored ones and the taken ones that only set an spmoe option (`store`). The parsed
    namespace gets `vllm_notes`: the notes of the ignored ones given."""
    parser.set_defaults(vllm_notes=[])
    actions = {"refused": _Refuse, "ignored": _Ignore}
    for flag in VLLM_FLAGS:
        action = _Store if flag.store is not None else actions.get(flag.verdict)
        if action is None:  # declared by the engine's or the server's options
            continue
        parser.add_argument(  # hidden from --help: docs/vllm-compatibility.md lists them
            *flag.names,
            action=action,
            flag=flag,
            nargs=ARITIES[flag.arity],
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


VERDICT_TITLES = {
    "taken": "taken",
    "noted": "taken, with a note",
    "ignored": "accepted without effect",
    "refused": "refused",
}
SECTIONS = (
    (("taken", "noted"), "Taken"),
    (("ignored",), "Accepted without effect (logged once at start, with why that is safe)"),
    (("refused",), "Refused (one line saying what to use instead; exit status 2)"),
)
PAGE_START = "<!-- the flag tables below are generated: python -m spmoe.entrypoints.vllm_flags -->"
PAGE_END = "<!-- end of the generated flag tables -->"
PAGE = Path(__file__).parents[2] / "docs" / "vllm-compatibility.md"


def markdown_table(verdicts: tuple[str, ...] = VERDICTS) -> str:
    """The table of vLLM serve flags whose verdict is one of `verdicts`, from `VLLM_FLAGS`."""
    rows = ["| vLLM flag | spmoe | what spmoe does, or what to use instead |", "|---|---|---|"]
    for flag in VLLM_FLAGS:
        if flag.verdict not in verdicts:
            continue
        names = ", ".join(f"`{name}`" for name in flag.names) + _releases(flag.names)
        if flag.verdict == "refused":
            only = " (other values)" if flag.allowed is not None else ""
            text = f"not supported{only}: {flag.note}; {flag.instead}"
        else:
            text = flag.note
        rows.append(f"| {names} | {VERDICT_TITLES[flag.verdict]} | {text.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def _releases(names: tuple[str, ...]) -> str:
    """` (vLLM 0.6.0 to 0.10.2)` for names only releases before the pinned one had, else ""."""
    if not set(names) <= set(OLDER):
        return ""
    firsts, lasts = zip(*(OLDER[name] for name in names))
    return f" (vLLM {min(firsts, key=version_key)} to {max(lasts, key=version_key)})"


def flag_tables() -> str:
    """The docs page's generated part: a table per verdict, with the count of names in each."""
    parts = [PAGE_START]
    for verdicts, title in SECTIONS:
        count = sum(len(f.names) for f in VLLM_FLAGS if f.verdict in verdicts)
        parts.append(f"\n### {title}: {count} names\n\n{markdown_table(verdicts)}")
    return "\n".join(parts) + "\n" + PAGE_END


def with_flag_tables(page: str) -> str:
    """`page` with its generated part (between PAGE_START and PAGE_END) made current."""
    head, start, rest = page.partition(PAGE_START)
    _, end, tail = rest.partition(PAGE_END)
    if not (start and end):
        raise ValueError(f"the page has no {PAGE_START!r} ... {PAGE_END!r} part")
    return head + flag_tables() + tail


JSON_OPTIONS = tuple(names[0] for names, arity in vllm_flags_0_34.options() if arity == "json")
# vLLM's shorthands for keys of --speculative-config
SPEC_SHORTHANDS = {
    "--spec-method": "method",
    "--spec-model": "model",
    "--spec-tokens": "num_speculative_tokens",
}
OPTIMIZATION_LEVELS = ("0", "1", "2", "3")
# -sc, -cc, ...: short names of JSON options, which vLLM also takes dotted (-cc.mode 3)
JSON_SHORT = {
    name: names[0]
    for names, arity in vllm_flags_0_34.options()
    if arity == "json"
    for name in names[1:]
    if not name.startswith("--")
}


def vllm_argv(argv: list[str]) -> list[str]:
    """vLLM's spellings of its flags, rewritten as `spmoe serve`'s parser reads them: `--x_y` is
    `--x-y` (the name only, not a dotted key or the value), `-O3`, `-O=3` and `-O 3` are
    `--optimization-level 3`, a JSON option's short name is its long one (`-sc.method` is
    `--speculative-config.method`), `--spec-method X` is `--speculative-config.method X` (so
    for `--spec-model` and `--spec-tokens`), a switch of BOOLEAN_VALUED followed by true or
    false (any case; or `=true`) is the switch, or its off form (`--no-X`, where vLLM has one), and
    vLLM 0.6's n-gram lookup (`--speculative-model [ngram]`, `NGRAM_FORM`) is the ngram method of
    `--speculative-config`."""
    return _ngram_form(_boolean_values(_spellings(argv)))


def _spellings(argv: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        short, sep, rest = (
            arg.partition(".") if "." in arg.partition("=")[0] else arg.partition("=")
        )
        if short in JSON_SHORT:
            arg = JSON_SHORT[short] + sep + rest
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            head, dot, path = name.partition(".")
            head = "--" + head[2:].replace("_", "-")
            if head in SPEC_SHORTHANDS and not dot:
                head, dot, path = "--speculative-config", ".", SPEC_SHORTHANDS[head]
            out.append(head + dot + path + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg.removeprefix("-O").removeprefix("=")]
        elif arg == "-O" and argv[i + 1 : i + 2] and argv[i + 1] in OPTIMIZATION_LEVELS:
            out.append("--optimization-level")
        else:
            out.append(arg)
    return out


def _boolean_values(argv: list[str]) -> list[str]:
    """`--X true` -> `--X`, `--X false` -> `--no-X` (else `--X`) for X in BOOLEAN_VALUED."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        truth = value.lower() if name in BOOLEAN_VALUED else ""
        if truth not in ("true", "false"):
            out.append(argv[i])
            i += 1
            continue
        off = "--no-" + name.removeprefix("--")
        out.append(off if truth == "false" and off in _ARITY else name)
        i += 1 if eq else 2
    return out


# vLLM before 0.8 asked for its n-gram lookup with `--speculative-model [ngram]`; these flags were
# then that lookup's keys: the flag -> the key of --speculative-config
NGRAM_FORM = {
    "--speculative-model": "method",
    "--num-speculative-tokens": "num_speculative_tokens",
    "--ngram-prompt-lookup-max": "prompt_lookup_max",
    "--ngram-prompt-lookup-min": "prompt_lookup_min",
}


def _ngram_form(argv: list[str]) -> list[str]:
    """With `--speculative-model [ngram]`, each flag of NGRAM_FORM as its dotted key of
    `--speculative-config` (`[ngram]` as the method `ngram`); any other line as it is."""
    values = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in NGRAM_FORM:
            values[i] = (name, value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    if ("--speculative-model", "[ngram]") not in values.values():
        return argv
    out, skip = [], set()
    for i, arg in enumerate(argv):
        if i in skip:
            continue
        if i not in values:
            out.append(arg)
            continue
        name, value = values[i]
        out += [f"--speculative-config.{NGRAM_FORM[name]}", value.strip("[]")]
        if "=" not in arg:
            skip.add(i + 1)
    return out


def with_config_file(argv: list[str]) -> list[str]:
    """`--config FILE.yaml` (or `--config=FILE.yaml`) replaced by the options the file holds, as
    vLLM reads it: each key `k` becomes `--k`; true is the switch, false its `--no-k` form where
    vLLM has one (else nothing), a list `--k` then its items, an object `--k` with its JSON,
    anything else `--k VALUE`. They go after the subcommand and a positional model, before the
    command line's own options, which so win."""
    at = next((i for i, arg in enumerate(argv) if arg.partition("=")[0] == "--config"), None)
    if at is None:
        return argv
    given, eq, inline = argv[at].partition("=")
    if not eq and at + 1 >= len(argv):
        raise ValueError("--config: expected a YAML file after it, got none")
    path = Path(inline if eq else argv[at + 1])
    rest = argv[:at] + argv[at + (1 if eq else 2) :]
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"--config: expected a .yaml or .yml file, got {str(path)!r}")
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"--config {path}: expected a mapping of options, got {type(config).__name__}"
        )
    options = []
    for key, value in config.items():
        if isinstance(value, bool):
            flag = f"--{key}" if value else f"--no-{key}"
            options += [flag] if value or flag in _OPTIONS else []
        elif isinstance(value, list):
            options += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            options += [f"--{key}", json.dumps(value)]
        else:
            options += [f"--{key}", str(value)]
    head = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1  # the subcommand, MODEL
    return rest[:head] + options + rest[head:]


def dotted_options(argv: list[str]) -> tuple[str, ...]:
    """vLLM's JSON options that `argv` gives in dotted form (`--compilation-config.mode 3`)."""
    names = (arg.partition("=")[0] for arg in argv if arg.startswith("--"))
    dotted = {name.partition(".")[0] for name in names if "." in name}
    return tuple(name for name in JSON_OPTIONS if name in dotted)


if __name__ == "__main__":  # rewrite the docs page's flag tables from VLLM_FLAGS
    PAGE.write_text(with_flag_tables(PAGE.read_text()))
