"""The reasoning and tool-call parsers against scripted GLM outputs: the answer written out by hand,
then the same text fed whole, split at every position, one character at a time and in random pieces
must give it."""

import json
import random

import pytest

from spmoe.entrypoints.serve.frontend.parsers.chat_output import ChatOutputParser
from spmoe.entrypoints.serve.frontend.parsers.markers import partial_marker_length
from spmoe.entrypoints.serve.frontend.parsers.reasoning import (
    Glm45ReasoningParser,
    thinking_enabled,
)
from spmoe.entrypoints.serve.frontend.parsers.tool_calls import (
    GlmToolCallParser,
    assemble_tool_calls,
    coalesce_deltas,
    typed_value,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"enum": ["c", "f"]},
                    "detailed": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": ["integer", "string"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_config",
            "parameters": {
                "type": "object",
                "properties": {
                    "options": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "ratio": {"type": "number"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
FILE_TEXT = 'line1\n"quoted" <b>bold</b> é\t\\ </arg_val'  # JSON escapes, tags that are not ours, a near-miss

# (name, prompt's end, thinking, generated text, reasoning, content, [(tool name, arguments)])
SCRIPTS = [
    (
        "reasoning opened by the prompt",
        "<|assistant|><think>",
        True,
        "Let me think.\nIt is 4.</think>\n\nThe answer is 4.",
        "Let me think.\nIt is 4.",
        "The answer is 4.",
        [],
    ),
    (
        "reasoning opened by the model",
        "<|assistant|>",
        True,
        "\n<think>plan: 1 < 2 </th </think>answer",
        "plan: 1 < 2 </th ",
        "answer",
        [],
    ),
    (
        "no reasoning block",
        "<|assistant|>",
        True,
        "plain <thi answer <think>x",
        "",
        "plain <thi answer <think>x",
        [],
    ),
    ("thinking off", "<|assistant|></think>", False, "x</think>y", "", "x</think>y", []),
    (
        "cut inside the reasoning",
        "<think>",
        True,
        "still thinking </thi",
        "still thinking </thi",
        "",
        [],
    ),
    ("empty reasoning", "<|assistant|>", True, "<think></think>\nhi", "", "hi", []),
    (
        "glm47 call after text",
        "</think>",
        False,
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>units</arg_key><arg_value>c</arg_value></tool_call>",
        "",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3, "units": "c"})],
    ),
    (
        "glm45 parallel calls with newlines",
        "</think>",
        False,
        "I'll call two tools.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
        "<arg_key>detailed</arg_key>\n<arg_value>true</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
        "",
        "I'll call two tools.",
        [("get_weather", {"city": "New York", "detailed": True}), ("get_time", {})],
    ),
    (
        "no arguments",
        "</think>",
        False,
        "<tool_call>get_time</tool_call>",
        "",
        "",
        [("get_time", {})],
    ),
    (
        "string escapes and tag-like text in a value",
        "</think>",
        False,
        f"<tool_call>write_file<arg_key>path</arg_key><arg_value>/tmp/a.txt</arg_value>"
        f"<arg_key>content</arg_key><arg_value>{FILE_TEXT}</arg_value></tool_call>",
        "",
        "",
        [("write_file", {"path": "/tmp/a.txt", "content": FILE_TEXT})],
    ),
    (
        "typed values",
        "</think>",
        False,
        '<tool_call>set_config<arg_key>options</arg_key><arg_value>{"a": [1, 2], "b": null}</arg_value>'
        '<arg_key>tags</arg_key><arg_value>["x", "y"]</arg_value><arg_key>ratio</arg_key><arg_value>0.25</arg_value>'
        "<arg_key>note</arg_key><arg_value>null</arg_value></tool_call>"
        "<tool_call>write_file<arg_key>mode</arg_key><arg_value>755</arg_value></tool_call>"
        "<tool_call>write_file<arg_key>mode</arg_key><arg_value>rw</arg_value></tool_call>",
        "",
        "",
        [
            (
                "set_config",
                {
                    "options": {"a": [1, 2], "b": None},
                    "tags": ["x", "y"],
                    "ratio": 0.25,
                    "note": None,
                },
            ),
            ("write_file", {"mode": 755}),
            ("write_file", {"mode": "rw"}),
        ],
    ),
    (
        "text after a call",
        "</think>",
        False,
        "<tool_call>get_time</tool_call>\n\nDone: <b>ok</b>",
        "",
        "Done: <b>ok</b>",
        [("get_time", {})],
    ),
    (
        "unknown tool and keys",
        "</think>",
        False,
        "<tool_call>mystery<arg_key>n</arg_key><arg_value>42</arg_value><arg_key>s</arg_key>"
        "<arg_value>hi there</arg_value></tool_call>",
        "",
        "",
        [("mystery", {"n": 42, "s": "hi there"})],
    ),
    (
        "reasoning then a call",
        "<|assistant|><think>",
        True,
        "need the weather <tool_call> maybe</think>\n<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Oslo</arg_value></tool_call>",
        "need the weather <tool_call> maybe",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "content ending like a tag",
        "</think>",
        False,
        "a <b> c <tool_ca",
        "",
        "a <b> c <tool_ca",
        [],
    ),
]


