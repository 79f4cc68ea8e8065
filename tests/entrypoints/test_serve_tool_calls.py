"""Tool calls through the app and the clients agents use (`openai`, `langchain-openai`), against a scripted
model: a call cut off by the length limit comes back visibly broken (its arguments as generated, which no
client takes for a valid call), never repaired; streamed and whole answers agree."""

import json

import openai
import pytest
from fastapi.testclient import TestClient
from langchain_openai import ChatOpenAI

from spmoe.entrypoints.serve.app import ApiSettings, build_app
from tests.entrypoints.test_serve_chat import CALL, GLM, TOOL, USER, AgentEngine, _client

LOOK = CALL.index("<tool_call>")  # where the call starts in the scripted reply
CUTS = {  # where max_tokens cuts the reply -> the calls the client gets, (name, arguments text)
    "in a string value": (CALL.index("Paris") + 2, [("get_weather", '{"city": "Pa')]),
    "in the value's end tag": (
        CALL.index("</arg_value>") + 3,
        [("get_weather", '{"city": "Paris')],
    ),
    "in a typed value's end tag": (
        CALL.index("2</arg_value>") + 4,
        [("get_weather", '{"city": "Paris", "days": 2')],
    ),
    "before the call's end": (len(CALL) - 3, [("get_weather", '{"city": "Paris", "days": 2')]),
    "in the name": (LOOK + len("<tool_call>get_we"), []),
    "in the call's tag": (LOOK + len("<to"), []),
}


def _streamed(client, **request) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed answer, reassembled -> (content, calls as (name, arguments text), finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (
                name + (call.function.name or ""),
                arguments + (call.function.arguments or ""),
            )
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
@pytest.mark.parametrize("cut", list(CUTS), ids=list(CUTS))
def test_a_cut_call_is_never_repaired(tokenizer, cut, tool_choice):
    max_tokens, calls = CUTS[cut]
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    request = dict(
        model="glm", messages=[USER], tools=[TOOL], tool_choice=tool_choice, max_tokens=max_tokens
    )
    whole = client.chat.completions.create(**request).choices[0]
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert (whole.message.content, got, whole.finish_reason) == ("Let me look.", calls, "length")
    for _, arguments in got:
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)
    assert _streamed(client, **request) == ("Let me look.", calls, "length")


def _langchain(engine, tokenizer) -> ChatOpenAI:
    http = TestClient(build_app(engine, tokenizer, ApiSettings(["glm"], chat=GLM)))
    return ChatOpenAI(
        model="glm", base_url="http://testserver/v1", api_key="unused", http_client=http
    )


def test_langchain_files_a_cut_call_as_invalid(tokenizer):
    """LangChain's `bind_tools(..., tool_choice="any")` (a `required` call): the cut call lands in
    `invalid_tool_calls`, so an agent never runs the tool with it; the whole call is a valid one."""
    engine = AgentEngine(tokenizer)
    chat = _langchain(engine, tokenizer)
    tools = [TOOL["function"]]
    cut = chat.bind_tools(tools, tool_choice="any").invoke(
        [("user", USER["content"])], max_tokens=CUTS["in a string value"][0]
    )
    assert cut.tool_calls == [] and cut.response_metadata["finish_reason"] == "length"
    ((broken),) = cut.invalid_tool_calls
    assert (broken["name"], broken["args"]) == ("get_weather", '{"city": "Pa')
    assert "<" not in cut.content

    whole = chat.bind_tools(tools, tool_choice="any").invoke([("user", USER["content"])])
    assert whole.invalid_tool_calls == []
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert engine.requests[-1].grammar is not None  # "any" is "required": the call is constrained


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_schema_feature_it_cannot_enforce_is_a_400(tokenizer, tool_choice):
    city = {"type": "string", "not": {"const": "Paris"}}
    parameters = {**TOOL["function"]["parameters"], "properties": {"city": city}}
    tool = {"type": "function", "function": {**TOOL["function"], "parameters": parameters}}
    client = _client(AgentEngine(tokenizer), tokenizer, GLM)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="glm", messages=[USER], tools=[tool], tool_choice=tool_choice
        )
    assert (
        "tool 'get_weather': parameters.properties.city uses 'not', which the tool-call grammar "
        "cannot enforce (docs/glm-chat.md lists what it enforces)"
    ) in error.value.message
