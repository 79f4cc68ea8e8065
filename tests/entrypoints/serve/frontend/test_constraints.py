"""Request fields -> the grammar their output must follow: every field's spec, the errors for bad
ones, and the GLM tool-call grammar (sampled calls parse with the tool-call parser and validate
against the tool's schema)."""

import json

import jsonschema
import msgspec
import pytest

from spmoe.engine.request import GrammarSpec, ToolCalls
from spmoe.entrypoints.serve.frontend.constraints import grammar_for_request
from spmoe.entrypoints.serve.frontend.parsers.tool_calls import (
    GlmToolCallParser,
    assemble_tool_calls,
)
from tests.engine.test_grammar import sample_batch
from tests.entrypoints.serve.frontend.test_tool_grammar import accepts

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {
                    "direction": {"type": "string", "enum": ["up", "down"]},
                    "steps": {"type": "integer", "minimum": 1, "maximum": 9},
                    "fast": {"type": "boolean"},
                    "label": {"type": "string", "pattern": "[a-z]{1,4}"},
                },
                "required": ["direction", "steps"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}},
    },
    {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {
                    "content": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["content"],
            },
        },
    },
]


@pytest.mark.parametrize(
    "fields, spec",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            GrammarSpec("json_schema", COMPACT),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            GrammarSpec("json_object"),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec("json_schema", COMPACT)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
            GrammarSpec("json_schema", COMPACT),
        ),
        ({"structured_outputs": {"regex": "a+"}}, GrammarSpec("regex", "a+")),
        ({"structured_outputs": {"choice": ["a", "é"]}}, GrammarSpec("choice", '["a", "é"]')),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, GrammarSpec("ebnf", 'root ::= "x"')),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object")),
        ({"guided_json": SCHEMA}, GrammarSpec("json_schema", COMPACT)),
        ({"guided_regex": "[0-9]+"}, GrammarSpec("regex", "[0-9]+")),
        ({"guided_choice": ["x", "y"]}, GrammarSpec("choice", '["x", "y"]')),
        (
            {"guided_grammar": 'root ::= "x"', "guided_json": None},
            GrammarSpec("ebnf", 'root ::= "x"'),
        ),
        ({"tool_choice": "none"}, None),
    ],
)
def test_request_fields_to_grammar(fields, spec):
    output = grammar_for_request(fields, TOOLS)
    assert (output and output.spec) == spec


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "only one of these may constrain the output, got guided_regex, response_format",
        ),
        (
            {"guided_json": SCHEMA, "tool_choice": "required"},
            "only one of these may constrain the output, got guided_json, tool_choice",
        ),
        (
            {"response_format": {"type": "xml"}, "tool_choice": "required"},
            "response_format.type must be 'text', 'json_object' or 'json_schema', got 'xml'",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type must be 'text', 'json_object' or 'json_schema', got 'xml'",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema must be an object with a 'schema', got None",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
            "got ['regex', 'choice']",
        ),
        (
            {"structured_outputs": {}},
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, got none",
        ),
        ({"structured_outputs": "json"}, "structured_outputs must be an object, got str"),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON: Expecting property name"),
        ({"guided_json": [1]}, "guided_json must be a JSON schema object, got list"),
        (
            {"guided_choice": []},
            "guided_choice must be a non-empty list of non-empty strings, got []",
        ),
        ({"guided_regex": ""}, "guided_regex must be a non-empty string, got ''"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice names function 'fly', which is not in 'tools' (move, stop, write)",
        ),
    ],
)
def test_bad_fields(fields, message):
    with pytest.raises(ValueError) as error:
        grammar_for_request(fields, TOOLS)
    assert str(error.value).startswith(message)


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_a_forced_call_is_the_output_beside_response_format(choice):
    """OpenAI's rule: with a forced tool_choice the call is the output, and response_format (even
    strict, with a keyword the grammar cannot enforce) has no message text to constrain."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    forced = {"tool_choice": choice, "parallel_tool_calls": False}
    for response_format in ({"type": "json_object"}, _json_schema_format(schema)):
        with_format = grammar_for_request(forced | {"response_format": response_format}, TOOLS)
        assert with_format == grammar_for_request(forced, TOOLS)
        calls = msgspec.json.decode(with_format.spec.text, type=ToolCalls)
        assert with_format.spec.kind == "tool_calls" and not calls.free_text and calls.tools


ORDERED = {  # properties out of alphabetical order, nested too
    "type": "object",
    "properties": {
        "zeta": {"type": "integer", "minimum": 0, "maximum": 9},
        "mid": {
            "type": "object",
            "properties": {"y": {"type": "boolean"}, "b": {"enum": ["p", "q"]}},
            "required": ["y", "b"],
        },
        "alpha": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["zeta", "mid", "alpha"],
}
SORTED = json.loads(json.dumps(ORDERED, sort_keys=True))


def test_a_schema_compiles_in_its_own_property_order(compiler):
    """Keys come in the schema's order, nested objects too: the same schema with its properties
    sorted is another grammar, which takes the keys sorted."""
    written = '{"zeta": 1, "mid": {"y": true, "b": "p"}, "alpha": 2}'
    alphabetical = '{"alpha": 2, "mid": {"b": "p", "y": true}, "zeta": 1}'
    as_given = grammar_for_request({"guided_json": ORDERED}).spec
    as_sorted = grammar_for_request({"structured_outputs": {"json": SORTED}}).spec
    assert as_given != as_sorted
    for spec, good, bad in ((as_given, written, alphabetical), (as_sorted, alphabetical, written)):
        assert accepts(compiler, spec, good) and not accepts(compiler, spec, bad)
    spaced = {"guided_json": json.dumps(ORDERED, indent=4)}
    assert grammar_for_request(spaced).spec == as_given  # one cache entry for the same schema


def test_required_without_tools():
    with pytest.raises(
        ValueError, match="tool_choice 'required' needs at least one tool in 'tools'"
    ):
        grammar_for_request({"tool_choice": "required"}, [])


def test_bad_argument_schema(compiler):
    """The front end reads the tools; the engine's compile names the tool whose parameters do not
    compile (the client's 400)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}
                },
            },
        }
    ]
    with pytest.raises(
        ValueError,
        match="^tool 'f': parameters do not compile: Invalid range: minimum greater than maximum",
    ):
        compiler.compile(grammar_for_request({"tool_choice": "required"}, tools).spec)


