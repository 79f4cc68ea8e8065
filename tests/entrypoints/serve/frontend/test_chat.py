"""GLM chat through the app and the real `openai` client, against a scripted model: the reasoning
split off, an agent loop (tool call -> tool result -> answer) whole and streamed, the client's
`parse()` / `stream()` helpers, the tool_choice rules and the structured-output fields handed to the
engine."""

import json

import msgspec
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from spmoe.engine.request import GrammarSpec, ToolCalls
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.entrypoints.serve.frontend.app import ApiSettings, build_app
from spmoe.entrypoints.serve.frontend.chat import ChatOptions
from tests.entrypoints.serve.frontend.test_app import ScriptedEngineClient

CALL = (
    "The user wants the weather.</think>\nLet me look.<tool_call>get_weather<arg_key>city</arg_key>"
    "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
)
ANSWER = "I have 21 degrees.</think>\nIt is 21 °C in Paris."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
USER = {"role": "user", "content": "Weather in Paris?"}


class AgentEngine(ScriptedEngineClient):
    """Calls the tool first; once the prompt holds a tool response, answers; `reply` overrides
    both."""

    max_model_len, num_speculative_tokens = 4096, 0

    def __init__(self, tokenizer):
        super().__init__([], eos_token_ids=(tokenizer.eos_token_id,))
        self.tokenizer, self.reply = tokenizer, None
        self.grammars = GrammarCompiler.from_tokenizer(tokenizer, self.vocab_size)

    async def generate(self, request):
        # as the engine process does: a grammar that does not compile refuses the request
        if request.grammar is not None:
            self.grammars.compile(request.grammar)
        prompt = self.tokenizer.decode(request.prompt, skip_special_tokens=False)
        reply = self.reply or (ANSWER if "<tool_response>" in prompt else CALL)
        self.script = self.tokenizer.encode(reply) + [self.tokenizer.eos_token_id]
        async for out in super().generate(request):
            yield out


def _client(engine, tokenizer, options: ChatOptions) -> openai.OpenAI:
    http = TestClient(
        build_app(engine, tokenizer, ApiSettings(["glm"], chat=options)),
        raise_server_exceptions=False,
    )
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


