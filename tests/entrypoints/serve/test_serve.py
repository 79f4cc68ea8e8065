"""`spmoe serve` end to end: one real server (TP 2, gloo, CPU) on a tiny checkpoint with the demo
tokenizer, driven by the real `openai` client; its greedy text against `spmoe generate`'s tokens;
concurrent streams; bad requests; SIGTERM during streams (a drain, exit 0); a second server whose
rank 1 is stopped (the watchdog); a server whose engine process is killed (it goes down, nothing is
left) and one whose front end process is killed (restarted, until it keeps dying: then the server
goes down; a response stored before the kill is still found); two front ends sharing the port and
the stored responses; and the one-line errors for bad options before any rank starts."""

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
from prometheus_client.parser import text_string_to_metric_families

from spmoe.distributed import spawn
from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.cli import main
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.entrypoints.serve.frontend.response_store import RESPONSES_DATABASE
from spmoe.entrypoints.serve.frontend.tokenizer import chat_prompt_text
from spmoe.entrypoints.tokenizer import load_tokenizer
from spmoe.models.deepseek_v32.weights import write_random_checkpoint
from tests.engine.conftest import ENGINE_CONFIG, log_softmax
from tests.engine.test_engine_grammar import ENGINE_SCHEMAS
from tests.entrypoints.serve.frontend.test_constraints import ORDERED

SERVE_CONFIG = {
    **ENGINE_CONFIG,
    "vocab_size": 264,
}  # the demo tokenizer: 256 bytes + 8 special tokens
MAX_MODEL_LEN = 640  # room for a chat prompt that lists a tool, and for a constrained JSON answer
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


def start_server(checkpoint: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`spmoe serve --tp 2` on a free port with `extra` options, once it is ready. -> (process, base
    URL)."""
    port = free_port()
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
                "--tool-call-parser",
                "glm47",
                *extra,
            ],
            stdout=err,
            stderr=err,
        )
    wait_until_ready(proc, log)
    return proc, f"http://127.0.0.1:{port}"


def wait_until_ready(proc: subprocess.Popen, log: Path) -> None:
    """Return once `spmoe serve`'s log says it is ready; fail with the log if it exits or takes
    longer than START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while "ready: http://" not in log.read_text():
        assert proc.poll() is None, f"spmoe serve exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, (
            f"spmoe serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()}"
        )
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """-> (process, base URL, log path) of `spmoe serve` on a free port (SIGTERM drains for 2 s);
    stopped at the end if a test has not."""
    log = tmp_path_factory.mktemp("serve_log") / "stderr.txt"
    proc, base = start_server(checkpoint, log, "--shutdown-timeout", "2")
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate_tokens(
    tmp_path, checkpoint, prompts: list[list[int]], max_new_tokens: int, eos_id: int
):
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
    prompt, messages, max_new = (
        "The café in Zürich",
        [{"role": "user", "content": "Hello there"}],
        12,
    )
    chat = tokenizer.encode(chat_prompt_text(tokenizer, messages), add_special_tokens=False)
    prompts = [tokenizer.encode(prompt), chat]
    expected = [
        tokenizer.decode(out, skip_special_tokens=True)
        for out in generate_tokens(tmp_path, checkpoint, prompts, max_new, tokenizer.eos_token_id)
    ]

    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_new, temperature=0
    )
    assert whole.choices[0].text == expected[0]
    assert (
        whole.usage.prompt_tokens == len(prompts[0])
        and 1 <= whole.usage.completion_tokens <= max_new
    )
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

    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_new, temperature=0
    )
    assert chat.choices[0].message.content == expected[1]
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens == len(
        prompts[1]
    )
    streamed = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_new, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected[1]
    assert streamed[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def forward_logits(folder: str, sequences: list[list[int]]) -> list[list[list[float]]]:
    """A float32 CPU forward of the whole of each sequence, no cache: logits `[len, V]` per
    sequence."""
    import torch

    from spmoe.config import ParallelConfig
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig())
    with torch.no_grad():
        return [
            model(torch.tensor(ids), torch.arange(len(ids)), [len(ids)]).float().tolist()
            for ids in sequences
        ]


