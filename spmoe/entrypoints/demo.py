"""`spmoe demo`: generate with a tiny GLM-5.2-shaped model on 2 local ranks, with sequence-parallel
MoE off and on (and with MTP speculation), and show that every mode produces the same tokens; then
start `spmoe serve` on the same checkpoint, send it one chat request and stop it.

The checkpoint ships with spmoe (`CHECKPOINT`): a model in the GLM-5.2 layout (MLA + DSA indexer
with IndexShare, a dense layer then MoE layers with a shared expert, one MTP layer) trained on the
Python standard library's source by `benchmarks/train_checkpoint.py`, with a byte-level tokenizer
and a GLM chat template.
"""

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state, launch
from spmoe.distributed.launcher import free_port
from spmoe.engine.args import EngineArgs
from spmoe.entrypoints.generate import GenerateOptions, check_generate, rank_generate

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "glm-stdlib-tiny"
HELDOUT = CHECKPOINT.parent / "heldout_stdlib.txt"  # held-out evaluation text of its corpus
CONFIG = json.loads((CHECKPOINT / "config.json").read_text())
TEXT_PROMPTS = [
    "import os\n\n\ndef ",
    "class Reader:\n    def __init__(self",
    "    for key in ",
    "#",
]
PROMPTS = [list(text.encode()) for text in TEXT_PROMPTS]  # the tokenizer: byte b is token b
MAX_NEW_TOKENS = 16
TP = 2
MODES = [  # (label, --sp, scope, MTP drafts)
    ("SP off", "off", "moe", 0),
    ("SP on", "on", "moe", 0),
    ("SP on, scope all", "on", "all", 0),
    ("SP off + MTP k=2", "off", "moe", 2),
    ("SP on + MTP k=2", "on", "moe", 2),
]


CHAT = [{"role": "user", "content": "import os"}]  # the model knows Python source, not chat
SERVE_MAX_TOKENS = 24
SPECIAL_TOKENS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"] + [
    f"<|reserved_{i}|>" for i in range(3)
]
# GLM's chat layout, in short: turns open with <|role|> and end with <|end|>; tools are listed in a
# system turn; the assistant turn opens its thinking block in the prompt (<think>), or closes it
# there when thinking is off (chat_template_kwargs enable_thinking / thinking); its tool calls are
# written as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call> (a string
# value raw, any other as JSON; the server hands the template each call's arguments as an object);
# tool results come back in an <|observation|> turn.
CHAT_TEMPLATE = (
    "{% set thinking = enable_thinking if enable_thinking is defined else (thinking if thinking is "
    "defined else true) %}{% if tools %}<|system|>You may call these functions:\n<tools>\n{% for "
    "tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}\n{% "
    "endfor %}</tools>\nTo call one, write "
    "<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>, a string value "
    "as it is, any other value as JSON.<|end|>{% endif %}{% for m in messages %}{% if m.role == "
    "'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response><|end|>{% elif m.role "
    "== 'assistant' %}<|assistant|>{% if m.reasoning_content %}<think>{{ m.reasoning_content "
    "}}</think>{% else %}</think>{% endif %}{{ m.content or '' }}{% for call in m.tool_calls or [] "
    "%}<tool_call>{{ call.function.name }}{% for key, value in call.function.arguments.items() "
    "%}<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string else value | tojson "
    "}}</arg_value>{% endfor %}</tool_call>{% endfor %}<|end|>{% else %}<|{{ m.role }}|>{{ "
    "m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ "
    "'<think>' if thinking else '</think>' }}{% endif %}"
)


