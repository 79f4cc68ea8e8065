"""The keyword policy (schema_policy.py) against what xgrammar really does: for each probe, a
schema, a value valid under it and one that breaks it (both checked with `jsonschema`), and the
keywords the policy says the grammar leaves unenforced. Through both grammars a schema becomes
(response_format's JSON and a tool call's arguments), the grammar accepts the valid value, and
accepts the breaking one exactly when the policy names a keyword: a keyword xgrammar starts (or
stops) enforcing fails here. Then the policy itself: `strict` refuses by name and path, alike for
the five fields; without it the schema is accepted and the keywords come back."""

import json

import jsonschema
import pytest

from spmoe.entrypoints.serve.frontend.constraints import grammar_for_request
from spmoe.entrypoints.serve.frontend.schema_policy import FORMATS, unenforced
from spmoe.entrypoints.serve.frontend.tool_grammar import tool_call_grammar
from tests.entrypoints.serve.frontend.test_tool_grammar import accepts

DEFS = {
    "n": {"type": "integer", "maximum": 3},
    "Cat": {
        "type": "object",
        "properties": {"kind": {"const": "cat", "type": "string"}, "lives": {"type": "integer"}},
        "required": ["kind", "lives"],
    },
    "Dog": {
        "type": "object",
        "properties": {"kind": {"const": "dog", "type": "string"}, "good": {"type": "boolean"}},
        "required": ["kind", "good"],
    },
}
INTS = {"type": "object", "additionalProperties": {"type": "integer"}}
A_OR_B = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
]
UNTAGGED = [  # the tag is not required: {"x": 1} matches both
    {
        "type": "object",
        "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
        "required": ["x"],
    },
    {
        "type": "object",
        "properties": {"k": {"const": "b"}, "x": {"type": "integer"}},
        "required": ["x"],
    },
]
UNION = {
    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    "discriminator": {"propertyName": "kind"},
}
# name: (v's schema, a value valid under it, one that breaks it, the keywords left unenforced)
PROBES = {
    "type": ({"type": "integer"}, 3, "x", []),
    "properties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"a": 1},
        {"a": "x"},
        [],
    ),
    "required": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"a": 1},
        {},
        [],
    ),
    "additionalProperties": (INTS, {"k": 1}, {"k": "x"}, []),
    "items": ({"type": "array", "items": {"type": "integer"}}, [1, 2], ["x"], []),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "string"}], "items": False},
        ["a"],
        [1],
        [],
    ),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1], []),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1], [1, 2], []),
    "enum": ({"enum": ["up", "down"]}, "up", "left", []),
    "enum with its type": ({"enum": ["up", "down"], "type": "string"}, "up", "left", []),
    "const": ({"const": "up"}, "up", "down", []),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, None, []),
    "allOf of one": ({"allOf": [{"type": "integer", "maximum": 3}]}, 3, 4, []),
    "$ref": ({"$ref": "#/$defs/n"}, 3, 4, []),
    "minLength": ({"type": "string", "minLength": 2}, "ab", "a", []),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc", []),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, "ab", "aB", []),
    "format": ({"type": "string", "format": "date"}, "2024-01-31", "tomorrow", []),
    "minimum": ({"type": "integer", "minimum": 2}, 2, 1, []),
    "maximum": ({"type": "number", "maximum": 2.5}, 2.5, 2.6, []),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 2}, 3, 2, []),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 2}, 1, 2, []),
    "multipleOf on integers": ({"type": "integer", "multipleOf": 3}, 6, 4, []),
    "minProperties": ({**INTS, "minProperties": 1}, {"a": 1}, {}, []),
    "maxProperties": ({**INTS, "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}, []),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^a[a-z]*$": {"type": "integer"}}},
        {"ab": 1},
        {"ab": "x"},
        [],
    ),
    "propertyNames": ({**INTS, "propertyNames": {"pattern": "^a[a-z]*$"}}, {"ab": 1}, {"b": 1}, []),
    "unevaluatedProperties": (
        {"type": "object", "unevaluatedProperties": {"type": "integer"}},
        {"b": 1},
        {"b": "x"},
        [],
    ),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
        [1],
        [1, 2],
        [],
    ),
    "a type list's keywords": ({"type": ["integer", "null"], "minimum": 3}, None, 1, []),
    "an object without type": (
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"a": 1},
        {},
        [],
    ),
    "an array without type": ({"items": {"type": "integer"}, "minItems": 2}, [1, 2], [1], []),
    "oneOf of types": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, 1, None, []),
    "oneOf, a discriminated union": (UNION, {"kind": "cat", "lives": 9}, {"kind": "cat"}, []),
    "oneOf by their required properties": ({"oneOf": A_OR_B}, {"a": 1}, {"a": 1, "b": 2}, []),
    # not enforced
    "uniqueItems": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 2],
        [1, 1],
        [("uniqueItems", "")],
    ),
    "uniqueItems of an enum": (
        {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
        ["a", "c"],
        ["a", "a"],
        [],
    ),
    "uniqueItems of an enum's $ref, bounded": (
        {"type": "array", "items": {"$ref": "#/$defs/e"}, "uniqueItems": True, "maxItems": 2},
        [1, 3],
        [3, 3],
        [],
    ),
    "uniqueItems of booleans": (
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
        [True, False],
        [True, True],
        [],
    ),
    "uniqueItems of an enum of too many values": (
        {"type": "array", "items": {"enum": list(range(7))}, "uniqueItems": True},
        [0, 1],
        [1, 1],
        [("uniqueItems", "")],
    ),
    "uniqueItems of an enum beside contains": (
        {
            "type": "array",
            "items": {"enum": ["a", "b"]},
            "uniqueItems": True,
            "contains": {"const": "a"},
        },
        ["a"],
        ["a", "a"],
        [("uniqueItems", ""), ("contains", "")],
    ),
    "not": ({"type": "integer", "not": {"const": 3}}, 1, 3, [("not", "")]),
    "if": (
        {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}},
        6,
        7,
        [("if", ""), ("then", "")],
    ),
    "contains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
        [1, 3],
        [1, 2],
        [("contains", "")],
    ),
    "dependentRequired": (
        {**A_OR_B[0], "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        {"a": 1, "b": 2},
        {"a": 1},
        [("dependentRequired", "")],
    ),
    "dependentSchemas": (
        {
            **A_OR_B[0],
            "properties": {"a": {}, "b": {}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        {"a": 1, "b": 2},
        {"a": 1},
        [("dependentSchemas", "")],
    ),
    "oneOf of overlapping types": (
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        1.5,
        1,
        [("oneOf", "")],
    ),
    "oneOf without a required tag": (
        {"oneOf": UNTAGGED},
        {"k": "a", "x": 1},
        {"x": 1},
        [("oneOf", "")],
    ),
    "allOf of two": ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, 3, 4, [("allOf", "")]),
    "multipleOf on numbers": (
        {"type": "number", "multipleOf": 0.5},
        1.5,
        1.2,
        [("multipleOf", "")],
    ),
    "maxLength beside pattern": (
        {"type": "string", "pattern": "^a+$", "maxLength": 2},
        "aa",
        "aaa",
        [("maxLength", "")],
    ),
    "maxLength beside format": (
        {"type": "string", "format": "email", "maxLength": 6},
        "a@b.co",
        "abc@def.gh",
        [("maxLength", "")],
    ),
    "pattern beside format": (
        {"type": "string", "format": "date", "pattern": "^1"},
        "1999-01-31",
        "2024-01-31",
        [("pattern", "")],
    ),
    "a format the grammar does not know": (
        {"type": "string", "format": "idn-email"},
        "a@b.c",
        "x",
        [("format", "")],
    ),
    "minimum without type": ({"minimum": 3}, 3, 1, [("minimum", "")]),
    "type beside an enum of another type": (
        {"enum": ["a", 1], "type": "string"},
        "a",
        1,
        [("type", "")],
    ),
    "minimum beside anyOf": (
        {"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 3},
        3,
        1,
        [("minimum", "")],
    ),
    "maximum beside $ref": ({"$ref": "#/$defs/n", "maximum": 2}, 2, 3, [("maximum", "")]),
    "in a $ref's schema": (
        {"$ref": "#/$defs/u"},
        [1, 2],
        [1, 1],
        [("uniqueItems", "$defs.u")],
    ),
}
PROBE_DEFS = {**DEFS, "u": PROBES["uniqueItems"][0], "e": {"enum": [1, 2, 3], "type": "integer"}}


def _root(schema: dict) -> dict:
    return {
        "type": "object",
        "properties": {"v": schema},
        "required": ["v"],
        "$defs": PROBE_DEFS,
    }


def _tool(parameters: dict, strict: bool | None = None) -> list[dict]:
    function = {"name": "f", "parameters": parameters, "strict": strict}
    return [{"type": "function", "function": function}]


def _argument(schema: dict, value) -> str:
    """A value as a GLM call writes an argument: a string raw where the schema allows only
    strings, anything else compact JSON."""
    raw = isinstance(value, str) and (
        schema.get("type") == "string" or {"enum", "const"} & set(schema)
    )
    return value if raw else json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("name", PROBES)
def test_the_policy_names_what_xgrammar_leaves_unenforced(compiler, name):
    schema, good, bad, expected = PROBES[name]
    root = _root(schema)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.validate({"v": good}, root, format_checker=checker)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"v": bad}, root, format_checker=checker)
    found = [(u.keyword, u.path) for u in unenforced(root, "schema")]
    where = "schema.properties.v"
    assert found == [(k, f"schema.{at}" if at else where) for k, at in expected]
    json_spec = grammar_for_request({"guided_json": root}).spec
    call = "<tool_call>f<arg_key>v</arg_key><arg_value>{}</arg_value></tool_call>"
    tool_spec = tool_call_grammar(_tool(root), "required", parallel=False).spec
    for spec, text in (
        (json_spec, lambda v: json.dumps({"v": v})),
        (tool_spec, lambda v: call.format(_argument(schema, v))),
    ):
        assert accepts(compiler, spec, text(good)), (spec.kind, good)
        assert accepts(compiler, spec, text(bad)) == bool(expected), (spec.kind, bad)