def _parser(prompt_end: str, thinking: bool) -> ChatOutputParser:
    return ChatOutputParser.build(
        "glm45", "glm47", f"<|user|>hi<|end|>{prompt_end}", thinking, TOOLS
    )


def _run(prompt_end: str, thinking: bool, chunks: list[str], cut: bool = False):
    """Feed the chunks (`cut`: by the length limit) -> (reasoning, content, calls as (name,
    arguments text), the deltas)."""
    parser = _parser(prompt_end, thinking)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.flush(cut)]
    tool_deltas = [d for delta in deltas for d in delta.tool_calls]
    calls = assemble_tool_calls(tool_deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning, content, [(c.name, c.arguments) for c in calls], tool_deltas


def _splits(text: str, seed: int) -> list[list[str]]:
    """Every cut into two, one character at a time, and 30 random cuts into pieces of 1 to 6
    characters."""
    ways = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(seed)
    for _ in range(30):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i : i + n])
            i += n
        ways.append(pieces)
    return ways


@pytest.mark.parametrize("script", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_scripted_output_at_every_split(script):
    name, prompt_end, thinking, text, reasoning, content, calls = script
    whole_reasoning, whole_content, whole_calls, _ = _run(prompt_end, thinking, [text])
    assert (whole_reasoning, whole_content) == (reasoning, content)
    assert [(n, json.loads(args)) for n, args in whole_calls] == calls
    for value_types in ([type(v) for v in json.loads(a).values()] for _, a in whole_calls):
        assert float not in value_types or name == "typed values"  # 3 stays an int, not 3.0
    for chunks in _splits(text, seed=len(text)):
        assert _run(prompt_end, thinking, chunks)[:3] == (reasoning, content, whole_calls), (
            name,
            chunks,
        )


CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
CUT_SCRIPTS = [  # (name, text cut by the length limit, content, calls: (name, arguments text))
    ("in a string value", CALL[:-7], "", [("get_weather", '{"city": "Oslo')]),
    ("in a string value's end tag", CALL[:-4], "", [("get_weather", '{"city": "Oslo')]),
    ("in the name", "Sure.\n<tool_call>get_we", "Sure.", []),
    ("in the call's tag", "Sure. <tool_c", "Sure.", []),
    ("after the name", "<tool_call>get_weather<arg_", "", [("get_weather", "{")]),
    ("in a key", "<tool_call>get_weather<arg_key>ci", "", [("get_weather", '{"ci')]),
    (
        "before a value",
        CALL + "<arg_key>days</arg_key><arg_v",
        "",
        [("get_weather", '{"city": "Oslo", "days": ')],
    ),
    (
        "in a typed value",
        CALL + "<arg_key>days</arg_key><arg_value>1</arg_v",
        "",
        [("get_weather", '{"city": "Oslo", "days": 1')],
    ),
    ("before the call's end", CALL + "</tool_ca", "", [("get_weather", '{"city": "Oslo"')]),
    (
        "a whole call, then a cut one",
        CALL + "</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Ber",
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Ber')],
    ),
]


@pytest.mark.parametrize("script", CUT_SCRIPTS, ids=[s[0] for s in CUT_SCRIPTS])
def test_a_cut_call_stays_broken_at_every_split(script):
    """A generation cut by the length limit: a call keeps its arguments as generated, never closed
    (the JSON does not parse, so clients see the call broken); a call without its whole name is no
    call; no cut-off tag in the content. Any split of the text gives the same."""
    name, text, content, calls = script
    for chunks in [[text], *_splits(text, seed=len(text))]:
        assert _run("</think>", False, chunks, cut=True)[:3] == ("", content, calls), chunks
    for _, arguments in calls[len(calls) - 1 :]:
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)


