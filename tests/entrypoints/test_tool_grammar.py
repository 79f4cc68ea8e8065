"""The grammar of GLM tool calls (tool_grammar.py): every keyword it claims to enforce is enforced
(a value that breaks it is refused, one that keeps it accepted), a keyword it cannot enforce is
refused by name, and calls sampled under `required` / named grammars from random logits are valid
under their schemas."""

import json

import jsonschema
import pytest

from spmoe.entrypoints.serve.parsers.json_calls import JsonCallListParser
from spmoe.entrypoints.serve.parsers.tool_calls import GlmToolCallParser, assemble_tool_calls
from spmoe.entrypoints.serve.tool_grammar import (
    ENFORCED_KEYWORDS,
    FORMATS,
    json_call_list_grammar,
    tool_call_grammar,
)
from tests.engine.test_grammar import sample_batch

DEFS = {"$defs": {"n": {"type": "integer", "maximum": 3}}}
OLD_DEFS = {"definitions": {"n": {"type": "integer", "maximum": 3}}}
INTS = {"type": "object", "additionalProperties": {"type": "integer"}}
# keyword: (argument v's schema, a value that keeps it, one that breaks it, the parameters' extra)
PROBES = {
    "type": ({"type": "integer"}, "3", "x", {}),
    "properties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        '{"a":1}',
        '{"a":"x"}',
        {},
    ),
    "required": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        '{"a":1}',
        "{}",
        {},
    ),
    "additionalProperties": (INTS, '{"k":1}', '{"k":"x"}', {}),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1,2]", '["x"]', {}),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "string"}], "items": False},
        '["a"]',
        "[1]",
        {},
    ),
    "minItems": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "[1,2]",
        "[1]",
        {},
    ),
    "maxItems": (
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1},
        "[1]",
        "[1,2]",
        {},
    ),
    "enum": ({"enum": ["up", "down"]}, "up", "left", {}),
    "const": ({"const": "up"}, "up", "down", {}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", "null", {}),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 3}]}, "3", "4", {}),
    "$ref": ({"$ref": "#/$defs/n"}, "3", "4", DEFS),
    "$defs": ({"$ref": "#/$defs/n"}, "2", "x", DEFS),
    "definitions": ({"$ref": "#/definitions/n"}, "3", "4", OLD_DEFS),
    "minLength": ({"type": "string", "minLength": 2}, "ab", "a", {}),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc", {}),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, "ab", "aB", {}),
    "format": ({"type": "string", "format": "date"}, "2024-01-31", "tomorrow", {}),
    "minimum": ({"type": "integer", "minimum": 2}, "2", "1", {}),
    "maximum": ({"type": "number", "maximum": 2.5}, "2.5", "2.6", {}),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 2}, "3", "2", {}),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 2}, "1", "2", {}),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4", {}),
    "minProperties": ({**INTS, "minProperties": 1}, '{"a":1}', "{}", {}),
    "maxProperties": ({**INTS, "maxProperties": 1}, '{"a":1}', '{"a":1,"b":2}', {}),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^a[a-z]*$": {"type": "integer"}}},
        '{"ab":1}',
        '{"ab":"x"}',
        {},
    ),
    "propertyNames": (
        {**INTS, "propertyNames": {"pattern": "^a[a-z]*$"}},
        '{"ab":1}',
        '{"b":1}',
        {},
    ),
    "unevaluatedProperties": (
        {"type": "object", "unevaluatedProperties": {"type": "integer"}},
        '{"b":1}',
        '{"b":"x"}',
        {},
    ),
}
NAMED = {"type": "function", "function": {"name": "f"}}


def _tool(schema: dict, extra: dict | None = None, name: str = "f") -> dict:
    parameters = {"type": "object", "properties": {"v": schema}, "required": ["v"], **(extra or {})}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _accepts(compiler, spec, text: str) -> bool:
    matcher = compiler.matcher(spec).matcher
    return matcher.accept_string(text) and matcher.is_completed()


