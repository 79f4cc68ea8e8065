"""Tool calls through the app and the clients agents use (`openai`, `langchain-openai`), against a
scripted model: a call cut off by the length limit comes back visibly broken (its arguments as
generated, which no client takes for a valid call), never repaired; streamed and whole answers
agree."""

import json

import openai
import pytest
from fastapi.testclient import TestClient
from langchain_openai import ChatOpenAI

from spmoe.entrypoints.serve.frontend.app import ApiSettings, build_app
from spmoe.entrypoints.serve.frontend.chat import ChatOptions
from tests.entrypoints.serve.frontend.test_chat import CALL, GLM, TOOL, USER, AgentEngine, _client

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
    """A streamed answer, reassembled -> (content, calls as (name, arguments), finish_reason)."""
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
def test_a_schema_feature_it_cannot_enforce_is_a_400_under_strict(tokenizer, tool_choice):
    """`not` under the tool's strict: a 400 naming it and where; without strict the call is served
    (constrained as far as the grammar goes), as vLLM serves it."""
    city = {"type": "string", "not": {"const": "Paris"}}
    parameters = {**TOOL["function"]["parameters"], "properties": {"city": city}}
    engine = AgentEngine(tokenizer)
    client = _client(engine, tokenizer, GLM)
    for strict in (True, False):
        function = {**TOOL["function"], "parameters": parameters, "strict": strict}
        tool = {"type": "function", "function": function}
        ask = dict(model="glm", messages=[USER], tools=[tool], tool_choice=tool_choice)
        if not strict:
            assert client.chat.completions.create(**ask).choices[0].message.tool_calls
            assert engine.requests[-1].grammar is not None
            continue
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**ask)
        assert (
            "strict: true refuses a schema keyword the grammar cannot enforce: 'not' at "
            "tools[0].function.parameters.properties.city. Remove it"
        ) in error.value.message


GLM_CALL = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
)
JSON_CALL = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]'
PLAIN_TEMPLATE = (  # a chat template that is not GLM's: it knows nothing of <arg_key>
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    from spmoe.entrypoints.demo import write_demo_tokenizer
    from spmoe.entrypoints.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("plain_tokenizer")
    write_demo_tokenizer(folder)
    plain = load_tokenizer(folder)
    plain.chat_template = PLAIN_TEMPLATE
    return plain


@pytest.mark.parametrize("template", ["glm", "plain"])
def test_forced_calls_without_a_tool_call_parser(tokenizer, plain_tokenizer, template):
    """A plain `spmoe serve` (no --tool-call-parser) serves `required` and a named function, as vLLM
    does: GLM's call format where the template is GLM's, a JSON list of calls otherwise; the
    output's grammar takes the scripted reply, and the reply comes back as the call, whole and
    streamed, and to LangChain."""
    tok, reply = (tokenizer, GLM_CALL) if template == "glm" else (plain_tokenizer, JSON_CALL)
    engine = AgentEngine(tok)
    engine.reply = reply
    client = _client(engine, tok, ChatOptions())
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        request = dict(model="glm", messages=[USER], tools=[TOOL], tool_choice=tool_choice)
        whole = client.chat.completions.create(**request).choices[0]
        got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert [(n, json.loads(a)) for n, a in got] == [
            ("get_weather", {"city": "Paris", "days": 2})
        ]
        assert (whole.message.content, whole.finish_reason) == (None, "tool_calls")
        assert _streamed(client, **request) == ("", got, "tool_calls")
        grammar = engine.requests[-1].grammar
        assert grammar.kind == ("tool_calls" if template == "glm" else "json_schema")
        matcher = engine.grammars.matcher(grammar).matcher
        assert matcher.accept_string(reply) and matcher.is_completed()
        assert not engine.grammars.matcher(grammar).matcher.accept_string(reply.replace("2", "x"))

    http = TestClient(build_app(engine, tok, ApiSettings(["glm"])))
    chat = ChatOpenAI(model="glm", base_url="http://testserver/v1", api_key="-", http_client=http)
    message = chat.bind_tools([TOOL["function"]], tool_choice="any").invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    engine.reply = reply[: reply.index("Paris") + 2]  # cut by max_tokens
    cut = chat.bind_tools([TOOL["function"]], tool_choice="any").invoke(
        "Weather in Paris?", max_tokens=len(engine.reply)
    )
    assert cut.tool_calls == [] and cut.response_metadata["finish_reason"] == "length"
    (broken,) = cut.invalid_tool_calls
    assert (broken["name"], broken["args"]) == ("get_weather", '{"city": "Pa')