def test_logprobs_echo_penalties_and_n_from_the_real_engine(server, checkpoint):
    _, base, _ = server
    client = openai_client(base)
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    echoed = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0]
    steered = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        frequency_penalty=-2.0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0]
    lp = echoed.logprobs
    output = tokens_of(lp.tokens[len(prompt) :])
    penalised = tokens_of(steered.logprobs.tokens)
    logits = spawn(forward_logits, 1, str(checkpoint), [prompt + output, prompt + penalised])[0]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, got in enumerate(lp.token_logprobs[1:], start=1):  # the prompt's, then the output's
        want = log_softmax(logits[0][i - 1])
        token = (prompt + output)[i]
        assert got == pytest.approx(want[token], abs=1e-4)
        if i >= len(prompt):  # greedy: the most likely token, and the top 3 in order
            assert want[token] == max(want)
            assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(
                sorted(want)[::-1][:3], abs=1e-4
            )
    assert (
        len(steered.logprobs.token_logprobs) == len(penalised) > 0
    )  # the loop below checks every token
    for j, token in enumerate(
        penalised
    ):  # greedy under frequency_penalty -2: the argmax of the penalised logits
        row = [
            v + 2.0 * penalised[:j].count(t) for t, v in enumerate(logits[1][len(prompt) - 1 + j])
        ]
        assert token == max(range(len(row)), key=lambda t: row[t])
        assert steered.logprobs.token_logprobs[j] == pytest.approx(
            log_softmax(row)[token], abs=1e-4
        )
    assert penalised != output  # the penalty changed the text

    four = client.completions.create(
        model="tiny", prompt="Once", max_tokens=6, temperature=1.0, n=4, seed=9
    )
    again = client.completions.create(
        model="tiny", prompt="Once", max_tokens=6, temperature=1.0, n=4, seed=9
    )
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.text for c in four.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in four.choices}) > 1  # and the choices differ

    # values a client may send that once broke the engine loop (top_k past int64) or drew at
    # temperature 1 (a temperature that rounds to 0 in float32): the server answers, and keeps
    # answering
    extreme = {"top_k": 2**63, "ignore_eos": True, "return_tokens_as_token_ids": True}
    tiny = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=1e-50,
        seed=3,
        logprobs=0,
        extra_body=extreme,
    ).choices[0]
    assert tokens_of(tiny.logprobs.tokens) == output  # greedy
    refused = httpx.post(
        base + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2, "repetition_penalty": 1e-39},
    )
    assert (
        refused.status_code == 400 and "repetition_penalty must be in [0.001, 1000]" in refused.text
    )
    assert client.completions.create(model="tiny", prompt="Once", max_tokens=2).choices[0].text


def tokens_of(strings: list[str]) -> list[int]:
    """Token ids back from the token strings of a request with return_tokens_as_token_ids."""
    assert all(s.startswith("token_id:") for s in strings), strings
    return [int(s.removeprefix("token_id:")) for s in strings]


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
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"}' in metrics
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in metrics
    # every table kept per request is empty again (the engine loop's own once it has sent the last
    # outputs)
    deadline = time.monotonic() + 30
    while (tables := request_tables(base)) and any(tables.values()):
        assert time.monotonic() < deadline, tables
        time.sleep(0.2)
    assert {"scheduler_requests", "block_tables", "engine_loop_owners", "front_end_streams"} <= set(
        tables
    ), tables


def request_tables(base: str) -> dict[str, float]:
    """spmoe:request_table_entries from /metrics: table -> entries."""
    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "spmoe:request_table_entries":
                found[sample.labels["table"]] = sample.value
    return found


def test_constrained_outputs_through_the_server(server):
    """10 schemas x 5 seeded requests at once, through response_format (chat) and structured_outputs
    / guided_json (completions): every answer is valid under its schema."""
    import jsonschema

    _, base, _ = server
    client = openai_client(base)

    def ask(case: tuple[int, int]) -> tuple[dict, str, str]:
        i, j = case
        schema = ENGINE_SCHEMAS[i]
        if j % 3 == 0:
            reply = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "JSON"}],
                seed=j,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"s{i}", "schema": schema},
                },
            ).choices[0]
            return schema, reply.message.content, reply.finish_reason
        field = {"structured_outputs": {"json": schema}} if j % 3 == 1 else {"guided_json": schema}
        reply = client.completions.create(
            model="tiny", prompt="{", max_tokens=180, seed=j, extra_body=field
        )
        return schema, reply.choices[0].text, reply.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(ask, [(i, j) for i in range(len(ENGINE_SCHEMAS)) for j in range(5)])
        )
    for schema, text, finish_reason in answers:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert len(answers) == 50


SET_FIELD = {
    "type": "object",
    "properties": {
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "uniqueItems": True,
            "maxItems": 3,
        }
    },
    "required": ["xs"],
}


class _Pairs(list):
    """A JSON object's (key, value) pairs, in the order written."""


