"""vLLM's launch line with `vllm` replaced by `spmoe`: one real server (TP 2, gloo, CPU) started by
the GLM-5.2 recipe line, the model given as a Hugging Face id found in a Hugging Face cache laid out
by hand (offline), with the checkpoint's generation defaults and structured output while it
speculates; and the refused flags, each one line before any rank starts."""

import json
import os
import pickle
import shlex
import signal
import subprocess
import sys
import urllib.request
from contextlib import contextmanager

import openai
import pytest
import torch

from spmoe.distributed import spawn
from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.cli import main
from spmoe.entrypoints.demo import CHECKPOINT, write_demo_tokenizer
from spmoe.entrypoints.vllm_flags import NGRAM_FORM, VLLM_FLAGS
from spmoe.models.deepseek_v32.weights import write_random_checkpoint
from tests.engine.conftest import ENGINE_CONFIG
from tests.entrypoints.serve.test_serve import wait_until_ready

REPO, REV = "zai-org/GLM-5.2", "0123456789abcdef0123456789abcdef01234567"
CONFIG = {
    **ENGINE_CONFIG,
    "vocab_size": 264,
    "max_position_embeddings": 131072,
}  # the demo tokenizer; 128k fits
GENERATION = {"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 5}
RECIPE = (
    f"{REPO} --tensor-parallel-size 2 --enable-expert-parallel "
    "--speculative-config.method mtp --speculative-config.num_speculative_tokens 1 "
    "--tool-call-parser glm47 --reasoning-parser glm45 --enable-auto-tool-choice "
    "--chat-template-content-format=string --served-model-name glm-5.2 glm --max-model-len 128k"
).split()
# what a user adds to it: accepted flags, and the room on a CPU (2 requests of 128k tokens in the
# paged cache)
EXTRA = (
    "--trust-remote-code --enable-chunked-prefill --disable-log-requests --dtype auto --block-size 64 --seed 7 "
    '--disable-custom-all-reduce --disable-fastapi-docs --allowed-origins ["*"] -O3 '
    "--max-cudagraph-capture-size 64 --structured-outputs-config.backend xgrammar"
)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF_HOME whose hub cache holds REPO at REV (refs/main), with its tokenizer and
    generation_config.json."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    spawn(write_random_checkpoint, 1, CONFIG, snapshot, 1)
    write_demo_tokenizer(snapshot)
    (snapshot / "generation_config.json").write_text(json.dumps(GENERATION))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return home


@contextmanager
def serving(argv: list[str], log, env=None):
    """`spmoe serve ARGV` on a free port, once ready -> its base URL; SIGTERM at the end."""
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spmoe", "serve", *argv, "--port", str(port)],
            stdout=err,
            stderr=err,
            env=env,
        )
    try:
        wait_until_ready(proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(hf_home, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm_line") / "stderr.txt"
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    with serving([*RECIPE, *EXTRA.split(), "--max-num-seqs", "2"], log, env) as base:
        yield base, log


def test_the_recipe_line_serves_the_model_id_from_the_cache(server, hf_home):
    base, log = server
    text = log.read_text()
    snapshot = hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REV
    for line in (
        "spmoe serve: --trust-remote-code: ignored: spmoe runs no code from the checkpoint",
        "spmoe serve: --disable-custom-all-reduce: ignored: a tuning knob of vLLM's kernels",
        "spmoe serve: --allowed-origins: ignored: spmoe sends no CORS headers",
        "spmoe serve: --optimization-level: ignored: spmoe does not torch.compile",
        "spmoe serve: --structured-outputs-config: ignored: spmoe constrains every grammar with xgrammar",
        "spmoe serve: --enable-expert-parallel: spmoe's routed experts are always expert-parallel over all ranks",
        f"spmoe serve: generation defaults from {snapshot / 'generation_config.json'}: temperature=0.7, top_p=0.8, "
        "max_tokens=5",
        f"spmoe serve: {snapshot} on 2 local ranks (tp=2, dp=1, sequence-parallel MoE off (--sp auto, scope moe), "
        "MTP with 1 drafts, float32 on cpu",
        # --max-num-seqs 2 and --max-model-len 128k given; the CPU's waiting default, at least 64
        "spmoe serve: max_num_seqs 2 per DP group, max_model_len 128000, max_num_waiting 64 (on cpu, the defaults "
        "where no flag gives them)",
    ):
        assert line in text, text
    assert "device cpu: no GPU is visible" in text or "device cuda: a GPU is visible" in text
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list().data
    assert [(m.id, m.model_extra["max_model_len"]) for m in models] == [
        ("glm-5.2", 128000),
        ("glm", 128000),
    ]
    chat = client.chat.completions.create(
        model="glm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "glm-5.2" and chat.usage.completion_tokens <= 4


def test_generation_defaults_apply_to_what_a_request_leaves_out(server):
    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    left_out = client.completions.create(
        model="glm-5.2", prompt="Hello", seed=5, extra_body={"ignore_eos": True}
    )
    assert left_out.usage.completion_tokens == GENERATION["max_new_tokens"]
    own = client.completions.create(
        model="glm-5.2", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert own.usage.completion_tokens == 3
    # the model's default temperature applies with speculation too: sampled, so the seed decides the
    # text
    again = client.completions.create(
        model="glm-5.2", prompt="Hello", seed=5, extra_body={"ignore_eos": True}
    )
    other = client.completions.create(
        model="glm-5.2", prompt="Hello", seed=6, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == left_out.choices[0].text != other.choices[0].text


def test_structured_output_on_the_speculating_server(server):
    """The recipe line speculates (MTP, 1 draft): a response_format request is answered with JSON
    valid under its schema, sampled (the model's default temperature) and greedy; a choice with a
    stop string stops at it."""
    import jsonschema

    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    drafted_before = spec_counter(base, "vllm:spec_decode_num_draft_tokens")
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "maximum": 99},
        },
        "required": ["color", "size"],
    }
    for temperature in (None, 0):
        reply = client.chat.completions.create(
            model="glm",
            messages=[{"role": "user", "content": "A color and a size, as JSON"}],
            max_tokens=64,
            seed=3,
            temperature=temperature,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": schema},
            },
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        ).choices[0]
        assert reply.finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.message.content), schema)
    # a stop string cuts the constrained text there, whatever else the step committed with it
    # (accepted drafts)
    choices = ["red fox", "blue jay", "green owl"]
    for seed in range(4):
        reply = client.completions.create(
            model="glm",
            prompt="A bird:",
            max_tokens=32,
            seed=seed,
            stop=[" "],
            extra_body={"structured_outputs": {"choice": choices}},
        ).choices[0]
        assert reply.finish_reason == "stop" and reply.text in ("red", "blue", "green"), reply
    # the constrained requests were speculated: every step of theirs drafted a token (6 requests, >=
    # 1 step each)
    assert spec_counter(base, "vllm:spec_decode_num_draft_tokens") - drafted_before >= 6


