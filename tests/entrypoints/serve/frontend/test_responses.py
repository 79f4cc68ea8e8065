"""`POST /v1/responses` through the app against the scripted GLM model of test_serve_chat, driven by
the real `openai` client (`responses.create`, `responses.stream`, `responses.parse`) and
openai-agents' default `Agent` + `Runner`: the prompt is the one chat makes of the same
conversation, reasoning / message / function_call items come out whole and streamed alike, the
events come in the order the client checks, previous_response_id continues a stored conversation,
and bad requests are 400s naming the Responses field."""

import asyncio
import json

import httpx
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from spmoe.entrypoints.serve.frontend.app import ApiSettings, build_app
from spmoe.entrypoints.serve.frontend.chat import ChatOptions
from tests.entrypoints.serve.frontend.test_app import ScriptedEngineClient
from tests.entrypoints.serve.frontend.test_chat import CALL, GLM, TOOL, USER, AgentEngine, _client

FUNCTION = {"type": "function", **TOOL["function"]}  # the Responses API's flat function tool
INSTRUCTIONS = "Answer in one sentence."


def _without_ids(output: list) -> list[dict]:
    """Output items without their fresh ids (a function call's call_id checked for its shape)."""
    items = []
    for item in output:
        item = item.model_dump(exclude={"id"}, exclude_none=True)
        if "call_id" in item:
            assert item.pop("call_id").startswith("call_")
        items.append(item)
    return items


def _prompt(engine, tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1].prompt, skip_special_tokens=False)


def test_an_agent_turn_whole_and_streamed(tokenizer):
    """The first turn of the agent loop: the prompt is chat's for instructions + user message +
    tools; the output is a reasoning item, a message and a function call; the stream's events build
    the same items (the client's stream helper checks their identities), numbered from 0, in the
    documented order."""
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    system = {"role": "system", "content": INSTRUCTIONS}
    client.chat.completions.create(model="glm", messages=[system, USER], tools=[TOOL])
    chat_prompt = _prompt(engine, tokenizer)

    whole = client.responses.create(
        model="glm", input=USER["content"], instructions=INSTRUCTIONS, tools=[FUNCTION]
    )
    assert _prompt(engine, tokenizer) == chat_prompt
    assert whole.id.startswith("resp_") and whole.status == "completed"
    assert whole.instructions == INSTRUCTIONS and whole.tools[0].name == "get_weather"
    reasoning, message, call = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == "The user wants the weather." and reasoning.summary == []
    assert message.type == "message" and message.id.startswith("msg_")
    assert whole.output_text == "Let me look." and message.status == "completed"
    assert call.type == "function_call" and call.id.startswith("fc_") and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.status == "completed"
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        len(engine.requests[-1].prompt),
        len(engine.script),
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    with client.responses.stream(
        model="glm", input=USER["content"], instructions=INSTRUCTIONS, tools=[FUNCTION]
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _without_ids(final.output) == _without_ids(whole.output)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 5 and "".join(deltas) == final.output[2].arguments  # Paris, piece by piece
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("how", ["input items", "previous_response_id"])
def test_the_second_turn_gives_the_template_what_chat_gives_it(tokenizer, how):
    """The tool's result comes back as a function_call_output item, after the first turn's output
    items as input or after previous_response_id; either way the prompt is chat's for the same
    history (the reasoning and the call written back by the template), and the answer is a
    message."""
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    first = client.chat.completions.create(model="glm", messages=[USER], tools=[TOOL])
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}
    history = [USER, first.choices[0].message.model_dump(exclude_none=True), result]
    client.chat.completions.create(model="glm", messages=history, tools=[TOOL])
    chat_prompt = _prompt(engine, tokenizer)

    turn = client.responses.create(model="glm", input=[USER], tools=[FUNCTION])
    (function_call,) = [item for item in turn.output if item.type == "function_call"]
    output = {
        "type": "function_call_output",
        "call_id": function_call.call_id,
        "output": '{"temp": 21}',
    }
    if how == "input items":
        given = [USER, *(item.model_dump(exclude_none=True) for item in turn.output), output]
        answer = client.responses.create(model="glm", input=given, tools=[FUNCTION])
    else:
        answer = client.responses.create(
            model="glm", previous_response_id=turn.id, input=[output], tools=[FUNCTION]
        )
        assert answer.previous_response_id == turn.id
    assert _prompt(engine, tokenizer) == chat_prompt.replace(call.id, function_call.call_id)
    assert answer.output_text == "It is 21 °C in Paris." and answer.status == "completed"
    assert [item.type for item in answer.output] == ["reasoning", "message"]


class Weather(pydantic.BaseModel):
    city: str
    days: int