GLM = ChatOptions(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agent_loop(tokenizer, stream):
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)

    def ask(messages):
        if not stream:
            return client.chat.completions.create(
                model="glm", messages=messages, tools=[TOOL]
            ).choices[0]
        chunks = list(
            client.chat.completions.create(
                model="glm", messages=messages, tools=[TOOL], stream=True
            )
        )
        message = {"reasoning_content": "", "content": "", "tool_calls": {}}
        for chunk in chunks:
            delta = chunk.choices[0].delta
            message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            message["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = message["tool_calls"].setdefault(call.index, {"arguments": "", "pieces": 0})
                entry.update(
                    {k: v for k, v in (("id", call.id), ("name", call.function.name)) if v}
                )
                entry["arguments"] += call.function.arguments or ""
                entry["pieces"] += 1
        ask.pieces = [c["pieces"] for c in message["tool_calls"].values()]
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in message["tool_calls"].values()
        ]
        message = openai.types.chat.ChatCompletionMessage(
            role="assistant",
            content=message["content"] or None,
            tool_calls=calls or None,
            reasoning_content=message["reasoning_content"],
        )
        return openai.types.chat.chat_completion.Choice(
            index=0, message=message, finish_reason=chunks[-1].choices[0].finish_reason
        )

    first = ask([USER])
    assert first.finish_reason == "tool_calls"
    assert first.message.content == "Let me look."
    assert first.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    if stream:
        assert ask.pieces[0] > 5  # "Paris" came a byte at a time, before the call closed

    history = [
        USER,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = ask(history)
    assert (second.finish_reason, second.message.content, second.message.tool_calls) == (
        "stop",
        "It is 21 °C in Paris.",
        None if stream else [],
    )
    assert second.message.model_extra["reasoning_content"] == "I have 21 degrees."
    prompt = tokenizer.decode(engine.requests[-1].prompt, skip_special_tokens=False)
    assert prompt.endswith(
        "<|assistant|><think>The user wants the weather.</think>Let me look.<tool_call>get_weather<arg_key>city"
        "</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|end|>"
        '<|observation|><tool_response>{"temp": 21}</tool_response><|end|><|assistant|><think>'
    )
    assert '<tools>\n{"name": "get_weather"' in prompt


class Weather(pydantic.BaseModel):
    city: str
    days: int


def test_client_helpers(tokenizer, monkeypatch):
    """`parse()` with a pydantic response_format, and `stream()` with a strict pydantic tool, read
    the replies; the request carries the grammar, to start after the reasoning, whose end tag the
    server encoded once."""
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    encoded, encode = [], tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda text, **kw: encoded.append(text) or encode(text, **kw)
    )
    engine.reply = 'Thinking.</think>{"city": "Oslo", "days": 3}'
    for _ in range(2):
        parsed = client.chat.completions.parse(
            model="glm", messages=[USER], response_format=Weather
        )
        assert parsed.choices[0].message.parsed == Weather(city="Oslo", days=3)
        request = engine.requests[-1]
        assert request.grammar.kind == "json_schema" and json.loads(request.grammar.text)[
            "required"
        ] == [
            "city",
            "days",
        ]
        assert request.grammar_start_after == tuple(encode("</think>"))
    assert (
        encoded and "</think>" not in encoded
    )  # the prompts and replies went through it, never the tag
    monkeypatch.undo()

    engine.reply = CALL
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    with client.chat.completions.stream(model="glm", messages=[USER], tools=[tool]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == Weather(
        city="Paris", days=2
    )
    # "auto": the model decides; a call it opens follows the schema
    auto = engine.requests[-1].grammar
    calls = msgspec.json.decode(auto.text, type=ToolCalls)
    assert auto.kind == "tool_calls" and calls.free_text and calls.tools[0][0] == "get_weather"


def test_thinking_off_and_tool_choice_none(tokenizer):
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    engine.reply = "a</think>b<tool_call>get_time</tool_call>"
    reply = client.chat.completions.create(
        model="glm",
        messages=[USER],
        tools=[TOOL],
        tool_choice="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = reply.choices[0].message
    assert message.content == engine.reply and message.model_extra["reasoning_content"] is None
    assert message.tool_calls == [] and reply.choices[0].finish_reason == "stop"
    assert tokenizer.decode(engine.requests[-1].prompt, skip_special_tokens=False).endswith(
        "<|assistant|></think>"
    )


def test_no_parsers_leaves_the_text_alone(tokenizer):
    engine = AgentEngine(tokenizer)
    reply = _client(engine, tokenizer, ChatOptions()).chat.completions.create(
        model="glm", messages=[USER]
    )
    assert (
        reply.choices[0].message.content == CALL
        and reply.choices[0].message.model_extra["reasoning_content"] is None
    )


def test_tool_choice_required_and_named_constrain(tokenizer):
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, ChatOptions(tool_call_parser="glm47"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        reply = client.chat.completions.create(
            model="glm", messages=[USER], tools=[TOOL], tool_choice=choice
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        grammar = engine.requests[-1].grammar
        calls = msgspec.json.decode(grammar.text, type=ToolCalls)
        assert grammar.kind == "tool_calls" and [name for name, _ in calls.tools] == ["get_weather"]
        assert (
            engine.requests[-1].grammar_start_after == ()
        )  # no reasoning parser: from the first token


@pytest.mark.parametrize(
    "options, body, fragment",
    [
        (
            ChatOptions(tool_call_parser="glm47"),
            {"tools": [TOOL]},
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice',
        ),
        (
            ChatOptions(),
            {"tools": [TOOL]},
            'tool_choice "auto" needs the server started with --tool-call-parser and '
            "--enable-auto-tool-choice",
        ),
        (GLM, {"tool_choice": "required"}, "tool_choice \"required\" needs 'tools'"),
        (
            GLM,
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice names function 'nope', which is not in 'tools' (get_weather)",
        ),
        (
            GLM,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                    },
                }
            },
            "the json_schema grammar does not compile: Invalid range: minimum greater than maximum",
        ),
        (
            GLM,
            {"guided_regex": "(a", "response_format": {"type": "json_object"}},
            "only one of these may constrain",
        ),
        (
            GLM,
            {"messages": [{"role": "assistant", "content": None}]},
            "a 'assistant' message needs 'content'",
        ),
        (
            GLM,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "a tool call's function.arguments must be a JSON object's text, got '[1]'",
        ),
        (
            GLM,
            {
                "messages": [
                    {
                        "role": "tool",
                        "content": "x",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "only an assistant message may have",
        ),
        (
            GLM,
            {"chat_template_kwargs": {"enable_thinking": "yes"}},
            "enable_thinking must be true or false, got 'yes'",
        ),
        (GLM, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs must not set tools"),
    ],
)
def test_bad_chat_requests(tokenizer, options, body, fragment):
    engine = AgentEngine(tokenizer)
    http = TestClient(
        build_app(engine, tokenizer, ApiSettings(["glm"], chat=options)),
        raise_server_exceptions=False,
    )
    response = http.post("/v1/chat/completions", json={"model": "glm", "messages": [USER], **body})
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]
    assert engine.requests == []


def test_completions_take_structured_output(tokenizer):
    engine = AgentEngine(tokenizer)
    engine.reply = "yes"
    client = _client(engine, tokenizer, GLM)
    client.completions.create(
        model="glm", prompt="Q", max_tokens=4, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert engine.requests[-1].grammar == GrammarSpec("choice", '["yes", "no"]')
    assert engine.requests[-1].grammar_start_after == ()


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_sends_no_empty_delta_and_loses_no_logprobs(tokenizer, n):
    """While the parsers hold text back (a `</think>` or a tool call coming a byte at a time) no
    chunk goes out; the held tokens' logprobs go with the next chunk that has text. Only the role
    chunk, the finish_reason chunk and the usage chunk may carry no text."""
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    chunks = list(
        client.chat.completions.create(
            model="glm",
            messages=[USER],
            tools=[TOOL],
            n=n,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[
        -1
    ].usage.completion_tokens == n * len(engine.script)
    for index in range(n):
        mine = [c.choices[0] for c in chunks[1:-1] if c.choices[0].index == index]
        assert mine and mine[-1].finish_reason == "tool_calls"
        for choice in mine[:-1]:
            delta = choice.delta
            assert choice.finish_reason is None
            assert (
                delta.content
                or delta.tool_calls
                or (delta.model_extra or {}).get("reasoning_content")
            ), choice
        logprobs = [entry for choice in mine for entry in choice.logprobs.content]
        generated = engine.script  # the text's bytes, then the eos id
        assert [bytes(entry.bytes) for entry in logprobs] == [
            bytes([t]) for t in generated[:-1]
        ] + [b"<|end|>"]
        assert [entry.logprob for entry in logprobs] == [-t / 100 for t in generated]
        assert [[top.logprob for top in entry.top_logprobs] for entry in logprobs] == [
            [-t / 100, -7.0] for t in generated
        ]
        assert len(mine) < len(
            generated
        )  # a token a step, some held back: their logprobs came later