def key_order(text: str) -> list[str]:
    """Every key of a JSON text's objects with its path, in the order written: `mid.y` for the key
    `y` of the object under `mid`, `lines[0][1].sku` for one in an array's item."""
    paths = []

    def walk(value, path: str) -> None:
        if isinstance(value, _Pairs):
            for key, inner in value:
                paths.append(f"{path}.{key}" if path else key)
                walk(inner, paths[-1])
        elif isinstance(value, list):
            for i, inner in enumerate(value):
                walk(inner, f"{path}[{i}]")

    walk(json.loads(text, object_pairs_hook=_Pairs), "")
    return paths


def test_keys_come_in_the_schemas_order_through_the_server(server):
    """response_format (chat) and guided_json (completions), 3 seeds each: the answer's keys, the
    nested object's too, in the schema's order (zeta, mid, alpha), not sorted."""
    import jsonschema

    _, base, _ = server
    client = openai_client(base)
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDERED}}
    for seed in range(3):
        chat = (
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "JSON"}],
                seed=seed,
                response_format=fmt,
            )
            .choices[0]
            .message.content
        )
        completion = (
            client.completions.create(
                model="tiny",
                prompt="{",
                max_tokens=60,
                seed=seed,
                extra_body={"guided_json": ORDERED},
            )
            .choices[0]
            .text
        )
        for text in (chat, completion):
            jsonschema.validate(json.loads(text), ORDERED)
            assert key_order(text) == ["zeta", "mid", "mid.y", "mid.b", "alpha"], text


def test_one_keyword_policy_through_the_server(server):
    """A keyword the grammar cannot enforce (uniqueItems): under strict (response_format's, a
    tool's) a 400 naming it and its path; without strict accepted through response_format,
    guided_json and a tool, logged once, counted once a request."""
    _, base, log = server
    client = openai_client(base)
    messages = [{"role": "user", "content": "JSON"}]

    def response_format(**strict) -> dict:
        schema = {"name": "s", "schema": SET_FIELD, **strict}
        return {"type": "json_schema", "json_schema": schema}

    def tools(**strict) -> list[dict]:
        return [{"type": "function", "function": {"name": "s", "parameters": SET_FIELD, **strict}}]

    def counted() -> float:
        line = 'spmoe:structured_output_unenforced_keywords_total{engine="0",keyword="uniqueItems"'
        found = [x for x in httpx.get(base + "/metrics").text.splitlines() if x.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    before = counted()
    for where, kwargs in (
        ("response_format.json_schema.schema", {"response_format": response_format(strict=True)}),
        ("tools[0].function.parameters", {"tools": tools(strict=True), "tool_choice": "required"}),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=messages, **kwargs)
        assert f"'uniqueItems' at {where}.properties.xs" in error.value.message
        assert "strict: true refuses" in error.value.message
    accepted = [
        client.chat.completions.create(
            model="tiny", messages=messages, seed=1, response_format=response_format()
        )
        .choices[0]
        .message.content,
        client.completions.create(
            model="tiny", prompt="{", max_tokens=60, seed=1, extra_body={"guided_json": SET_FIELD}
        )
        .choices[0]
        .text,
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            seed=1,
            tools=tools(strict=False),
            tool_choice="required",
            max_tokens=200,
        )
        .choices[0]
        .message.tool_calls[0]
        .function.arguments,
    ]
    for text in accepted:
        xs = json.loads(text)["xs"]
        assert all(0 <= x <= 9 for x in xs) and len(xs) <= 3, text
    assert counted() - before == 3
    logged = [line for line in log.read_text().splitlines() if "'uniqueItems' at" in line]
    assert len(logged) == 1 and "response_format.json_schema.schema.properties.xs" in logged[0]