def test_tool_call_deltas_in_openai_shape():
    """The first delta of each call names it; the rest carry only arguments; the `openai` client's
    own stream accumulator rebuilds the message from them."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    text = SCRIPTS[7][3]  # two parallel calls
    *_, deltas = _run("</think>", False, list(text))
    firsts = [d for d in deltas if d.name is not None]
    assert [d.index for d in firsts] == [0, 1] and all(d.id.startswith("call_") for d in firsts)
    assert len({d.id for d in firsts}) == 2
    for d in deltas:
        shape = d.as_openai()
        assert set(shape) == (
            {"index", "id", "type", "function"} if d.name else {"index", "function"}
        )
    state = ChatCompletionStreamState()
    for i, d in enumerate(deltas):
        chunk = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [
                {"index": 0, "delta": {"tool_calls": [d.as_openai()]}, "finish_reason": None}
            ],
        }
        if i == len(deltas) - 1:
            chunk["choices"][0]["finish_reason"] = "tool_calls"
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    rebuilt = [
        (c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
    ]
    assert rebuilt == [
        (firsts[0].id, "get_weather", {"city": "New York", "detailed": True}),
        (firsts[1].id, "get_time", {}),
    ]


def test_string_arguments_stream_before_the_call_closes():
    """A long string value is sent as it arrives: fed up to just before its `</arg_value>`, the
    arguments sent already hold all of it, escaped, but for its last characters `</arg_val`, which
    could be the end tag."""
    text = SCRIPTS[9][3]
    value_end = text.index("</arg_value></tool_call>")
    parser = _parser("</think>", False)
    sent, seen_growth = "", 0
    for i, ch in enumerate(text[:value_end]):
        before = len(sent)
        sent += "".join(d.arguments for d in parser.feed(ch).tool_calls)
        seen_growth += len(sent) > before and i > text.index("<arg_key>content")
    sent_value = json.dumps(FILE_TEXT[: -len("</arg_val")], ensure_ascii=False)[1:-1]
    assert sent == '{"path": "/tmp/a.txt", "content": "' + sent_value
    assert seen_growth > len(FILE_TEXT) // 2  # piece by piece, not in one lump


def test_typed_value_rules():
    assert typed_value("3", {"type": "integer"}) == 3 and isinstance(
        typed_value("3", {"type": "number"}), int
    )
    assert typed_value("2.5", {"type": "number"}) == 2.5
    assert (
        typed_value("True", {"type": "boolean"}) is True
        and typed_value("false", {"type": "boolean"}) is False
    )
    assert typed_value("[1, 2]", {"type": ["array", "string"]}) == [1, 2]
    assert (
        typed_value("12", {"type": ["boolean", "string"]}) == "12"
    )  # 12 is no boolean; the string is kept
    assert typed_value("not json", {"type": "object"}) == "not json"  # a model's slip stays visible
    assert typed_value('{"k": 1}', {}) == {"k": 1}


def test_calls_are_not_read_without_tools_or_a_parser():
    text = "<tool_call>get_time</tool_call>"
    for parser in (
        ChatOutputParser.build(
            "glm45", "glm47", "</think>", False, None
        ),  # tool_choice none / no tools
        ChatOutputParser.build(None, None, "", True, TOOLS),
    ):
        out = parser.parse(text)
        assert (out.reasoning, out.content, out.tool_calls) == ("", text, [])
    thinking = ChatOutputParser.build(None, "glm47", "<think>", True, TOOLS).parse("a</think>b")
    assert (thinking.reasoning, thinking.content) == (
        "",
        "a</think>b",
    )  # no reasoning parser: all content


def test_thinking_switch():
    assert thinking_enabled({}) is True
    assert (
        thinking_enabled({"enable_thinking": False}) is False
        and thinking_enabled({"thinking": False}) is False
    )
    with pytest.raises(ValueError, match="enable_thinking must be true or false, got 'no'"):
        thinking_enabled({"enable_thinking": "no"})
    assert (
        Glm45ReasoningParser("<think>", thinking=False).feed("a</think>b").content == "a</think>b"
    )


def test_partial_marker_length():
    assert partial_marker_length("abc</th", ["</think>"]) == 4
    assert (
        partial_marker_length("abc</think>", ["</think>"]) == 0
    )  # a whole marker is found, not held
    assert (
        partial_marker_length("x<", ["<a>", "stop"]) == 1
        and partial_marker_length("st", ["<a>", "stop"]) == 2
    )
    assert partial_marker_length("", ["<a>"]) == 0


def test_tool_parser_alone_holds_whitespace_before_a_call():
    parser = GlmToolCallParser(TOOLS)
    assert parser.feed("Sure \n") == ("Sure", [])
    content, deltas = parser.feed("<tool_call>get_time</tool_call>")
    assert content == "" and [d.arguments for d in deltas] == ["", "{}"]
    assert parser.flush() == ("", [])


def test_coalesced_deltas_make_the_same_calls():
    *_, deltas = _run("</think>", False, list(SCRIPTS[7][3]))
    merged = coalesce_deltas(deltas)
    assert len(merged) == 2 and [d.name for d in merged] == ["get_weather", "get_time"]
    assert assemble_tool_calls(merged) == assemble_tool_calls(deltas)