def test_text_format_and_tool_choice_constrain_as_chat_does(tokenizer):
    """`text.format` json_schema (the client's parse() with a pydantic model) is chat's
    response_format: the same grammar, starting after the reasoning; a required tool_choice is
    chat's tool grammar."""
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    engine.reply = 'Thinking.</think>{"city": "Oslo", "days": 3}'
    client.chat.completions.parse(model="glm", messages=[USER], response_format=Weather)
    chat_request = engine.requests[-1]
    parsed = client.responses.parse(model="glm", input=[USER], text_format=Weather)
    assert parsed.output_parsed == Weather(city="Oslo", days=3)
    assert engine.requests[-1].grammar == chat_request.grammar
    assert engine.requests[-1].grammar.kind == "json_schema"
    assert engine.requests[-1].grammar_start_after == chat_request.grammar_start_after != ()

    engine.reply = None
    required = client.responses.create(
        model="glm", input=[USER], tools=[FUNCTION], tool_choice="required"
    )
    client.chat.completions.create(
        model="glm", messages=[USER], tools=[TOOL], tool_choice="required"
    )
    assert engine.requests[-2].grammar == engine.requests[-1].grammar
    assert engine.requests[-1].grammar.kind == "tool_calls"
    assert required.tool_choice == "required" and required.output[-1].type == "function_call"
    named = client.responses.create(
        model="glm",
        input=[USER],
        tools=[FUNCTION],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert named.tool_choice.name == "get_weather"
    assert engine.requests[-1].grammar.kind == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_length_limit_makes_an_incomplete_response(tokenizer, stream):
    engine = AgentEngine(tokenizer)
    engine.reply = "I think.</think>A long answer that does not fit."
    client = _client(engine, tokenizer, GLM)
    fields = {
        "model": "glm",
        "input": "Hi",
        "max_output_tokens": 19,
    }  # the reasoning (16 bytes) and 3 more
    if stream:  # the last event is response.completed, as vLLM sends it: the stream helper needs it
        with client.responses.stream(**fields) as events:
            assert list(events)[-1].type == "response.completed"
            response = events.get_final_response()
    else:
        response = client.responses.create(**fields)
    assert engine.requests[-1].max_new_tokens == 19
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    reasoning, message = response.output
    assert reasoning.status == "completed" and reasoning.content[0].text == "I think."
    assert message.status == "incomplete" and message.content[0].text == "A l"
    assert response.usage.output_tokens == 19
    cut_short = client.responses.create(**{**fields, "max_output_tokens": 5})
    assert cut_short.status == "incomplete" and len(cut_short.output) == 1
    assert cut_short.output[0].status == "incomplete"
    assert cut_short.output[0].content[0].text == "I thi"


def test_without_parsers_the_text_is_the_message(tokenizer):
    engine = AgentEngine(tokenizer)
    engine.reply = "plain words"
    response = _client(engine, tokenizer, ChatOptions()).responses.create(model="glm", input="Hi")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == "plain words"


def test_stored_responses(tokenizer):
    """GET /v1/responses/{id} returns a stored response; store false keeps nothing (a later
    previous_response_id naming it is a 400)."""
    engine = AgentEngine(tokenizer)
    engine.reply = "stored"
    client = _client(engine, tokenizer, GLM)
    made = client.responses.create(model="glm", input="Hi")
    assert client.responses.retrieve(made.id) == made
    unstored = client.responses.create(model="glm", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError, match="no stored response has the id"):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="glm", input="Hi", previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"
    assert unstored.id in error.value.body["message"]


IMAGE = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
BAD_FORMAT = {
    "format": {
        "type": "json_schema",
        "name": "x",
        "schema": {"type": "integer", "minimum": 5, "maximum": 1},
    }
}
BAD = [
    (
        {"input": [IMAGE]},
        "input[0].content",
        "input[0].content: this model takes text only, and the content has a 'input_image' part",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_txt", "text": "x"}]}]},
        "input[0].content[0].type",
        "Input should be 'input_text' or 'output_text', got 'input_txt'",
    ),
    (
        {"input": [{"type": "item_reference", "id": "x"}]},
        "input[0]",
        "tag 'item_reference' found using _item_type() does not match any of the expected tags",
    ),
    (
        {"input": "Hi", "tool_choice": "any"},
        "tool_choice",
        'tool_choice: expected "none", "auto", "required" or {"type": "function", "name": ...}',
    ),
    (
        {"input": "Hi", "tools": [{"type": "web_search"}]},
        "tools[0]",
        "expected a tool of type 'function' (the only kind served), type 'web_search'",
    ),
    ({"input": "Hi", "max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens is 5000"),
    ({"input": "Hi", "n": 2}, "n", "n: a response has one output; n must be 1"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs", "served by /v1/chat/completions"),
    (
        {"input": "Hi", "response_format": {"type": "json_object"}},
        "response_format",
        "/v1/responses takes text.format",
    ),
    ({"input": "Hi", "text": BAD_FORMAT}, None, "does not compile: Invalid range"),
    (
        {"input": "Hi", "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "nope"}},
        None,  # as chat: the grammar's error
        "tool_choice names function 'nope', which is not in 'tools' (get_weather)",
    ),
    (
        {"input": "Hi", "previous_response_id": "resp_unknown"},
        "previous_response_id",
        "no stored response has the id 'resp_unknown'",
    ),
]


@pytest.mark.parametrize("body, param, fragment", BAD)
def test_bad_requests_name_the_responses_field(tokenizer, body, param, fragment):
    engine = AgentEngine(tokenizer)
    http = TestClient(build_app(engine, tokenizer, ApiSettings(["glm"], chat=GLM)))
    response = http.post("/v1/responses", json={"model": "glm", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert fragment in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_default_agent_runs_its_tool(tokenizer, streamed):
    """openai-agents' default Agent (its Responses model) with a function tool: the model calls it,
    the Runner runs it and sends the result back, and the model's answer is the final output."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    engine = AgentEngine(tokenizer)
    app = build_app(engine, tokenizer, ApiSettings(["glm"], chat=GLM))
    calls = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city."""
        calls.append((city, days))
        return '{"temp": 21}'

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = openai.AsyncOpenAI(
                base_url="http://testserver/v1", api_key="unused", http_client=http
            )
            set_default_openai_client(client, use_for_tracing=False)
            set_tracing_disabled(True)
            agent = Agent(
                name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model="glm"
            )
            if not streamed:
                return await Runner.run(agent, USER["content"])
            result = Runner.run_streamed(agent, USER["content"])
            async for _ in result.stream_events():
                pass
            return result

    result = asyncio.run(run())
    assert calls == [("Paris", 2)]
    assert result.final_output == "It is 21 °C in Paris."
    assert len(engine.requests) == 2
    prompt = _prompt(engine, tokenizer)
    assert prompt.endswith(  # the first turn's reasoning, text and call given back, then the result
        f"<|system|>{INSTRUCTIONS}<|end|><|user|>Weather in Paris?<|end|><|assistant|><think>"
        "The user wants the weather.</think>Let me look.<tool_call>get_weather<arg_key>city"
        "</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|end|>"
        '<|observation|><tool_response>{"temp": 21}</tool_response><|end|><|assistant|><think>'
    )


def test_stopping_ends_an_open_stream_with_an_error_event(tokenizer):
    """`stop` while a response streams: the stream ends with an `error` event naming the reason,
    after the events so far (no response.completed), and the engine's request is aborted."""
    engine = ScriptedEngineClient(tokenizer.encode("x" * 60))
    engine.step_s = 0.05
    app = build_app(engine, tokenizer, ApiSettings(["tiny"]))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            body = {"model": "tiny", "input": "Hi", "max_output_tokens": 40, "stream": True}
            sent = asyncio.create_task(http.post("/v1/responses", json=body))
            while not engine.requests and not sent.done():
                await asyncio.sleep(0.01)
            await app.state.api.stop("the server is shutting down", grace_s=0.1)
            return await sent

    response = asyncio.run(main())
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line[:6] == "data: "]
    kinds = [event["type"] for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.output_text.delta" in kinds and "response.completed" not in kinds
    assert kinds[-1] == "error" and "the server is shutting down" in events[-1]["message"]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert len(engine.closed_early) == 1 and app.state.api.open_requests == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_cut_off_by_the_length_limit_is_an_incomplete_item(tokenizer, stream):
    """A call the length limit cuts keeps the arguments chat returns for it (not a repaired object),
    in an `incomplete` function_call item of an incomplete response."""
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    limit = len(tokenizer.encode(CALL[: CALL.index("Paris") + 3]))  # into the city's value
    chat = client.chat.completions.create(
        model="glm", messages=[USER], tools=[TOOL], max_tokens=limit
    )
    fields = {"model": "glm", "input": [USER], "tools": [FUNCTION], "max_output_tokens": limit}
    if stream:
        with client.responses.stream(**fields) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**fields)
    assert chat.choices[0].finish_reason == "length" and response.status == "incomplete"
    reasoning, message, call = response.output
    assert (reasoning.status, message.status, call.status) == (
        "completed",
        "completed",
        "incomplete",
    )
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    with pytest.raises(ValueError):
        json.loads(call.arguments)


def test_previous_response_id_keeps_the_conversation_not_the_instructions(tokenizer):
    """As in OpenAI's API: the stored turns (input and output) come before the new input, under the
    new request's instructions only; the prompt is chat's for that conversation."""
    engine = AgentEngine(tokenizer)
    engine.reply = "I thought.</think>ok"
    client = _client(engine, tokenizer, GLM)
    first = client.responses.create(model="glm", input="Hi", instructions="First rules.")
    second = client.responses.create(
        model="glm", input="Again", instructions="Second rules.", previous_response_id=first.id
    )
    third = client.responses.create(model="glm", input="More", previous_response_id=second.id)
    second_prompt = tokenizer.decode(engine.requests[1].prompt, skip_special_tokens=False)
    assert "Second rules." in second_prompt and "First rules." not in second_prompt
    prompts = [_prompt(engine, tokenizer)]
    turn = {"role": "assistant", "content": "ok", "reasoning_content": "I thought."}
    client.chat.completions.create(
        model="glm",
        messages=[
            {"role": "user", "content": "Hi"},
            turn,
            {"role": "user", "content": "Again"},
            turn,
            {"role": "user", "content": "More"},
        ],
    )
    prompts.append(_prompt(engine, tokenizer))
    assert prompts[0] == prompts[1] and "rules" not in prompts[0]
    assert third.output_text == "ok" and third.previous_response_id == second.id