def _calls(tokens: list[int]):
    text = bytes(tokens).decode()  # the demo tokenizer: token t < 256 is byte t
    parser = GlmToolCallParser(TOOLS)
    (content, deltas), (rest, more) = parser.feed(text), parser.flush()
    return text, content + rest, assemble_tool_calls(deltas + more)


def test_tool_choice_grammars_give_calls_that_validate(compiler):
    """Sampled from random logits: `required` with parallel calls gives one or more calls of the
    tools whose arguments (bounded ones: a free string argument would take thousands of random
    tokens) validate; a named choice gives exactly one call of that tool; `parallel_tool_calls:
    false` exactly one."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    bounded = TOOLS[:2]
    specs = [
        grammar_for_request({"tool_choice": "required"}, bounded).spec,
        grammar_for_request(
            {"tool_choice": "required", "parallel_tool_calls": False}, bounded
        ).spec,
        grammar_for_request(
            {"tool_choice": {"type": "function", "function": {"name": "move"}}}, TOOLS
        ).spec,
    ]
    counts = [set(), set(), set()]
    outputs = sample_batch(compiler, [spec for spec in specs for _ in range(5)], seed=5)
    for i, tokens in enumerate(outputs):
        text, content, calls = _calls(tokens)
        kind = i // 5
        assert content == "" and calls, text
        counts[kind].add(len(calls))
        for call in calls:
            assert call.name in ("move", "stop") and (kind < 2 or call.name == "move"), text
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert counts[1] == {1} and counts[2] == {1} and max(counts[0]) > 1


def test_tool_call_grammar_strings(compiler):
    """Free string arguments: any text (`</arg_value>` ends them); JSON values compact; required
    arguments must be there; names must match."""
    spec = grammar_for_request({"tool_choice": "required"}, TOOLS).spec
    accepted = [
        "<tool_call>write<arg_key>content</arg_key><arg_value>a < b, {x} é\n</arg_value></tool_call>",
        "<tool_call>write<arg_key>content</arg_key><arg_value></arg_value><arg_key>tags</arg_key>"
        "<arg_value>[1,2]</arg_value></tool_call><tool_call>stop</tool_call>",
        "<tool_call>write<arg_key>content</arg_key><arg_value>a </b></arg_value></tool_call>",
        "<tool_call>move<arg_key>direction</arg_key><arg_value>up</arg_value><arg_key>steps</arg_key>"
        "<arg_value>3</arg_value><arg_key>label</arg_key><arg_value>ab</arg_value></tool_call>",
    ]
    rejected = [
        "<tool_call>write<arg_key>content</arg_key><arg_value>x</arg_value><arg_key>tags</arg_key>"
        "<arg_value>[1, 2]</arg_value></tool_call>",  # not compact
        "<tool_call>move<arg_key>steps</arg_key><arg_value>3</arg_value></tool_call>",  # direction missing
        "<tool_call>fly</tool_call>",
        "<tool_call>move<arg_key>direction</arg_key><arg_value>left</arg_value>",  # not in the enum
        "<tool_call>move<arg_key>direction</arg_key><arg_value>up</arg_value><arg_key>steps</arg_key>"
        "<arg_value>10</arg_value>",  # above the maximum
        "Sure: <tool_call>stop</tool_call>",  # text before the call
    ]
    for text in accepted:
        grammar = compiler.matcher(spec)
        assert grammar.matcher.accept_string(text) and grammar.matcher.is_completed(), text
    for text in rejected:
        grammar = compiler.matcher(spec)
        assert not (grammar.matcher.accept_string(text) and grammar.matcher.is_completed()), text
