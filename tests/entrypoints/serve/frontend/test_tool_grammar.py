"""The grammar of GLM tool calls (tool_grammar.py): `auto` constrains only the calls, and calls
sampled under `required` / named grammars from random logits are valid under their schemas (the
keywords it enforces: test_schema_policy.py)."""

import json

import jsonschema

from spmoe.entrypoints.serve.frontend.parsers.json_calls import JsonCallListParser
from spmoe.entrypoints.serve.frontend.parsers.tool_calls import (
    GlmToolCallParser,
    assemble_tool_calls,
)
from spmoe.entrypoints.serve.frontend.tool_grammar import json_call_list_grammar, tool_call_grammar
from tests.engine.test_grammar import sample_batch


def _tool(schema: dict, name: str) -> dict:
    parameters = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def accepts(compiler, spec, text: str) -> bool:
    matcher = compiler.matcher(spec).matcher
    return matcher.accept_string(text) and matcher.is_completed()


def test_auto_constrains_only_the_calls(compiler):
    """`auto`: any text, and each `<tool_call>` in it follows its tool's schema."""
    tools = [
        _tool({"type": "string", "maxLength": 4}, name="look"),
        _tool({"enum": ["a"]}, name="pick"),
    ]
    spec = tool_call_grammar(tools, "auto", parallel=True).spec
    one = "<tool_call>look<arg_key>v</arg_key><arg_value>{}</arg_value></tool_call>"
    assert accepts(compiler, spec, "Just text, <b>no</b> call.")
    assert accepts(compiler, spec, "Let me look." + one.format("Oslo") + one.format("Rome"))
    assert not accepts(compiler, spec, "Let me look." + one.format("Oslo, Norway"))
    assert not accepts(compiler, spec, "<tool_call>fly</tool_call>")
    single = tool_call_grammar(tools, "auto", parallel=False).spec
    assert accepts(compiler, single, one.format("Oslo"))
    assert not accepts(compiler, single, one.format("Oslo") + one.format("Rome"))


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["city", "unit", "days"],
}
PICK = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
    "required": ["n"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "pick", "parameters": PICK}},
]


def test_sampled_forced_calls_follow_their_schemas(compiler):
    """50 calls sampled from random logits under `required` (parallel and not) and a named choice:
    every one parses with the tool-call parser into arguments valid under the tool's schema
    (jsonschema)."""
    schemas = {"get_weather": WEATHER, "pick": PICK}
    named = {"type": "function", "function": {"name": "get_weather"}}
    specs = [
        tool_call_grammar(TOOLS, "required", parallel=True).spec,
        tool_call_grammar(TOOLS, "required", parallel=False).spec,
        tool_call_grammar(TOOLS, named, parallel=True).spec,
    ]
    rows = [specs[i % 3] for i in range(50)]
    valid = 0
    for i, tokens in enumerate(sample_batch(compiler, rows, seed=3)):
        text = bytes(tokens).decode()  # the demo tokenizer: token t < 256 is byte t
        parser = GlmToolCallParser(TOOLS)
        (content, deltas), (rest, more) = parser.feed(text), parser.flush()
        calls = assemble_tool_calls(deltas + more)
        assert content + rest == "" and calls, text
        assert len(calls) == 1 or i % 3 == 0, text
        for call in calls:
            assert i % 3 != 2 or call.name == "get_weather", text
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        valid += 1
    assert valid == 50


def _json_calls(text: str) -> list[tuple[str, str]]:
    _, deltas = JsonCallListParser(TOOLS).flush(cut=True)  # nothing fed: no calls
    assert deltas == []
    parser = JsonCallListParser(TOOLS)
    assert parser.feed(text) == ("", [])  # held until the end
    return [(c.name, c.arguments) for c in assemble_tool_calls(parser.flush(cut=True)[1])]


def test_json_call_lists_read_back_whole_or_visibly_cut():
    two = '[{"name": "pick", "parameters": {"n": 1}}, {"name": "pick", "parameters": {"n": -2}}]'
    assert _json_calls(two) == [("pick", '{"n": 1}'), ("pick", '{"n": -2}')]
    cut = '[{"name": "pick", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa'
    assert _json_calls(cut) == [("pick", "{}"), ("get_weather", '{"city": "Pa')]
    assert _json_calls('[{"name": "pick", "parameters": ') == [("pick", "{")]
    assert _json_calls('[{"name": "get_we') == []


def test_sampled_json_call_lists_follow_their_schemas(compiler):
    """Without --tool-call-parser and a GLM template: 20 JSON lists of calls sampled from random
    logits under `required` (parallel) and a named choice, read back, valid under their tools'
    schemas.
    """
    schemas = {"get_weather": WEATHER, "pick": PICK}
    named = {"type": "function", "function": {"name": "pick"}}
    specs = [
        json_call_list_grammar(TOOLS, "required", parallel=True).spec,
        json_call_list_grammar(TOOLS, named, parallel=True).spec,
    ]
    outputs = sample_batch(compiler, [specs[i % 2] for i in range(20)], seed=4)
    for i, tokens in enumerate(outputs):
        calls = _json_calls(bytes(tokens).decode())
        assert calls and (i % 2 == 0 or [name for name, _ in calls] == ["pick"]), calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
    assert len(outputs) == 20