def test_agent_loop_through_the_server(server):
    """A named tool_choice makes the random-weight model call the tool (the grammar writes GLM's
    call, the parser reads it back), whole and streamed (the openai client's stream() helper); the
    tool's result goes back in the history, and the answer is plain text."""
    import pydantic

    class Pick(pydantic.BaseModel):
        x: int = pydantic.Field(ge=0, le=9)

    _, base, _ = server
    client = openai_client(base)
    tools = [openai.pydantic_function_tool(Pick, name="pick")]
    named = {"type": "function", "function": {"name": "pick"}}
    messages = [{"role": "user", "content": "Pick a digit"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, tool_choice=named, max_tokens=96, seed=1
    )
    with client.chat.completions.stream(
        model="tiny", messages=messages, tools=tools, tool_choice=named, max_tokens=96, seed=1
    ) as stream:
        streamed = stream.get_final_completion()
    for reply in (whole, streamed):
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "pick" and 0 <= json.loads(call.function.arguments)["x"] <= 9
    assert streamed.choices[0].message.tool_calls[
        0
    ].function.parsed_arguments == Pick.model_validate_json(
        whole.choices[0].message.tool_calls[0].function.arguments
    )  # the same seed: the same call
    call = whole.choices[0].message.tool_calls[0]
    history = messages + [
        whole.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "7"},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=history, tools=tools, tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls == [] and answer.choices[0].finish_reason in (
        "stop",
        "length",
    )


FORCED_TOOL = {  # short names: the demo tokenizer's tokens are bytes, and the prompt lists the tool
    "type": "function",
    "function": {
        "name": "w",
        "parameters": {
            "type": "object",
            "properties": {
                "c": {"type": "string", "maxLength": 6},
                "u": {"enum": ["c", "f"]},
                "d": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["c", "u", "d"],
        },
    },
}


def test_forced_calls_follow_their_schemas_through_the_server(server):
    """50 sampled calls of the random-weight model, `required` and named, 8 at once: every call that
    finished is valid under its tool's schema (maxLength, enum, integer bounds); all finish."""
    import jsonschema

    _, base, _ = server
    client = openai_client(base)
    named = {"type": "function", "function": {"name": "w"}}

    def ask(seed: int):
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[FORCED_TOOL],
            tool_choice=named if seed % 2 else "required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        return reply.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(50)))
    finished = [c for c in choices if c.finish_reason == "tool_calls"]
    for choice in finished:
        (call,) = choice.message.tool_calls
        assert call.function.name == "w"
        jsonschema.validate(
            json.loads(call.function.arguments), FORCED_TOOL["function"]["parameters"]
        )
    assert len(finished) == 50, [c.finish_reason for c in choices]


def test_langchain_structured_output_by_function_calling(server):
    """LangChain's `with_structured_output(method="function_calling")` (a named call) on the
    random-weight model: the pydantic model comes back valid, its string's max_length kept, 5 seeds
    of 5."""
    import pydantic
    from langchain_openai import ChatOpenAI

    class W(pydantic.BaseModel):
        c: str = pydantic.Field(max_length=6)
        d: int = pydantic.Field(ge=1, le=14)

    _, base, _ = server
    for seed in range(5):
        chat = ChatOpenAI(
            model="tiny", base_url=base + "/v1", api_key="-", seed=seed, max_tokens=200
        )
        got = chat.with_structured_output(W, method="function_calling").invoke("Weather?")
        assert isinstance(got, W) and len(got.c) <= 6 and 1 <= got.d <= 14, got


def generated_tokens(base: str) -> float:
    metrics = httpx.get(base + "/metrics").text.splitlines()
    return float(
        next(line for line in metrics if line.startswith("vllm:generation_tokens_total")).split()[1]
    )


def leave_and_check_aborted(base: str, path: str, body: dict, max_tokens: int) -> None:
    """POST `body` (max_tokens `max_tokens`, ignore_eos) to `path` and leave: a stream after a few
    lines, a whole request after 1 s; the server must then stop generating for it within 10 s."""
    before = generated_tokens(base)
    if body["stream"]:
        with httpx.stream("POST", base + path, json=body, timeout=30) as response:
            for events, _ in enumerate(response.iter_lines()):
                if events == 12:
                    break  # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + path, json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while (
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0'
        not in httpx.get(base + "/metrics").text
    ):
        assert time.monotonic() < deadline, "the request still runs 10 s after its client went away"
        time.sleep(0.1)
    assert generated_tokens(base) - before < max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_request(server, stream):
    _, base, _ = server
    max_tokens = MAX_MODEL_LEN - 4
    body = {
        "model": "tiny",
        "prompt": "abc",
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    leave_and_check_aborted(base, "/v1/completions", body, max_tokens)


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
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0},
            400,
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.01}, 400),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 99},
            400,
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5000": 1}}, 400),
        (
            "/v1/completions",
            '{"model": "tiny", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}",
            400,
        ),
        ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', 400),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
            400,
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "16"}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 1_000_000}, 400),
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
    assert (
        set(response.json()["error"]) >= {"message", "type", "code"}
        and "Traceback" not in response.text
    )
    assert httpx.get(base + "/health").status_code == 200