def spec_counter(base: str, name: str) -> float:
    """The server's counter `name` (summed over its labels) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name + "_total"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["-pp", "2"],
            "-pp 2: spmoe does not support pipeline parallelism; for several machines run spmoe under ",
        ),
        (
            ["--distributed-executor-backend", "ray"],
            "--distributed-executor-backend ray: spmoe does not support the",
        ),
        (
            ["--data-parallel-address", "10.0.0.2"],
            "--data-parallel-address 10.0.0.2: spmoe does not support vLLM's",
        ),
        (
            ["--enable-lora"],
            "--enable-lora: spmoe does not support LoRA adapters; merge the adapter",
        ),
        (
            ["--kv-transfer-config.kv_connector", "NixlConnector"],
            '--kv-transfer-config {"kv_connector": "NixlConnector"}: spmoe does not support',
        ),
        (
            ["--speculative-config", '{"method": "eagle3"}'],
            "argument --speculative-config: method 'eagle3' is not",
        ),
        (
            ["--speculative-config.draft_model", "x"],
            "argument --speculative-config: spmoe does not support the key",
        ),
        (
            ["--max-model-len", "1.5K"],
            "argument --max-model-len: a fraction needs a decimal suffix (k, m, g)",
        ),
        (
            ["--kv-cache-dtype", "fp8_e5m2"],
            "argument --kv-cache-dtype: expected one of auto, fp8, fp8_e4m3",
        ),
        (
            ["--dtype", "float16"],
            "argument --dtype: spmoe does not compute in float16 (float16): the DeepSeek-V3",
        ),
        (["--dtype", "half"], "argument --dtype: spmoe does not compute in float16 (half)"),
        (["--device", "tpu"], "argument --device: spmoe runs on cuda or cpu, not tpu"),
        (["--worker-use-ray"], "--worker-use-ray: spmoe does not support vLLM's ray workers"),
        (["--task", "embed"], "--task embed: spmoe does not support other tasks"),
        (
            ["--rope-scaling", '{"rope_type": "yarn", "factor": 4}'],
            '--rope-scaling {"rope_type": "yarn", "factor": 4}: spmoe does not support',
        ),
        (
            ["--enable-chunked-prefill", "False"],
            "--no-enable-chunked-prefill: spmoe does not support turning chunked prefill off",
        ),
        (
            ["--reasoning-parser", "deepseek_r1"],
            "argument --reasoning-parser: expected one of glm45, got 'deepseek_r1'",
        ),
    ],
)
def test_a_refused_flag_stops_before_any_rank_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", REPO, "--tp", "2", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spmoe serve: error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["org/absent"], "MODEL org/absent: no such folder, and the Hugging Face cache"),
        (
            [REPO, "--quantization", "awq"],
            "--quantization awq: spmoe does not quantize at load time and the checkpoint",
        ),
        (
            [REPO, "--speculative-model", "org/small-draft", "--num-speculative-tokens", "3"],
            "--speculative-model org/small-draft: spmoe does not support a separate draft model",
        ),
        (
            [REPO, "--cuda-graphs", "--enforce-eager"],
            "--cuda-graphs and --enforce-eager contradict each other",
        ),
    ],
)
def test_bad_values_are_one_line_errors_before_any_rank(
    argv, message, hf_home, monkeypatch, capsys
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["serve", *argv, "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"spmoe serve: error: {message}") and err.count("\n") == 1, err


# launch lines as users of older vLLM releases wrote them (`vllm serve` or the OpenAI server module,
# with `vllm` replaced by `spmoe`): each runs here, on this CPU, with the notes it should print
OLDER_LINES = {
    "0.6 OpenAI server": (
        f"--model {REPO} --tensor-parallel-size 2 --swap-space 16 --disable-log-requests "
        "--gpu-memory-utilization 0.9 --max-model-len 8192 --enable-chunked-prefill "
        "--use-v2-block-manager --dtype auto --trust-remote-code --max-num-batched-tokens 8192 "
        "--num-scheduler-steps 8 --max-seq-len-to-capture 8192 --guided-decoding-backend outlines "
        "--block-size 16 --tokenizer-mode auto --distributed-executor-backend mp "
        "--preemption-mode recompute --tokenizer-pool-size 0"
    ),
    "0.7 DeepSeek MTP": (
        f"{REPO} -tp 2 --trust-remote-code --num-speculative-tokens 1 --enable-chunked-prefill True "
        "--max-model-len 32768 --gpu-memory-utilization 0.95 --enable-prefix-caching "
        "--disable-async-output-proc --speculative-disable-mqa-scorer --max-num-seqs 4"
    ),
    "0.7 draft model = the served model": (
        f"{REPO} --tp 2 --speculative-model {REPO} --num-speculative-tokens 2 "
        "--spec-decoding-acceptance-method rejection_sampler --ngram-prompt-lookup-max 4"
    ),
    "0.6 n-gram lookup": (
        f"{REPO} -tp 2 --speculative-model [ngram] --num-speculative-tokens 5 "
        "--ngram-prompt-lookup-max 4 --ngram-prompt-lookup-min=2 --use-v2-block-manager"
    ),
    "0.9 reasoning": (
        f"{REPO} -tp 2 --enable-reasoning --reasoning-parser glm45 --tool-call-parser glm45 "
        "--enable-auto-tool-choice --guided-decoding-backend xgrammar "
        "--guided-decoding-disable-any-whitespace --cuda-graph-sizes 1 2 4 "
        "--max-num-partial-prefills 2 --disable-mm-preprocessor-cache --calculate-kv-scales "
        "--override-neuron-config {}"
    ),
    "0.10 GLM-4.5": (
        f"{REPO} --tensor-parallel-size 2 --tool-call-parser glm45 --reasoning-parser glm45 "
        "--enable-auto-tool-choice --served-model-name glm-4.5 --task generate "
        "--disable-log-requests --no-disable-log-requests --enable-expert-parallel "
        "--num-lookahead-slots 0 --max-num-seqs 2"
    ),
}


@pytest.mark.parametrize("line", OLDER_LINES.values(), ids=OLDER_LINES.keys())
def test_older_vllm_launch_lines_reach_a_running_config(line, hf_home, monkeypatch, capsys):
    """`spmoe serve` reads the line, settles the options for this CPU and checks them against the
    checkpoint, up to starting the ranks (stood in for here): every flag known, each ignored one
    noted once, nothing in argparse's words."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    monkeypatch.setattr(
        "spmoe.entrypoints.serve.server.launch", lambda *args, **kwargs: started.append(args)
    )
    argv = ["serve", *shlex.split(line), "--port", str(free_port())]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert not any(w in err for w in ("unrecognized", "invalid choice", "error")), err
    ((_, world, _, engine_args, _, front, *_),) = started
    assert (world, engine_args.tp, engine_args.device, engine_args.block_size) == (
        2,
        2,
        "cpu",
        None,
    )
    given = {arg.partition("=")[0] for arg in shlex.split(line)}
    taken = set(NGRAM_FORM) if "[ngram]" in given else set()  # vLLM 0.6's lookup: its keys
    for flag in VLLM_FLAGS:
        for name in given & set(flag.names) - taken:
            if flag.verdict == "ignored":
                assert err.count(f"spmoe serve: {name}: ignored: {flag.note}\n") == 1, (name, err)
    if "--block-size" in given:
        assert "spmoe serve: --block-size 16: spmoe's paged cache has blocks of 64 tokens" in err
    if "--gpu-memory-utilization" in given:
        assert engine_args.gpu_memory_utilization is None
        assert "--gpu-memory-utilization 0.9" in err or "--gpu-memory-utilization 0.95" in err
        assert "ignored on cpu (a share of GPU memory)" in err
    tokens = shlex.split(line)
    if "[ngram]" in tokens:  # vLLM 0.6's n-gram lookup
        lookup = engine_args.speculation.lookup
        assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (2, 4)
        assert engine_args.drafts == 5 and "ngram with 5 drafts" in err, err
    elif "--num-speculative-tokens" in tokens:  # vLLM 0.7's MTP form
        drafts = int(tokens[tokens.index("--num-speculative-tokens") + 1])
        assert engine_args.drafts == drafts and f"MTP with {drafts} drafts" in err
    else:
        assert engine_args.drafts == 0
    (options,) = pickle.loads(front.args)  # the front end's options
    assert options.served_model_names[0] in (REPO, "glm-4.5")