def test_a_set_of_an_enum_is_written_in_the_enums_order(compiler):
    """The grammar writes a set of an enum's values in the enum's order: another order of the same
    values is refused, as an array of more than `maxItems`."""
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}
    spec = grammar_for_request({"guided_json": _root({**schema, "maxItems": 2})}).spec
    for value, taken in ([], True), (["c"], True), (["b", "c"], True), (["c", "b"], False):
        assert accepts(compiler, spec, json.dumps({"v": value})) == taken, value
    assert not accepts(compiler, spec, json.dumps({"v": ["a", "b", "c"]}))


def test_every_listed_format_is_enforced(compiler):
    for fmt in FORMATS:
        tools = _tool(_root({"type": "string", "format": fmt}))
        spec = tool_call_grammar(tools, "required", parallel=False).spec
        call = "<tool_call>f<arg_key>v</arg_key><arg_value>@@ @@</arg_value></tool_call>"
        assert not accepts(compiler, spec, call), fmt


SET_FIELD = {
    "type": "object",
    "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
}
REFUSED = (
    "strict: true refuses a schema keyword the grammar cannot enforce: 'uniqueItems' at "
    "{}.properties.xs. Remove it, or send strict: false"
)


def _response_format(schema: dict, **strict) -> dict:
    json_schema = {"name": "x", "schema": schema, **strict}
    return {"response_format": {"type": "json_schema", "json_schema": json_schema}}