def test_a_grammar_that_does_not_compile_is_a_400_from_the_engine(server):
    """The front end reads a request's grammar and checks a schema's types; the engine process
    compiles it and refuses one that does not compile: the client gets the 400 and xgrammar's
    reason, a tool's naming the tool."""
    _, base, _ = server
    user = [{"role": "user", "content": "hi"}]
    empty_range = {"type": "integer", "minimum": 5, "maximum": 1}

    def tool(x: dict) -> dict:
        parameters = {"properties": {"x": x}}
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    def response_format(schema: dict) -> dict:
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            }
        }

    cases = [
        (
            response_format(empty_range),
            "the json_schema grammar does not compile: Invalid range: minimum greater than maximum",
        ),
        (
            {"tools": [tool(empty_range)], "tool_choice": "required"},
            "tool 'f': parameters do not compile: Invalid range: minimum greater than maximum",
        ),
        ({"guided_regex": "(ab"}, "the regex grammar does not compile: Regex parsing error"),
        # the front end's own check, whatever the queue holds
        (
            response_format({"type": "foo"}),
            "response_format.json_schema.schema.type: expected one of array, boolean",
        ),
        (
            {"tools": [tool({"type": "foo"})], "tool_choice": "required"},
            "tools[0].function.parameters.properties.x.type: expected one of array, boolean",
        ),
    ]
    for extra, message in cases:
        body = {"model": "tiny", "messages": user, "max_tokens": 4} | extra
        response = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith(message), response.text


def test_the_front_end_never_loads_torch(server):
    """After every request above (schemas, forced and free tool calls, bad grammars), the front end
    process has mapped no torch library: it read them all without the engine's code."""
    proc, base, _ = server
    assert httpx.get(base + "/health").status_code == 200
    (front,) = [
        p for p in descendants(proc.pid) if b"spmoe.entrypoints.serve.frontend" in cmdline(p)
    ]
    maps = Path(f"/proc/{front}/maps").read_text()
    assert "libtorch" not in maps and "xgrammar" not in maps


def stream_events(
    base: str, body: dict, events: list, started: threading.Event | None = None
) -> None:
    """POST a streaming completion; append each `data:` line to `events` (the status first, then the
    data)."""
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            events.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if started is not None:
                        started.set()
    except httpx.TransportError as e:  # cut: the assertions show it
        events.append(f"cut: {e!r}")


