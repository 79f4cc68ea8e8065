"""vLLM's `serve` flags as spmoe sees them: one table that both `spmoe serve`'s parser and the README's flag
table are made from.

Each flag is
- `taken`: an spmoe option under vLLM's name, with vLLM's meaning (declared by the engine's options);
- `noted`: taken, with a difference the note states (declared by the engine's options, or, when spmoe has
  nothing to do for it, accepted here and the note logged);
- `refused`: spmoe does not do it. Giving it stops `spmoe serve` before any rank starts, with one line:
  the flag, that spmoe does not support it, and what to use instead (exit status 2). Some are refused only
  for some values (`--pipeline-parallel-size 1` is fine).
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass

MULTI_NODE = (
    "for several machines run spmoe under torchrun, one process per GPU, with TP (x DP) over all of them: "
    "torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 "
    "-m spmoe serve MODEL --tp 16 (docs/deployment.md)"
)


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # the long name first, then its short forms
    verdict: str  # "taken", "noted" or "refused"
    note: str  # taken / noted: what spmoe does with it; refused: what spmoe does not do
    instead: str = ""  # refused: what to do instead
    value: str | None = None  # the flag takes a value (its metavar); None: a switch
    allowed: Callable[[str], bool] | None = None  # refused: values that are accepted after all
    declared_here: bool = (
        False  # noted flags that spmoe has nothing to do for: this module accepts them
    )


def _is(*values: str) -> Callable[[str], bool]:
    return lambda value: value in values


VLLM_FLAGS = (
    # The model and where it comes from.
    VllmFlag(
        ("model",),
        "taken",
        "positional, as `vllm serve MODEL` (`--model` too): a folder or a Hugging Face id",
    ),
    VllmFlag(
        ("--tokenizer",),
        "taken",
        "a folder or Hugging Face id with a separate tokenizer",
        value="NAME",
    ),
    VllmFlag(("--revision",), "taken", "the Hugging Face branch, tag or commit", value="REV"),
    VllmFlag(("--download-dir",), "taken", "the Hugging Face cache folder to use", value="DIR"),
    VllmFlag(
        ("--served-model-name",),
        "taken",
        "several names: the first is reported, all are listed",
        value="NAME",
    ),
    VllmFlag(
        ("--trust-remote-code",),
        "noted",
        "accepted: spmoe runs no code from the checkpoint",
        declared_here=True,
    ),
    VllmFlag(
        ("--tokenizer-mode",),
        "refused",
        "other tokenizer modes",
        "spmoe uses the checkpoint's tokenizer and chat template through transformers; give --chat-template for "
        "another template",
        value="MODE",
        allowed=_is("auto", "hf"),
    ),
    VllmFlag(
        ("--hf-overrides",), "taken", "JSON (or dotted keys) merged into config.json", value="JSON"
    ),
    VllmFlag(
        ("--generation-config",),
        "taken",
        "auto (generation_config.json), vllm (none) or a folder",
        value="SRC",
    ),
    VllmFlag(
        ("--override-generation-config",),
        "taken",
        "JSON set over generation_config.json",
        value="JSON",
    ),
    VllmFlag(
        ("--load-format",),
        "noted",
        "auto, safetensors, or dummy (random weights from the config)",
        value="FMT",
    ),
    VllmFlag(
        ("--dtype",),
        "noted",
        "auto, bfloat16, float32 or float (no float16); auto is bfloat16 on CUDA, on the CPU the checkpoint's",
        value="DTYPE",
    ),
    VllmFlag(
        ("--quantization", "-q"),
        "noted",
        "only the method the checkpoint declares (fp8); spmoe does not quantize at load time",
        value="METHOD",
    ),
    # Parallelism.
    VllmFlag(("--tensor-parallel-size", "-tp"), "taken", "ranks per DP group (`--tp`)", value="N"),
    VllmFlag(
        ("--data-parallel-size", "-dp"),
        "taken",
        "DP groups (`--dp`); experts split over all ranks",
        value="N",
    ),
    VllmFlag(
        ("--enable-expert-parallel",),
        "noted",
        "accepted: spmoe's routed experts are always expert-parallel over all TP x DP ranks",
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        "refused",
        "pipeline parallelism",
        MULTI_NODE,
        value="N",
        allowed=_is("1"),
    ),
    VllmFlag(
        ("--distributed-executor-backend",),
        "refused",
        "the ray and external_launcher executors",
        "spmoe starts its own local ranks (mp), or runs under torchrun; " + MULTI_NODE,
        value="BACKEND",
        allowed=_is("mp"),
    ),
    *(
        VllmFlag((name,), "refused", "vLLM's multi-node data parallelism", MULTI_NODE, value="X")
        for name in (
            "--data-parallel-address",
            "--data-parallel-rpc-port",
            "--data-parallel-size-local",
            "--data-parallel-start-rank",
            "--nnodes",
            "--node-rank",
            "--master-addr",
            "--master-port",
        )
    ),
    *(
        VllmFlag((name,), "refused", "vLLM's multi-node data parallelism", MULTI_NODE)
        for name in ("--headless", "--data-parallel-hybrid-lb", "--data-parallel-external-lb")
    ),
    VllmFlag(
        ("--api-server-count",),
        "refused",
        "several API server processes",
        "spmoe runs one HTTP front end on rank 0",
        value="N",
        allowed=_is("1"),
    ),
    VllmFlag(
        ("--all2all-backend",),
        "refused",
        "vLLM's all-to-all backends",
        "spmoe's --ep-backend picks how tokens reach the experts (allgather_reducescatter or all_to_all)",
        value="BACKEND",
    ),
    VllmFlag(
        ("--enable-eplb",),
        "refused",
        "expert load balancing",
        "experts are placed statically, an equal share on every rank; leave the flag out",
    ),
    VllmFlag(
        ("--eplb-config",), "refused", "expert load balancing", "leave the flag out", value="JSON"
    ),
    VllmFlag(("--enable-dbo",), "refused", "dual-batch overlap", "leave the flag out"),
    # Memory, batching, the KV cache.
    VllmFlag(
        ("--max-model-len",),
        "taken",
        "with vLLM's suffixes: 1k = 1000, 1K = 1024, 128k; default on CUDA the model's max_position_embeddings, "
        "on the CPU at most 2048",
        value="LEN",
    ),
    VllmFlag(
        ("--max-num-seqs",),
        "taken",
        "requests decoded at once per DP group; default 256 on CUDA, 8 on the CPU",
        value="N",
    ),
    VllmFlag(
        ("--max-num-batched-tokens",),
        "taken",
        "tokens one step feeds; prompts prefill in chunks",
        value="N",
    ),
    VllmFlag(
        ("--gpu-memory-utilization",),
        "noted",
        "the share of GPU memory free after the weights",
        value="F",
    ),
    VllmFlag(
        ("--kv-cache-dtype",),
        "noted",
        "auto, fp8 or fp8_e4m3 (e4m3 with a scale per 128 values)",
        value="T",
    ),
    VllmFlag(("--block-size",), "noted", "64 only (the paged cache's block)", value="N"),
    VllmFlag(
        ("--enable-chunked-prefill",),
        "noted",
        "accepted: always on (prompts longer than --max-num-batched-tokens prefill in chunks)",
        declared_here=True,
    ),
    VllmFlag(
        ("--no-enable-chunked-prefill",),
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
        ("--swap-space",),
        "noted",
        "accepted: spmoe keeps no CPU swap space",
        value="GIB",
        declared_here=True,
    ),
    VllmFlag(
        ("--cpu-offload-gb",),
        "refused",
        "offloading weights to the CPU",
        "use more GPUs (--tp, --dp) or FP8 weights",
        value="GIB",
        allowed=_is("0"),
    ),
    # Execution.
    VllmFlag(
        ("--seed",),
        "taken",
        "seeds the sampling seeds of requests that give none (a run repeats)",
        value="N",
    ),
    VllmFlag(
        ("--enforce-eager",), "noted", "turns off the decode CUDA graphs (on by default on CUDA)"
    ),
    VllmFlag(
        ("--compilation-config", "-O"),
        "refused",
        "torch.compile and vLLM's compilation settings",
        "spmoe replays the decode step from CUDA graphs by default on CUDA; --enforce-eager turns them off",
        value="JSON",
    ),
    VllmFlag(
        ("--async-scheduling",),
        "noted",
        "accepted: rank 0 plans the next step while the front end runs",
        declared_here=True,
    ),
    VllmFlag(
        ("--attention-backend",),
        "refused",
        "choosing the attention backend",
        "spmoe runs its own sparse DSA attention over the paged cache; leave the flag out",
        value="NAME",
    ),
    VllmFlag(
        ("--speculative-config",),
        "noted",
        "MTP only (method mtp, deepseek_mtp or glm4_moe_mtp), as JSON or dotted keys; greedy and sampled requests",
        value="JSON",
    ),
    VllmFlag(
        ("--enable-lora",), "refused", "LoRA adapters", "merge the adapter into the checkpoint"
    ),
    VllmFlag(
        ("--enable-sleep-mode",),
        "refused",
        "sleep mode",
        "stop the server (SIGTERM) and start it again",
    ),
    VllmFlag(
        ("--kv-transfer-config",),
        "refused",
        "disaggregated prefill (KV transfer)",
        "run prefill and decode in one server",
        value="JSON",
    ),
    # The OpenAI front end.
    VllmFlag(("--host",), "taken", "the address to listen on (default 127.0.0.1)", value="HOST"),
    VllmFlag(("--port",), "taken", "the port (default 8000)", value="PORT"),
    VllmFlag(
        ("--chat-template",),
        "taken",
        "a Jinja file or the template itself, over the tokenizer's",
        value="T",
    ),
    VllmFlag(
        ("--chat-template-content-format",),
        "noted",
        "string or openai (content as a list of text parts); auto is string",
        value="FMT",
    ),
    VllmFlag(("--reasoning-parser",), "taken", "GLM's <think> parser", value="NAME"),
    VllmFlag(("--tool-call-parser",), "taken", "GLM's tool-call parser", value="NAME"),
    VllmFlag(("--enable-auto-tool-choice",), "taken", "tool_choice auto"),
    VllmFlag(
        ("--uvicorn-log-level",), "taken", "uvicorn's log level (default warning)", value="LEVEL"
    ),
    VllmFlag(
        ("--disable-log-requests",),
        "noted",
        "accepted: spmoe does not log requests",
        declared_here=True,
    ),
    VllmFlag(
        ("--enable-log-requests",),
        "noted",
        "accepted: spmoe does not log requests; the counters are in /metrics",
        declared_here=True,
    ),
    VllmFlag(
        ("--disable-log-stats",),
        "noted",
        "accepted: spmoe prints no periodic stats; the counters are in /metrics",
        declared_here=True,
    ),
)


def refusal(flag: VllmFlag, given: str, value: str | None) -> str:
    """The one line that refuses `flag`, as the user wrote it."""
    shown = given if value is None else f"{given} {value}"
    return f"{shown}: spmoe does not support {flag.note}; {flag.instead}"


class _Refuse(argparse.Action):
    """Stop with the flag's refusal (exit status 2, one line) unless its value is one spmoe accepts."""

    def __init__(self, option_strings, dest, flag: VllmFlag, **kwargs):
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        value = values if self.flag.value else None
        if self.flag.allowed is not None and self.flag.allowed(value):
            return
        parser.exit(2, f"{parser.prog}: error: {refusal(self.flag, option_string, value)}\n")


