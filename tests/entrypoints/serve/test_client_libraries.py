"""instructor, pydantic-ai and litellm, each as its users call it, against a real `spmoe serve` on
the shipped demo checkpoint (CPU, one rank): every mode returns an `Order`, a model with a
discriminated union, a set of an enum, an enum, nested lists, an optional field and a date. The
demo model writes no sensible JSON of its own: the answers are valid because the grammar makes
them so. Each answer's JSON (the tool call's arguments or the message text) is also checked with
`jsonschema` against the schema the library sent, and its keys, nested ones too, come in the
model's field order.

The modes: instructor's default (tools: a named tool_choice), JSON-schema (response_format) and
Responses-tools (a strict text.format beside a forced tool, on /v1/responses); pydantic-ai's
default (an output tool, tool_choice required) and native output (response_format); litellm's
`hosted_vllm/` provider with a pydantic response_format (strict: true)."""

import asyncio
import datetime
import enum
import json
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.entrypoints.serve.test_serve import key_order

SEED, MAX_TOKENS = 1, 1000  # an answer takes 300-500 tokens (a byte each); its bounds cap it
TIMEOUT_S = 1800  # six answers of 300-500 tokens at once, on 2 CPU cores that others share
PROMPT = "Extract the order: a cat, a line of 2, due tomorrow."


class Colour(enum.StrEnum):
    red = "red"
    blue = "blue"


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=1, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Line(pydantic.BaseModel):
    sku: str = pydantic.Field(max_length=3)
    qty: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
    colours: set[Colour]
    colour: Colour
    lines: list[Annotated[list[Line], pydantic.Field(max_length=2)]] = pydantic.Field(max_length=1)
    note: str | None = pydantic.Field(default=None, max_length=3)
    due: datetime.date


async def _instructor_chat(base: str, mode: str):
    """-> (the object, the chat completion) of instructor's client in `mode`."""
    import instructor

    client = instructor.from_openai(_openai(base), mode=instructor.Mode[mode])
    return await client.chat.completions.create_with_completion(
        model="tiny",
        response_model=Order,
        messages=[{"role": "user", "content": PROMPT}],
        max_retries=0,
        max_tokens=MAX_TOKENS,
        seed=SEED,
    )


async def instructor_tools(base: str):
    import instructor

    order, completion = await _instructor_chat(base, "TOOLS")
    (call,) = completion.choices[0].message.tool_calls
    return (
        order,
        call.function.arguments,
        instructor.openai_schema(Order).openai_schema["parameters"],
    )


async def instructor_json_schema(base: str):
    order, completion = await _instructor_chat(base, "JSON_SCHEMA")
    return order, completion.choices[0].message.content, Order.model_json_schema()


async def instructor_responses_tools(base: str):
    import instructor

    client = instructor.from_openai(_openai(base), mode=instructor.Mode.RESPONSES_TOOLS)
    order, response = await client.responses.create_with_completion(
        model="tiny",
        response_model=Order,
        input=PROMPT,
        max_retries=0,
        max_output_tokens=MAX_TOKENS,
        extra_body={"seed": SEED},
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    return order, call.arguments, Order.model_json_schema()


async def pydantic_ai_tool_output(base: str, native: bool = False):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.messages import TextPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=_openai(base)))
    output = NativeOutput(Order) if native else Order
    agent = Agent(model, output_type=output, retries=0)
    # one call: the demo model would write more until max_tokens, which pydantic-ai ignores
    settings = {"max_tokens": MAX_TOKENS, "seed": SEED, "parallel_tool_calls": False}
    result = await agent.run(PROMPT, model_settings=settings)
    kind = TextPart if native else ToolCallPart
    (part,) = [p for m in result.all_messages() for p in m.parts if isinstance(p, kind)]
    text = part.content if native else part.args_as_json_str()
    return result.output, text, Order.model_json_schema()


async def pydantic_ai_native_output(base: str):
    return await pydantic_ai_tool_output(base, native=True)


async def litellm_hosted_vllm(base: str):
    import litellm

    reply = await litellm.acompletion(
        model="hosted_vllm/tiny",
        api_base=base + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": PROMPT}],
        response_format=Order,
        max_tokens=MAX_TOKENS,
        seed=SEED,
        timeout=TIMEOUT_S,
    )
    text = reply.choices[0].message.content
    return Order.model_validate_json(text), text, Order.model_json_schema()


MODES = {
    ask.__name__: ask
    for ask in (
        instructor_tools,
        instructor_json_schema,
        instructor_responses_tools,
        pydantic_ai_tool_output,
        pydantic_ai_native_output,
        litellm_hosted_vllm,
    )
}


def _openai(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def answers(demo_server) -> dict:
    """Every mode's (its object, the JSON it was made from, the schema the library sent) or its
    error, the six asked at once (the server batches them)."""

    async def ask_all() -> list:
        asks = (ask(demo_server) for ask in MODES.values())
        return await asyncio.gather(*asks, return_exceptions=True)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches none at import
        return dict(zip(MODES, asyncio.run(ask_all())))


@pytest.mark.parametrize("mode", MODES)
def test_the_library_gets_a_valid_order(answers, mode):
    """The object is an Order made from the JSON, which the library's schema validates, its keys
    (the union's too) in the model's field order."""
    answer = answers[mode]
    if isinstance(answer, BaseException):
        raise answer
    order, text, schema = answer
    data = json.loads(text)
    assert isinstance(order, Order), order
    jsonschema.validate(data, schema, format_checker=jsonschema.FormatChecker())
    assert Order.model_validate_json(text).model_dump() == order.model_dump()
    keys = key_order(text)
    assert [key for key in keys if key.isidentifier()] == [
        f for f in Order.model_fields if f in data
    ]
    second = "lives" if order.pet.kind == "cat" else "good"
    assert [key for key in keys if key.startswith("pet.")] == ["pet.kind", f"pet.{second}"]
    lines = [key.rsplit(".", 1)[1] for key in keys if key.startswith("lines[")]
    assert lines == ["sku", "qty"] * (len(lines) // 2), lines