def write_demo_tokenizer(folder: Path, model_max_length: int = 4096) -> None:
    """A byte-level tokenizer: token b < 256 is byte b (so any text encodes and a character may span
    several tokens), then SPECIAL_TOKENS from id 256; `<|end|>` ends a chat turn and is the eos
    token. The thinking and tool-call tags are plain text (bytes). Written with the `tokenizers`
    library as `tokenizer.json` + `tokenizer_config.json` (with the chat template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    # byte-level BPE's convention: unprintable bytes map to chr(256 + k)
    others = iter(range(256, 512))
    byte_chars = [chr(b) if b in printable else chr(next(others)) for b in range(256)]
    tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_chars)}, merges=[]))
    # text split into words as GPT-2's byte-level tokenizers split it: the same tokens (every byte
    # is one), but the BPE model caches each piece it encodes (up to 10,000), a word and not a
    # whole prompt
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|end|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": model_max_length,
            },
            indent=2,
        )
    )


def _rank_demo(folder: str, dp: int, device: str) -> dict | None:
    """Every mode, one after the other, on the ranks of one launch -> {label: Generation}
    on rank 0."""
    runs = {}
    for label, opts in _modes(dp, device):
        runs[label] = rank_generate(folder, PROMPTS, opts)
        if get_parallel_state().rank == 0:
            print(f"  {label:<18} generated in {runs[label].stats['seconds']:.1f} s", flush=True)
    return runs if get_parallel_state().rank == 0 else None


def _modes(dp: int, device: str) -> list[tuple[str, GenerateOptions]]:
    return [
        (
            label,
            GenerateOptions(
                MAX_NEW_TOKENS,
                record_logits=True,
                progress=False,
                engine=EngineArgs(
                    tp=TP,
                    dp=dp,
                    sp=sp,
                    sp_scope=scope,
                    device=device,
                    speculative="mtp" if drafts else None,
                    num_speculative_tokens=drafts or None,
                ),
            ),
        )
        for label, sp, scope, drafts in MODES
    ]


def run_demo(device: str = "cpu", dp: int = 1) -> int:
    folder = CHECKPOINT
    cfg = ModelConfig.from_file(folder)
    for _, opts in _modes(dp, device):
        check_generate(cfg, PROMPTS, opts)
    print(
        "spmoe demo: tiny GLM-5.2-shaped model trained on Python's standard library: "
        f"{cfg.num_hidden_layers} layers (1 dense + {cfg.num_hidden_layers - 1} MoE, "
        f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok} + 1 shared), MLA + DSA "
        f"indexer (top-{cfg.index_topk}), 1 MTP layer, byte tokens"
    )
    print(f"checkpoint: {folder}")
    print(
        f"generating {MAX_NEW_TOKENS} tokens after {len(PROMPTS)} prompts of "
        f"{[len(p) for p in PROMPTS]} tokens on {TP * dp} local ranks (TP {TP} x DP {dp}, "
        f"{'gloo, CPU' if device == 'cpu' else 'NCCL, CUDA'}), greedy, float32",
        flush=True,
    )
    runs = launch(
        _rank_demo,
        TP * dp,
        str(folder),
        dp,
        device,
        config=ParallelConfig(tensor_parallel_size=TP, data_parallel_size=dp),
        device=device,
    )
    if runs is None:  # a torchrun rank other than 0
        return 0
    reference = runs[MODES[0][0]]
    print(
        f"\n{'':<29}{'collectives per decode forward, count/KiB'}\n"
        f"{'mode':<18}{'tokens/s':>9}  {'all_reduce':>12}{'all_gather':>14}{'reduce_scatter':>16}"
        f"{'max|dlogit|':>13}{'MTP accept':>12}  tokens"
    )
    identical = True
    for label, gen in runs.items():
        decode = gen.stats["phases"]["decode"]
        cells = "".join(
            f"{c['count'] / decode['forwards']:>{w - 7}.0f}/"
            f"{c['bytes'] / decode['forwards'] / 1024:<6.1f}"
            for c, w in zip(
                (decode["collectives"][k] for k in ("all_reduce", "all_gather", "reduce_scatter")),
                (12, 14, 16),
            )
        )
        diff = max((a - b).abs().max().item() for a, b in zip(gen.logits, reference.logits))
        same = gen.outputs == reference.outputs
        identical &= same
        spec = gen.stats.get("speculative")
        accept = f"{spec['acceptance_rate']:.0%}" if spec else "-"
        print(
            f"{label:<18}{gen.stats['tokens_per_s']:>9.1f}  {cells}{diff:>13.1e}{accept:>12}  "
            f"{'identical' if same else 'DIFFERENT'}"
        )
    print(
        f"\nA decode forward runs {CONFIG['num_hidden_layers']} decoder layers, the embedding and "
        "the LM head; with MTP it verifies\n1 + 2 tokens per sequence. max|dlogit|: against SP "
        "off. Tokens (SP off):"
    )
    for prompt, out in zip(TEXT_PROMPTS, reference.outputs):
        print(f"  {json.dumps(prompt)} -> {json.dumps(bytes(out).decode(errors='replace'))}")
    if not identical:
        print("error: the modes produced different tokens", file=sys.stderr)
        return 1
    print(f"all {len(MODES)} modes produced identical tokens")
    return show_server(device, dp)


def show_server(device: str, dp: int) -> int:
    """Start `spmoe serve` on the demo checkpoint, send it one chat request, print the reply, stop
    it with SIGTERM."""
    port = free_port()
    command = [
        "spmoe",
        "serve",
        "--tp",
        str(TP),
        "--dp",
        str(dp),
        "--device",
        device,
        "--port",
        str(port),
    ]
    print(f"\nThe server: {' '.join(command)}", flush=True)
    server = subprocess.Popen(
        [sys.executable, "-m", *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    # a SIGTERM to the demo unwinds through the `finally` below, which stops the server and its
    # ranks
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        ready = _echo_until_ready(server)
        if ready is None:
            print(
                f"error: spmoe serve did not come up (exit code {server.poll()})", file=sys.stderr
            )
            return 1
        # later lines
        threading.Thread(target=_echo_until_ready, args=(server,), daemon=True).start()
        body = {
            "model": "spmoe-demo",
            "messages": CHAT,
            "max_tokens": SERVE_MAX_TOKENS,
            "temperature": 0,
        }
        print(f"POST {ready}/chat/completions {json.dumps(body)}", flush=True)
        began = time.perf_counter()
        request = urllib.request.Request(
            f"{ready}/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.load(response)
        choice, usage = reply["choices"][0], reply["usage"]
        print(
            f"reply ({time.perf_counter() - began:.1f} s; a model of Python source, so Python-like "
            f"text): {json.dumps(choice['message']['content'], ensure_ascii=False)}\nusage: "
            f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens, "
            f"finish_reason {choice['finish_reason']}",
            flush=True,
        )
    finally:
        stopped, how = _stop(server)
        signal.signal(signal.SIGTERM, previous)
    print(f"SIGTERM: {how}", file=sys.stdout if stopped else sys.stderr)
    return 0 if stopped else 1


def _stop(server: subprocess.Popen, grace_s: float = 30.0) -> tuple[bool, str]:
    """SIGTERM, then SIGKILL after `grace_s`. -> (whether SIGTERM stopped it, what happened)."""
    began = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return False, f"error: the server did not stop within {grace_s:.0f} s; killed"
    return True, f"the server stopped in {time.perf_counter() - began:.1f} s (exit code {code})"


def _echo_until_ready(server: subprocess.Popen) -> str | None:
    """Print the server's stderr lines (a progress line: its last state) until it says it is ready.
    -> its base URL; None if it ended first."""
    for raw in server.stderr:
        line = raw.decode(errors="replace").rstrip().rsplit("\r", 1)[-1]
        print(f"  | {line}", flush=True)
        if "ready: " in line:
            return line.split("ready: ", 1)[1].split()[0]
    return None