def test_sigterm_drains_open_streams_and_stops_every_rank(server):
    """SIGTERM during 4 streams that cannot finish within --shutdown-timeout 2: a new request gets
    503 while the server drains, each stream ends with an error chunk (or its finish) and [DONE],
    the command exits 0 and no rank is left."""
    proc, base, log = server
    ranks = descendants(proc.pid)
    assert len(ranks) >= 2, ranks  # at least the two ranks
    body = {
        "model": "tiny",
        "prompt": "a long one",
        "max_tokens": MAX_MODEL_LEN - 16,
        "stream": True,
    }
    streams, started = [[] for _ in range(4)], [threading.Event() for _ in range(4)]
    holders = [
        threading.Thread(
            target=stream_events, args=(base, {**body, "ignore_eos": True}, events, go)
        )
        for events, go in zip(streams, started)
    ]
    for holder in holders:
        holder.start()
    for go in started:
        assert go.wait(60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    refused = httpx.post(
        base + "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert refused.status_code == 503 and "shutting down" in refused.text, refused.text
    assert httpx.get(base + "/health", timeout=30).status_code == 503
    assert sigterm_leaves_nothing(proc, ranks, log, signalled=True) < 25
    assert proc.returncode == 0, log.read_text()
    for holder in holders:
        holder.join(timeout=30)
    for events in streams:
        assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert (
            "the server is shutting down" in last["error"]["message"]
            or last["choices"][0]["finish_reason"]
        ), last
    assert any(
        "error" in json.loads(events[-2]) for events in streams
    )  # 2 s was too short for them
    assert (
        "spmoe serve: stopped by SIGTERM" in log.read_text() and "Traceback" not in log.read_text()
    )


def test_a_stopped_rank_fails_requests_and_the_server_exits_1(checkpoint, tmp_path):
    """The watchdog: rank 1 stopped (SIGSTOP), a request then waits on it; after --engine-timeout 3
    the request ends with an error, /health stops answering 200, the front end exits 1, then rank 0,
    and the command exits 1 saying why."""
    log = tmp_path / "stderr.txt"
    proc, base = start_server(checkpoint, log, "--engine-timeout", "3")
    ranks = sorted(
        pid
        for pid in descendants(proc.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    try:
        assert len(ranks) == 2, ranks  # started in rank order
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}
        events: list = []
        stream_events(base, body, events)  # the server works
        assert events[0] == 200 and events[-1] == "[DONE]", events
        os.kill(ranks[1], signal.SIGSTOP)
        began, events = time.monotonic(), []
        holder = threading.Thread(target=stream_events, args=(base, body, events))
        holder.start()
        health = []
        while proc.poll() is None and time.monotonic() - began < 60:
            try:
                health.append(httpx.get(base + "/health", timeout=5).status_code)
            except httpx.TransportError:
                health.append("gone")
            time.sleep(0.2)
        holder.join(timeout=30)
        assert proc.wait(timeout=30) == 1, log.read_text()
        assert 3 <= time.monotonic() - began < 40
        # 200 until the watchdog fires, then 503 for as long as the server still listens (the app
        # tests see the 503 itself), never 200 again
        after = health[health.index(200) :]
        first_not_ok = next(i for i, status in enumerate(after) if status != 200)
        assert set(after[first_not_ok:]) <= {503, "gone"}, health
        # the request waited for its first token: a 503, or a stream that ends with an error chunk
        # and [DONE]
        if events[0] == 200:
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events
        else:
            assert events[0] == 503, events
        text = log.read_text()
        assert "no engine step finished in" in text and "(--engine-timeout 3)" in text, text
        # the front end exits 1; rank 0, stuck in the step with the stopped rank, exits 1 after it
        assert "exited with code 1 and the engine loop has been stuck in a step since" in text, text
        assert (
            text.strip()
            .splitlines()[-1]
            .startswith("spmoe serve: error: rank 0 of 2 exited with code 1")
        ), text
    finally:
        kill_left(proc, ranks)


def kill_left(proc: subprocess.Popen, pids) -> None:
    """After a test: SIGKILL to each process of `pids` still alive, and to `proc`."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def hold_a_stream(base: str) -> tuple[threading.Thread, list]:
    """A long stream, held open from a thread once its first token came. -> (the thread, its
    events)."""
    events, started = [], threading.Event()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 600, "stream": True, "ignore_eos": True}
    holder = threading.Thread(target=stream_events, args=(base, body, events, started))
    holder.start()
    assert started.wait(60)
    return holder, events


def store_response(base: str, text: str) -> dict:
    """A stored response to `text`, over a connection of its own (whichever front end takes it)."""
    body = {"model": "tiny", "input": text, "max_output_tokens": 2}
    made = httpx.post(f"{base}/v1/responses", json=body, timeout=60)
    assert made.status_code == 200, made.text
    return made.json()


def check_stored(base: str, made: dict) -> None:
    """`made` is read back, and continued with its conversation before the new input, each over a
    connection of its own (whichever front end takes it)."""
    got = httpx.get(f"{base}/v1/responses/{made['id']}", timeout=60)
    assert got.status_code == 200 and got.json() == made, got.text
    body = {"model": "tiny", "input": "more", "max_output_tokens": 2}
    more = httpx.post(
        f"{base}/v1/responses", json={**body, "previous_response_id": made["id"]}, timeout=60
    )
    alone = httpx.post(f"{base}/v1/responses", json=body, timeout=60)
    assert more.status_code == 200 and alone.status_code == 200, (more.text, alone.text)
    # the stored conversation came before the new input
    assert more.json()["usage"]["input_tokens"] > alone.json()["usage"]["input_tokens"]


def open_files(pid: int) -> list[str]:
    """What process `pid`'s open fds point to (paths, `socket:[inode]`, ...), from /proc."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:
            continue
    return targets


def front_ends_folder(pid: int) -> Path:
    """The folder the front ends share, from the stored responses' database that front end `pid`
    has open."""
    for target in open_files(pid):
        if target.endswith(f"/{RESPONSES_DATABASE}"):
            return Path(target).parent
    raise AssertionError(f"front end {pid} has no {RESPONSES_DATABASE} open")


def running_requests(base: str) -> float:
    """The engine's running requests, as /metrics says."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


def test_a_killed_engine_takes_the_server_down_and_leaves_nothing(checkpoint, tmp_path):
    """SIGKILL to the engine process (rank 0): the command exits 1 within seconds, saying why, no
    process of the server is left, and a stream open at the time ends (cut or with an error)."""
    log = tmp_path / "stderr.txt"
    proc, base = start_server(checkpoint, log)
    everything = descendants(proc.pid)
    try:
        front = [pid for pid in everything if b"spmoe.entrypoints.serve.frontend" in cmdline(pid)]
        ranks = sorted(pid for pid in everything if b"spawn_main" in cmdline(pid))
        assert len(front) == 1 and len(ranks) == 2, (front, ranks)
        assert front[0] in descendants(ranks[0])  # rank 0 started it
        holder, events = hold_a_stream(base)
        began = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1, log.read_text()
        while any(alive(pid) for pid in everything) and time.monotonic() - began < 30:
            time.sleep(0.2)
        assert not [pid for pid in everything if alive(pid)], log.read_text()
        assert time.monotonic() - began < 30
        holder.join(timeout=30)
        assert events[-1] != "[DONE]" or "error" in json.loads(events[-2]), events[-3:]
        assert "rank 0 of 2 was killed by SIGKILL" in log.read_text(), log.read_text()
    finally:
        kill_left(proc, everything)


def test_a_killed_front_end_is_restarted_until_it_keeps_dying(checkpoint, tmp_path):
    """SIGKILL to the front end process, a stream open: the stream ends at once (its connection
    closes with the process), the engine aborts its request, and rank 0 starts a new front end in
    its place, which serves, and finds the responses stored before the kill. Killed again and
    again: after `MAX_RESTARTS` restarts the next death stops the server, exit 1, saying why, and no
    process of the server is left, nor the front ends' folder (how long each takes:
    benchmarks/bench_front_end.py)."""
    log = tmp_path / "stderr.txt"
    proc, base = start_server(checkpoint, log)
    everything = descendants(proc.pid)

    def front_end() -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [
                p for p in descendants(proc.pid) if alive(p) and b"serve.frontend" in cmdline(p)
            ]
            try:
                healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
            except httpx.TransportError:
                healthy = False
            if len(found) == 1 and healthy:
                everything.update(descendants(proc.pid))
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no front end serves:\n{log.read_text()}")

    try:
        killed = front_end()
        folder = front_ends_folder(killed)
        stored = store_response(base, "remember this")
        holder, events = hold_a_stream(base)
        began = time.monotonic()
        os.kill(killed, signal.SIGKILL)
        holder.join(timeout=30)
        assert not holder.is_alive() and events[-1].startswith("cut: "), events[-3:]
        restarted = front_end()
        assert restarted != killed
        text = log.read_text()
        assert f"the front end process {killed} exited with code -9; its open requests end" in text
        assert "(restart 1 of at most 3 in 300 s)" in text, text
        reply = openai_client(base).completions.create(model="tiny", prompt="ab", max_tokens=2)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert running_requests(base) == 0  # the killed front end's request was aborted
        check_stored(base, stored)
        for restart in (2, 3):
            os.kill(front_end(), signal.SIGKILL)
            front_end()
            assert f"(restart {restart} of at most 3 in 300 s)" in log.read_text()
        last = front_end()
        began = time.monotonic()
        os.kill(last, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1, log.read_text()
        print(f"the server stopped {time.monotonic() - began:.1f} s after the last death")
        while any(alive(pid) for pid in everything) and time.monotonic() - began < 30:
            time.sleep(0.2)
        assert not [pid for pid in everything if alive(pid)], log.read_text()
        assert (
            f"the front end process {last} exited with code -9, after 3 restarts of front ends "
            "in 300 s; stopping the server"
        ) in log.read_text(), log.read_text()
        assert not folder.exists(), sorted(folder.iterdir())
    finally:
        kill_left(proc, everything)


def connections_on(pid: int, port: int) -> int:
    """Established TCP connections of process `pid` on local port `port` (from /proc)."""
    inodes = {target[8:-1] for target in open_files(pid) if target.startswith("socket:[")}
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            count += local_port == port and state == "01" and inode in inodes
    return count


def test_two_front_end_processes_share_the_port(checkpoint, tmp_path):
    """--api-server-count 2: two front end processes of rank 0 listen on the port; 16 streams held
    open at once are spread over both (the kernel's choice: all on one has odds 2 ** -15), each
    stream gets its tokens, /metrics totals both front ends' requests; a stored response is read
    back and continued through either front end (8 responses, each read back and continued on
    fresh connections: that all 16 calls land on the front end that stored theirs has odds
    2 ** -16); SIGTERM stops them and every rank, and their shared folder is removed."""
    log = tmp_path / "stderr.txt"
    proc, base = start_server(checkpoint, log, "--api-server-count", "2", "--shutdown-timeout", "2")
    everything = descendants(proc.pid)
    try:
        front = [pid for pid in everything if b"spmoe.entrypoints.serve.frontend" in cmdline(pid)]
        assert len(front) == 2, front
        port = int(base.rsplit(":", 1)[1])
        body = {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 40,
            "stream": True,
            "ignore_eos": True,
        }
        streams = [[] for _ in range(16)]
        started = [threading.Event() for _ in streams]
        holders = [
            threading.Thread(target=stream_events, args=(base, body, events, go))
            for events, go in zip(streams, started)
        ]
        for holder in holders:
            holder.start()
        deadline, held = time.monotonic() + 60, [0, 0]
        while time.monotonic() < deadline and not all(held):
            held = [connections_on(pid, port) for pid in front]
            time.sleep(0.05)
        assert all(held), held
        for holder in holders:
            holder.join(timeout=120)
        for events in streams:
            assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
        # every scrape, whichever front end answers it, totals both front ends' requests
        finished = (
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
        )
        for _ in range(8):
            counts = [
                line.rsplit(" ", 1)[1]
                for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
                if line.startswith(finished)
            ]
            assert counts == ["16.0"], counts
        folder = front_ends_folder(front[0])
        assert front_ends_folder(front[1]) == folder
        for made in [store_response(base, f"note {i}") for i in range(8)]:
            check_stored(base, made)
        sigterm_leaves_nothing(proc, list(everything), log)
        assert proc.returncode == 0, log.read_text()
        assert not folder.exists(), sorted(folder.iterdir())
    finally:
        kill_left(proc, everything)


def sigterm_leaves_nothing(
    proc: subprocess.Popen, pids: list[int], log, signalled: bool = False
) -> float:
    """SIGTERM to `proc` (unless `signalled`: already sent); assert that it and every process in
    `pids` are gone within 30 s. -> the seconds taken."""
    began = time.monotonic()
    if not signalled:
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    while any(alive(pid) for pid in pids) and time.monotonic() - began < 30:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], f"left behind after SIGTERM:\n{log.read_text()}"
    return time.monotonic() - began


def test_sigterm_under_torchrun_leaves_no_rank(checkpoint, tmp_path):
    """Under torchrun the agent sends SIGTERM to every worker: rank 0 stops its front end, the other
    rank (blocked in the control plane's broadcast) ends on the signal, and no process of the run is
    left, well before the agent's SIGKILL 30 s later. Rank 0 prints one line, no traceback."""
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
            assert agent.poll() is None, (
                f"torchrun exited with {agent.returncode}:\n{log.read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"not ready after {START_TIMEOUT_S} s:\n{log.read_text()}"
            )
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
        # rank 0 says why it stopped, and the other rank's end (by the same signal) is no error of
        # its own
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
        (
            "no tokenizer",
            "has no tokenizer: expected tokenizer.json or tokenizer_config.json there",
        ),
        ("port in use", "the address is in use"),
        (
            "longer than the model",
            "--max-model-len: 100 positions, more than the model's max_position_embeddings = 64",
        ),
        ("graphs on the CPU", "--cuda-graphs needs a CUDA device (the model is on cpu)"),
        (  # the TP-split sizes: 6 heads, 96 tokens, 72 and 12 intermediate rows
            "tp does not divide the heads",
            "num_attention_heads = 6 is not divisible by tensor_parallel_size = 4; "
            "tensor_parallel_size can be 1, 2, 3 or 6",
        ),
        ("simulated, real weights", "--simulate-rank needs --load-format dummy"),
    ],
)
def test_bad_options_are_one_line_errors_before_any_rank(
    case, fragment, checkpoint, tmp_path, capsys
):
    model, port = checkpoint, str(free_port())
    if case == "no such folder":
        model = tmp_path / "missing"
    elif case == "no tokenizer":
        model = tmp_path / "bare"
        model.mkdir()
        for name in ("config.json", "model.safetensors"):
            os.symlink(checkpoint / name, model / name)
    elif (
        case == "longer than the model"
    ):  # the checkpoint with a stated max_position_embeddings of 64
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
        extra = {
            "longer than the model": ["--max-model-len", "100"],
            "graphs on the CPU": ["--cuda-graphs"],
            "tp does not divide the heads": ["--tp", "4"],
            "simulated, real weights": ["--simulate-rank"],
        }
        assert (
            main(
                ["serve", "--model", str(model), "--tp", "2", "--port", port, *extra.get(case, [])]
            )
            == 1
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("spmoe serve: error: ") and fragment in err[-1], err
    assert "loading the weights" not in "\n".join(err)


def test_a_simulated_rank_serves_alone_and_labels_every_response_and_metric(checkpoint, tmp_path):
    """`--simulate-rank --load-format dummy`: rank 0 of TP 2 alone, with a banner; the first served
    name (responses, metrics) says SIMULATED-RANK, and the given name is still accepted."""
    log = tmp_path / "stderr.txt"
    proc, base = start_server(
        checkpoint, log, "--simulate-rank", "--load-format", "dummy", "--simulated-load", "busiest"
    )
    try:
        assert "SIMULATED RANK: rank 0 of tp=2 x dp=1" in log.read_text()
        below = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in descendants(proc.pid)]
        ranks = [cmd for cmd in below if b"spmoe.entrypoints.serve.frontend" not in cmd]
        assert len(ranks) <= 2, below  # one rank process (and the spawn helper's tracker)
        assert len(below) - len(ranks) == 1, below  # and the HTTP front end's process
        models = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert models == ["tiny-SIMULATED-RANK", "tiny"]
        reply = openai_client(base).completions.create(model="tiny", prompt="ab", max_tokens=2)
        assert reply.model == "tiny-SIMULATED-RANK"
        assert 'model_name="tiny-SIMULATED-RANK"' in httpx.get(f"{base}/metrics").text
    finally:
        proc.kill()
        proc.wait()
