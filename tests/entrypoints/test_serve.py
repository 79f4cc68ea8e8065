"""`spmoe serve` end to end: one real server (TP 2, gloo, CPU) on a tiny checkpoint with the demo tokenizer,
driven by the real `openai` client; its greedy text against `spmoe generate`'s tokens; concurrent streams;
bad requests; SIGTERM; and the one-line errors for bad options before any rank starts."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from spmoe.distributed import spawn
from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.cli import main
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.entrypoints.serve.tokenizer import chat_prompt_ids, load_tokenizer
from spmoe.models.deepseek_v32.weights import write_random_checkpoint
from tests.engine.conftest import ENGINE_CONFIG

SERVE_CONFIG = {**ENGINE_CONFIG, "vocab_size": 264}  # the demo tokenizer: 256 bytes + 8 special tokens
MAX_MODEL_LEN = 96
START_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serve_ckpt")
    spawn(write_random_checkpoint, 1, SERVE_CONFIG, folder, 1)
    write_demo_tokenizer(folder)
    return folder


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """-> (process, base URL, log path) of `spmoe serve` on a free port; stopped at the end if a test has not."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve_log") / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spmoe",
                "serve",
                "--model",
                str(checkpoint),
                "--tp",
                "2",
                "--served-model-name",
                "tiny",
                "--port",
                str(port),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--max-num-seqs",
                "8",
            ],
            stdout=err,
            stderr=err,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while "ready: http://" not in log.read_text():
        assert proc.poll() is None, f"spmoe serve exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"spmoe serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.2)
    yield proc, f"http://127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate_tokens(tmp_path, checkpoint, prompts: list[list[int]], max_new_tokens: int, eos_id: int):
    ids, out = tmp_path / "ids.json", tmp_path / "out.json"
    ids.write_text(json.dumps(prompts))
    assert (
        main(
            [
                "generate",
                "--model",
                str(checkpoint),
                "--tp",
                "2",
                "--sp",
                "auto",
                "--input-ids",
                str(ids),
                "--max-new-tokens",
                str(max_new_tokens),
                "--eos-id",
                str(eos_id),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())["outputs"]


def test_greedy_text_equals_spmoe_generate(server, checkpoint, tmp_path):
    _, base, log = server
    assert "ready: http://" in log.read_text() and "loading" in log.read_text()
    tokenizer = load_tokenizer(checkpoint)
    client = openai_client(base)
    assert [m.id for m in client.models.list()] == ["tiny"]
    prompt, messages, max_new = "The café in Zürich", [{"role": "user", "content": "Hello there"}], 12
    prompts = [tokenizer.encode(prompt), chat_prompt_ids(tokenizer, messages)]
    expected = [
        tokenizer.decode(out, skip_special_tokens=True)
        for out in generate_tokens(tmp_path, checkpoint, prompts, max_new, tokenizer.eos_token_id)
    ]

    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_new, temperature=0)
    assert whole.choices[0].text == expected[0]
    assert whole.usage.prompt_tokens == len(prompts[0]) and 1 <= whole.usage.completion_tokens <= max_new
    streamed = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_new,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[0]
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens

    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_new, temperature=0)
    assert chat.choices[0].message.content == expected[1]
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens == len(prompts[1])
    streamed = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_new, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected[1]
    assert streamed[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_concurrent_streams_match_their_text_alone(server):
    _, base, _ = server
    client = openai_client(base)

    def stream(i: int) -> str:
        chunks = client.completions.create(
            model="tiny", prompt=f"request {i}:", max_tokens=6 + i % 4, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    alone = [stream(i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(stream, range(16)))
    assert together == alone
    metrics = httpx.get(base + "/metrics").text
    assert "spmoe_time_to_first_token_seconds_count" in metrics and "spmoe_num_requests_running 0.0" in metrics


def generated_tokens(base: str) -> float:
    metrics = httpx.get(base + "/metrics").text.splitlines()
    return float(next(line for line in metrics if line.startswith("spmoe_generation_tokens_total")).split()[1])


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_request(server, stream):
    _, base, _ = server
    before, max_tokens = generated_tokens(base), MAX_MODEL_LEN - 4
    body = {"model": "tiny", "prompt": "abc", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
            for events, _ in enumerate(response.iter_lines()):
                if events == 4:
                    break  # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while "spmoe_num_requests_running 0.0" not in httpx.get(base + "/metrics").text:
        assert time.monotonic() < deadline, "the request still runs 10 s after its client went away"
        time.sleep(0.1)
    assert generated_tokens(base) - before < max_tokens


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", "{oops", 400),
        ("/v1/completions", {"prompt": "hi"}, 400),
        ("/v1/chat/completions", {"model": "tiny"}, 400),
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * MAX_MODEL_LEN}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.01}, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400),
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, path, body, status):
    _, base, _ = server
    response = httpx.post(
        base + path,
        content=body if isinstance(body, str) else json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    assert httpx.get(base + "/health").status_code == 200


def test_sigterm_stops_every_rank(server):
    proc, base, log = server
    ranks = descendants(proc.pid)
    assert len(ranks) >= 2, ranks  # at least the two ranks

    def in_flight():  # a request under way when the signal comes
        try:
            httpx.post(
                base + "/v1/completions",
                json={"model": "tiny", "prompt": "a long one", "max_tokens": 80, "stream": True, "ignore_eos": True},
                timeout=60,
            )
        except httpx.TransportError:  # the stop cut its stream
            pass

    holder = threading.Thread(target=in_flight)
    holder.start()
    time.sleep(1.0)
    sigterm_leaves_nothing(proc, ranks, log)
    holder.join(timeout=30)


def sigterm_leaves_nothing(proc: subprocess.Popen, pids: list[int], log) -> float:
    """SIGTERM to `proc`; assert that it and every process in `pids` are gone within 30 s. -> the seconds taken."""
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    while any(alive(pid) for pid in pids) and time.monotonic() - began < 30:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], f"left behind after SIGTERM:\n{log.read_text()}"
    return time.monotonic() - began


def test_sigterm_under_torchrun_leaves_no_rank(checkpoint, tmp_path):
    """Under torchrun the agent sends SIGTERM to every worker: rank 0 stops its front end, the other rank
    (blocked in the control plane's broadcast) ends on the signal, and no process of the run is left, well
    before the agent's SIGKILL 30 s later. Rank 0 prints one line, no traceback."""
    port, log = free_port(), tmp_path / "torchrun.txt"
    with open(log, "w") as out:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "spmoe",
                "serve",
                "--model",
                str(checkpoint),
                "--tp",
                "2",
                "--port",
                str(port),
                "--max-model-len",
                str(MAX_MODEL_LEN),
            ],
            stdout=out,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready: http://" not in log.read_text():
            assert agent.poll() is None, f"torchrun exited with {agent.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready after {START_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.2)
        workers = descendants(agent.pid)
        assert len(workers) >= 2, workers
        assert (
            httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=60,
                json={"model": str(checkpoint), "prompt": "hi", "max_tokens": 2},
            ).status_code
            == 200
        )
        seconds = sigterm_leaves_nothing(agent, workers, log)
        assert seconds < 20, "the workers outlived SIGTERM until torchrun's SIGKILL (30 s)"
        # rank 0 says why it stopped, and the other rank's end (by the same signal) is no error of its own
        text = log.read_text()
        assert "spmoe serve: stopped by SIGTERM" in text and "[rank0]: Traceback" not in text, text
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("no such folder", "no such folder (and not a Hugging Face model id, which is ORG/NAME)"),
        ("no tokenizer", "has no tokenizer: expected tokenizer.json or tokenizer_config.json there"),
        ("port in use", "the address is in use"),
        ("longer than the model", "--max-model-len: 100 positions, more than the model's max_position_embeddings = 64"),
        ("graphs on the CPU", "--cuda-graphs needs a CUDA device (the model is on cpu)"),
    ],
)
def test_bad_options_are_one_line_errors_before_any_rank(case, fragment, checkpoint, tmp_path, capsys):
    model, port = checkpoint, str(free_port())
    if case == "no such folder":
        model = tmp_path / "missing"
    elif case == "no tokenizer":
        model = tmp_path / "bare"
        model.mkdir()
        for name in ("config.json", "model.safetensors"):
            os.symlink(checkpoint / name, model / name)
    elif case == "longer than the model":  # the checkpoint with a stated max_position_embeddings of 64
        model = tmp_path / "short"
        model.mkdir()
        for name in os.listdir(checkpoint):
            if name != "config.json":
                os.symlink(checkpoint / name, model / name)
        config = json.loads((checkpoint / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with socket.socket() as busy:
        if case == "port in use":
            busy.bind(("127.0.0.1", int(port)))
            busy.listen()
        extra = {"longer than the model": ["--max-model-len", "100"], "graphs on the CPU": ["--cuda-graphs"]}
        assert main(["serve", "--model", str(model), "--tp", "2", "--port", port, *extra.get(case, [])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("spmoe serve: error: ") and fragment in err[-1], err
    assert "loading the weights" not in "\n".join(err)