def test_every_enforced_keyword_is_enforced(compiler):
    assert set(PROBES) == ENFORCED_KEYWORDS  # a keyword added to the list needs its probe here
    call = "<tool_call>f<arg_key>v</arg_key><arg_value>{}</arg_value></tool_call>"
    wrong = []
    for keyword, (schema, good, bad, extra) in PROBES.items():
        spec = tool_call_grammar([_tool(schema, extra)], NAMED, parallel=False)
        if not _accepts(compiler, spec, call.format(good)):
            wrong.append(f"{keyword}: refuses {good}")
        if _accepts(compiler, spec, call.format(bad)):
            wrong.append(f"{keyword}: accepts {bad}")
    assert not wrong, wrong


def test_every_listed_format_is_enforced(compiler):
    for fmt in FORMATS:
        spec = tool_call_grammar([_tool({"type": "string", "format": fmt})], NAMED, False)
        call = "<tool_call>f<arg_key>v</arg_key><arg_value>@@ @@</arg_value></tool_call>"
        assert not _accepts(compiler, spec, call), fmt


@pytest.mark.parametrize(
    "schema, message",
    [
        (
            {"not": {"type": "string"}},
            ".properties.v uses 'not', which the tool-call grammar cannot",
        ),
        ({"if": {"type": "string"}, "then": {}}, ".properties.v uses 'if'"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ".properties.v uses 'oneOf'"),
        ({"type": "array", "uniqueItems": True}, ".properties.v uses 'uniqueItems'"),
        ({"type": "array", "contains": {"type": "string"}}, ".properties.v uses 'contains'"),
        ({"type": "integer", "nullable": True}, ".properties.v uses 'nullable'"),
        ({"type": "string", "format": "idn-email"}, ".properties.v has format 'idn-email', which"),
        ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, ".properties.v has 'allOf' with 2"),
        (
            {"type": "array", "items": {"type": "object", "properties": {"a": {"not": {}}}}},
            ".properties.v.items.properties.a uses 'not'",
        ),
    ],
)
def test_a_keyword_it_cannot_enforce_is_refused_by_name(schema, message):
    with pytest.raises(ValueError) as error:
        tool_call_grammar([_tool(schema)], "required", parallel=True)
    assert str(error.value).startswith("tool 'f': parameters" + message), str(error.value)


def test_auto_constrains_only_the_calls(compiler):
    """`auto`: any text, and each `<tool_call>` in it follows its tool's schema."""
    tools = [
        _tool({"type": "string", "maxLength": 4}, name="look"),
        _tool({"enum": ["a"]}, name="pick"),
    ]
    spec = tool_call_grammar(tools, "auto", parallel=True)
    one = "<tool_call>look<arg_key>v</arg_key><arg_value>{}</arg_value></tool_call>"
    assert _accepts(compiler, spec, "Just text, <b>no</b> call.")
    assert _accepts(compiler, spec, "Let me look." + one.format("Oslo") + one.format("Rome"))
    assert not _accepts(compiler, spec, "Let me look." + one.format("Oslo, Norway"))
    assert not _accepts(compiler, spec, "<tool_call>fly</tool_call>")
    single = tool_call_grammar(tools, "auto", parallel=False)
    assert _accepts(compiler, single, one.format("Oslo"))
    assert not _accepts(compiler, single, one.format("Oslo") + one.format("Rome"))


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
        tool_call_grammar(TOOLS, "required", parallel=True),
        tool_call_grammar(TOOLS, "required", parallel=False),
        tool_call_grammar(TOOLS, named, parallel=True),
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
        json_call_list_grammar(TOOLS, "required", parallel=True),
        json_call_list_grammar(TOOLS, named, parallel=True),
    ]
    outputs = sample_batch(compiler, [specs[i % 2] for i in range(20)], seed=4)
    for i, tokens in enumerate(outputs):
        calls = _json_calls(bytes(tokens).decode())
        assert calls and (i % 2 == 0 or [name for name, _ in calls] == ["pick"]), calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
    assert len(outputs) == 20
