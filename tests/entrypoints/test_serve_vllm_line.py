"""vLLM's launch line with `vllm` replaced by `spmoe`: one real server (TP 2, gloo, CPU) started by the GLM-5.2
recipe line, the model given as a Hugging Face id found in a Hugging Face cache laid out by hand (offline),
with the checkpoint's generation defaults and structured output while it speculates; and the refused flags, each
one line before any rank starts."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from spmoe.distributed import spawn
from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.cli import main
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.models.deepseek_v32.weights import write_random_checkpoint
from tests.engine.conftest import ENGINE_CONFIG

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
# what a user adds to it: accepted flags, and the room on a CPU (2 requests of 128k tokens in the paged cache)
EXTRA = (
    "--trust-remote-code --enable-chunked-prefill --disable-log-requests --dtype auto --block-size 64 --seed 7 "
    '--disable-custom-all-reduce --disable-fastapi-docs --allowed-origins ["*"] -O3 '
    "--max-cudagraph-capture-size 64 --structured-outputs-config.backend xgrammar"
)
START_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF_HOME whose hub cache holds REPO at REV (refs/main), with its tokenizer and generation_config.json."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    spawn(write_random_checkpoint, 1, CONFIG, snapshot, 1)
    write_demo_tokenizer(snapshot)
    (snapshot / "generation_config.json").write_text(json.dumps(GENERATION))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return home


@pytest.fixture(scope="module")
def server(hf_home, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_line") / "stderr.txt"
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    command = [
        "spmoe",
        "serve",
        *RECIPE,
        *EXTRA.split(),
        "--max-num-seqs",
        "2",
        "--port",
        str(port),
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", *command], stdout=err, stderr=err, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "ready: http://" not in log.read_text():
        assert proc.poll() is None, f"spmoe serve exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, (
            f"spmoe serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()}"
        )
        time.sleep(0.2)
    yield f"http://127.0.0.1:{port}", log
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    # the model's default temperature applies with speculation too: sampled, so the seed decides the text
    again = client.completions.create(
        model="glm-5.2", prompt="Hello", seed=5, extra_body={"ignore_eos": True}
    )
    other = client.completions.create(
        model="glm-5.2", prompt="Hello", seed=6, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == left_out.choices[0].text != other.choices[0].text


def test_structured_output_on_the_speculating_server(server):
    """The recipe line speculates (MTP, 1 draft): a response_format request is answered with JSON valid under its
    schema, sampled (the model's default temperature) and greedy; a choice with a stop string stops at it."""
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
    # a stop string cuts the constrained text there, whatever else the step committed with it (accepted drafts)
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
    # the constrained requests were speculated: every step of theirs drafted a token (6 requests, >= 1 step each)
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
            [REPO, "--block-size", "16"],
            "--block-size 16: spmoe's paged cache has blocks of 64 tokens only",
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