class _Accept(argparse.Action):
    """Remember that a flag spmoe has nothing to do for was given, so that its note can be logged."""

    def __init__(self, option_strings, dest, flag: VllmFlag, **kwargs):
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        noted = getattr(namespace, "vllm_notes", None) or []
        namespace.vllm_notes = [*noted, f"{option_string}: {self.flag.note}"]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Declare on `parser` the vLLM flags that this table settles by itself: the refused ones and the ones
    spmoe accepts without anything to do. The parsed namespace gets `vllm_notes`: the notes of those given."""
    parser.set_defaults(vllm_notes=[])
    for flag in VLLM_FLAGS:
        if flag.verdict == "refused":
            action = _Refuse
        elif flag.declared_here:
            action = _Accept
        else:
            continue
        parser.add_argument(  # hidden from --help: the README's table lists them
            *flag.names,
            action=action,
            flag=flag,
            nargs=None if flag.value else 0,
            metavar=flag.value,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


VERDICT_TITLES = {"taken": "taken as is", "noted": "taken with a note", "refused": "refused"}


def markdown_table() -> str:
    """The README's table of vLLM serve flags, from `VLLM_FLAGS`."""
    rows = ["| vLLM flag | spmoe | what spmoe does, or what to use instead |", "|---|---|---|"]
    for flag in VLLM_FLAGS:
        names = ", ".join(f"`{name}`" for name in flag.names)
        if flag.verdict == "refused":
            only = " (other values)" if flag.allowed is not None else ""
            text = f"not supported{only}: {flag.note}; {flag.instead}"
        else:
            text = flag.note
        rows.append(f"| {names} | {VERDICT_TITLES[flag.verdict]} | {text.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