# a vLLM 0.6 / 0.7 launch line on the shipped demo checkpoint, thinking off server-wide
OLDER_DEMO_LINE = (
    "--gpu-memory-utilization 0.9 --block-size 16 --kv-cache-dtype fp8 --swap-space 4 "
    "--use-v2-block-manager --disable-log-requests --guided-decoding-backend outlines "
    "--enable-reasoning --reasoning-parser glm45 --enable-chunked-prefill True "
    "--num-speculative-tokens 1 --max-model-len 1024 --max-num-seqs 2 --dtype auto "
    "--trust-remote-code --max-seq-len-to-capture 8192 "
    "--default-chat-template-kwargs.enable_thinking false"
)


@pytest.fixture(scope="module")
def older_demo_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("older_line") / "stderr.txt"
    argv = ["--model", str(CHECKPOINT), *shlex.split(OLDER_DEMO_LINE), "--device", "cpu"]
    with serving(argv, log) as base:
        yield base, log


def test_an_older_launch_line_serves_the_demo(older_demo_server):
    """The line's flags noted at start (what cannot matter on this CPU among them), the FP8 cache
    and its capacity in the log, MTP from --num-speculative-tokens alone; thinking off for every
    request from --default-chat-template-kwargs, back on for a request that asks; /ping answers."""
    base, log = older_demo_server
    text = log.read_text()
    for line in (
        "spmoe serve: --swap-space: ignored: spmoe keeps no CPU swap space",
        "spmoe serve: --guided-decoding-backend: ignored: spmoe constrains every grammar",
        "spmoe serve: --enable-reasoning: ignored: vLLM before 0.10 needed it",
        "spmoe serve: --enable-chunked-prefill: ignored: always on in spmoe",
        "spmoe serve: --block-size 16: spmoe's paged cache has blocks of 64 tokens only (vLLM uses "
        "64 for MLA's paged cache too); 64 used",
        "spmoe serve: --gpu-memory-utilization 0.9: ignored on cpu (a share of GPU memory)",
        "MTP with 1 drafts",
        "spmoe serve: paged KV cache FP8 (fp8_e4m3: the latent and indexer keys in e4m3",
    ):
        assert line in text, (line, text)
    cache_line = next(x for x in text.splitlines() if "paged KV cache FP8" in x)
    assert " blocks of 64 tokens = " in cache_line and " sequences of 1024 tokens" in cache_line
    with urllib.request.urlopen(base + "/ping", timeout=30) as reply:
        assert reply.status == 200
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a color."}]
    off = client.chat.completions.create(
        model=str(CHECKPOINT), messages=messages, max_tokens=8, temperature=0
    ).choices[0]
    assert off.message.content and getattr(off.message, "reasoning_content", None) is None, off
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    on = client.chat.completions.create(
        model=str(CHECKPOINT),
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body=thinking,
    ).choices[0]
    assert on.message.model_extra.get("reasoning_content"), on  # the answer starts thinking