def test_the_keywords_it_never_enforces_are_named():
    schema = {"type": "integer", "nullable": True, "x-order": 1, "$dynamicRef": "#a"}
    assert [u.keyword for u in unenforced(schema)] == ["nullable", "x-order", "$dynamicRef"]


@pytest.mark.parametrize(
    "schema, where, got",
    [
        ({"type": "objectz"}, "schema.type", "'objectz'"),
        ({"type": ["string", "nul"]}, "schema.type", "'nul'"),
        ({"type": []}, "schema.type", "[]"),
        ({"anyOf": [{"type": "string"}, {"type": 3}]}, "schema.anyOf[1].type", "3"),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/A"}},
                "$defs": {"A": {"type": "x"}},
            },
            "schema.$defs.A.type",
            "'x'",
        ),
    ],
)
def test_a_type_that_names_no_json_type_is_refused_where_it_is(schema, where, got):
    """The front end's check of a schema's syntax: strict or not, before the engine compiles it."""
    with pytest.raises(ValueError) as error:
        unenforced(schema)
    assert str(error.value) == (
        f"{where}: expected one of array, boolean, integer, null, number, object, string (or a "
        f"list of them), got {got}"
    )
    assert unenforced({"type": "object", "properties": {"a": {"type": ["string", "null"]}}}) == []


@pytest.mark.parametrize(
    "fields, tools, where",
    [
        (_response_format(SET_FIELD, strict=True), None, "response_format.json_schema.schema"),
        ({"tool_choice": "required"}, _tool(SET_FIELD, True), "tools[0].function.parameters"),
        ({"tool_choice": "auto"}, _tool(SET_FIELD, True), "tools[0].function.parameters"),
    ],
)
def test_strict_refuses_an_unenforced_keyword_by_name_and_path(fields, tools, where):
    with pytest.raises(ValueError) as error:
        grammar_for_request(fields, tools)
    assert str(error.value).startswith(REFUSED.format(where)), str(error.value)


@pytest.mark.parametrize(
    "fields, where",
    [
        (_response_format(SET_FIELD, strict=False), "response_format.json_schema.schema"),
        (_response_format(SET_FIELD), "response_format.json_schema.schema"),
        ({"guided_json": SET_FIELD}, "guided_json"),
        ({"structured_outputs": {"json": json.dumps(SET_FIELD)}}, "structured_outputs.json"),
    ],
)
def test_without_strict_the_schema_is_accepted_and_the_keyword_named(fields, where):
    output = grammar_for_request(fields)
    assert [str(u) for u in output.unenforced] == [f"'uniqueItems' at {where}.properties.xs"]
    assert json.loads(output.spec.text) == SET_FIELD


@pytest.mark.parametrize(
    "choice", ["required", "auto", {"type": "function", "function": {"name": "f"}}]
)
def test_a_tool_without_strict_is_accepted_and_the_keyword_named(choice):
    output = grammar_for_request({"tool_choice": choice}, _tool(SET_FIELD))
    assert [str(u) for u in output.unenforced] == [
        "'uniqueItems' at tools[0].function.parameters.properties.xs"
    ]
