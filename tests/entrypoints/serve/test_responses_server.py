"""`POST /v1/responses` on a real `spmoe serve` (CPU, the shipped demo checkpoint, one rank,
`--enable-auto-tool-choice`: conftest's `demo_server`), driven by the `openai` client and
openai-agents: a response's text is the chat completion's for the same conversation and seed, whole
and streamed; `text.format` and a required tool follow their schemas; openai-agents' default Agent +
Runner calls its function tool and ends with the model's answer."""

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest

from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.entrypoints.tokenizer import load_tokenizer
from tests.entrypoints.serve.test_serve import (
    ORDERED,
    SET_FIELD,
    key_order,
    leave_and_check_aborted,
    openai_client,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},  # the demo model writes long numbers
    },
    "required": ["colour", "n"],
    "additionalProperties": False,
}
PICK = {
    "type": "function",
    "name": "pick",
    "description": "Pick a colour",
    "parameters": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"],
    },
}


def test_a_response_is_the_chat_completion_of_its_conversation(demo_server):
    client = openai_client(demo_server)
    system, user = "Be brief.", "Say something"
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=24,
        seed=5,
    )
    chat = reply.choices[0]
    fields = {
        "model": "tiny",
        "instructions": system,
        "input": user,
        "max_output_tokens": 24,
        "extra_body": {"seed": 5},
    }
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        streamed = stream.get_final_response()
    status = "incomplete" if chat.finish_reason == "length" else "completed"
    for response in (whole, streamed):
        assert response.output_text == chat.message.content and response.status == status
        assert (response.usage.input_tokens, response.usage.output_tokens) == (
            reply.usage.prompt_tokens,
            reply.usage.completion_tokens,
        )


def test_text_format_and_a_required_tool_follow_their_schemas(demo_server):
    client = openai_client(demo_server)
    fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    for seed in range(3):
        response = client.responses.create(
            model="tiny",
            input="JSON please",
            text={"format": fmt},
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
    called = client.responses.create(
        model="tiny",
        input="Pick one",
        tools=[PICK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body={"seed": 1},
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed" and call.status == "completed"
    assert call.name == "pick" and json.loads(call.arguments)["colour"] in ("red", "green")


def test_text_format_with_a_forced_tool_the_call_is_the_output(demo_server):
    """instructor's Responses-tools request: a strict text.format whose schema the grammar cannot
    wholly enforce, and the same schema as a tool that tool_choice forces: accepted, as OpenAI
    does; the call is the output. Alone, the strict text.format is a 400 naming the keyword."""
    client = openai_client(demo_server)
    schema = {**SET_FIELD, "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "s", "schema": schema, "strict": True}
    tool = {"type": "function", "name": "s", "parameters": schema}
    for choice in ("required", {"type": "function", "name": "s"}):
        called = client.responses.create(
            model="tiny",
            input="Pick digits",
            text={"format": fmt},
            tools=[tool],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_output_tokens=200,
            extra_body={"seed": 2},
        )
        assert [item.type for item in called.output] == ["function_call"], called.output
        xs = json.loads(called.output[0].arguments)["xs"]
        assert all(0 <= x <= 9 for x in xs) and len(xs) <= 3, xs
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input="x", text={"format": fmt})
    assert "'uniqueItems' at text.format.schema.properties.xs" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(
            model="tiny", input="x", tools=[{**tool, "strict": True}], tool_choice="required"
        )
    assert "'uniqueItems' at tools[0].parameters.properties.xs" in error.value.message


def test_text_format_keys_come_in_the_schemas_order(demo_server):
    client = openai_client(demo_server)
    fmt = {"type": "json_schema", "name": "o", "schema": ORDERED}
    for seed in range(2):
        response = client.responses.create(
            model="tiny", input="JSON", text={"format": fmt}, extra_body={"seed": seed}
        )
        jsonschema.validate(json.loads(response.output_text), ORDERED)
        assert key_order(response.output_text) == ["zeta", "mid", "mid.y", "mid.b", "alpha"]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_default_agent_with_a_function_tool(demo_server, streamed):
    """The first turn must call the tool (ModelSettings' tool_choice "required"); the Runner runs it
    and sends its result back with tool_choice reset to auto, and the model's free text is the final
    output. The Runner fails a turn that the length limit cuts, so the end of turn is made likely
    (`logit_bias` on the eos token: the demo model then ends a free text within a few tokens)."""
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    picked, eos = [], load_tokenizer(CHECKPOINT).eos_token_id

    @function_tool
    def pick(colour: Literal["red", "green"]) -> str:
        """Pick a colour."""
        picked.append(colour)
        return "done"

    async def run():
        client = openai.AsyncOpenAI(base_url=demo_server + "/v1", api_key="unused", max_retries=0)
        set_default_openai_client(client, use_for_tracing=False)
        set_tracing_disabled(True)
        settings = ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            extra_body={"seed": 3, "logit_bias": {str(eos): 10}},
        )
        agent = Agent(
            name="picker", instructions="Pick.", tools=[pick], model="tiny", model_settings=settings
        )
        if not streamed:
            return await Runner.run(agent, "Pick a colour", max_turns=3)
        result = Runner.run_streamed(agent, "Pick a colour", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(picked) == 1 and picked[0] in ("red", "green")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert isinstance(result.final_output, str)
    assert result.final_output == result.new_items[-1].raw_item.content[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_goes_away_aborts_its_response(demo_server, stream):
    body = {"model": "tiny", "input": "abc", "max_output_tokens": 1000, "stream": stream}
    leave_and_check_aborted(demo_server, "/v1/responses", {**body, "ignore_eos": True}, 1000)
