"""The demo checkpoint's GLM-style chat template: an agent's history (tools, thinking, an assistant
turn with tool calls, the tool's result) renders as GLM lays it out, and thinking can be switched
off."""

import pytest

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I need the tool.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_agent_history(tokenizer):
    text = tokenizer.apply_chat_template(
        HISTORY, tools=[TOOL], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|system|>You may call these functions:\n<tools>\n"
        '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, '
        '"days": {"type": "integer"}}}}\n</tools>\n'
        "To call one, write <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>, "
        "a string value as it is, any other value as JSON.<|end|>"
        "<|system|>Be brief.<|end|><|user|>Weather in Paris?<|end|>"
        "<|assistant|><think>I need the tool.</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|end|>"
        '<|observation|><tool_response>{"temp": 21}</tool_response><|end|>'
        "<|assistant|><think>"
    )


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"thinking": False}])
def test_thinking_off(tokenizer, kwargs):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        HISTORY[1],
    ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert (
        text
        == "<|user|>Hi<|end|><|assistant|></think>Hello<|end|><|user|>Weather in Paris?<|end|><|assistant|></think>"
    )
