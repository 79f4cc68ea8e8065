"""The soak's hostile mix (`benchmarks/soak.py`): seeded calls on the OpenAI routes (`Mix`), and
what a client sees of each one (`send`: one outcome of `soak_check.OUTCOMES`).

Kinds of call, drawn by weight (`WEIGHTS`): whole completions; chat streams read to the end; streams
cut after a few events; slow readers (a pause between lines); `n` > 1 with logprobs; a JSON schema
made for the call (every call's differs: the grammar is new to the server); forced tools (named or
`required`) with schemas made for the call; the Responses API, stored, then continued from the
stored response or read back; long prompts; prompts that share one of a few long heads (the prefix
cache); malformed requests, each with the status it must get. `burst` is a short completion sent
many at once past the server's queue. A whole answer is also checked against what was asked
(`Call.check`: n choices, logprobs, the schema).
"""

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema

import spmoe

HELDOUT = Path(spmoe.__file__).parent / "checkpoints" / "heldout_stdlib.txt"
WORDS = ("alpha", "bravo", "delta", "echo", "gamma", "kilo", "lima", "oscar", "sigma", "tango")
WEIGHTS = {
    "completion": 10,
    "chat_stream": 10,
    "stream_cut": 8,
    "slow_reader": 5,
    "n_logprobs": 8,
    "json_schema": 10,
    "forced_tool": 8,
    "responses": 8,
    "long_prompt": 4,
    "shared_prefix": 10,
    "malformed": 8,
}
ANSWER = ("ok", "refused:503")  # a valid request: answered, or the queue is full
RESPONSE_END = ("response.completed", "response.incomplete", "response.failed")
SHARED_HEADS = 6


@dataclass(frozen=True)
class Call:
    kind: str
    method: str
    path: str
    body: dict | str | None = None  # JSON, or text sent as it is (malformed on purpose)
    stream: bool = False
    choices: int = 1  # a stream ends once this many choices finished
    cut_after: int = 0  # a stream the client leaves after this many events (0: read to the end)
    pause_s: float = 0.0  # between the lines of a stream: a slow reader
    pauses_s: float = 0.0  # what those pauses may add up to (beyond the soak's deadline)
    allowed: tuple[str, ...] = ANSWER
    check: Callable[[dict], str | None] | None = None  # a whole answer -> what is wrong, or None


@dataclass
class Seen:
    """What the client saw: an outcome of `soak_check.OUTCOMES`, the status, a detail, and the
    answer's JSON (a whole body, or a Responses stream's response) when there is one."""

    outcome: str
    status: int | None = None
    detail: str = ""
    answer: dict | None = None
    retry_after_s: float | None = None  # a 503's Retry-After


def schema_for(rng: random.Random, tag: str, properties: int) -> dict:
    """An object schema of up to `properties` bounded properties whose names carry `tag` (so that no
    two calls share a schema)."""
    props = {}
    for i in range(rng.randint(1, properties)):
        props[f"{rng.choice(WORDS)}{tag}{i}"] = rng.choice(
            [
                {"type": "string", "maxLength": rng.randint(1, 10)},
                {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 999)},
                {"type": "boolean"},
                {"enum": rng.sample(WORDS, rng.randint(2, 4))},
                {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": rng.randint(1, 3),
                },
            ]
        )
    required = rng.sample(sorted(props), rng.randint(1, len(props)))
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def follows(schema: dict, text: str) -> str | None:
    """None if `text` is JSON that `schema` accepts, else why not."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def check_choices(n: int, logprobs_key: str | None) -> Callable[[dict], str | None]:
    """A completion's or chat completion's answer has choices 0..n-1, each with a finish_reason and,
    if asked (`logprobs_key`: the field that lists them), logprobs for its tokens."""

    def check(answer: dict) -> str | None:
        choices = answer.get("choices", [])
        if sorted(c.get("index") for c in choices) != list(range(n)):
            return f"expected choices 0..{n - 1}, got {[c.get('index') for c in choices]}"
        for c in choices:
            if c.get("finish_reason") is None:
                return f"choice {c['index']} has no finish_reason"
            if logprobs_key and not (c.get("logprobs") or {}).get(logprobs_key):
                return f"choice {c['index']} has no logprobs"
        return None

    return check


def check_content(schema: dict) -> Callable[[dict], str | None]:
    """A chat answer that stopped on its own follows `schema`."""

    def check(answer: dict) -> str | None:
        choice = answer["choices"][0]
        if choice["finish_reason"] != "stop":
            return None
        return follows(schema, choice["message"]["content"] or "")

    return check


def check_calls(tools: dict[str, dict], named: str | None) -> Callable[[dict], str | None]:
    """A forced call that finished names one of `tools` (`named` if given) with arguments its schema
    accepts."""

    def check(answer: dict) -> str | None:
        choice = answer["choices"][0]
        if choice["finish_reason"] == "length":
            return None
        calls = choice["message"].get("tool_calls") or []
        if choice["finish_reason"] != "tool_calls" or not calls:
            return f"a forced call ended {choice['finish_reason']!r} with {len(calls)} calls"
        for call in calls:
            name = call["function"]["name"]
            if name not in tools or (named is not None and name != named):
                return f"called {name!r}; expected {named or sorted(tools)}"
            wrong = follows(tools[name], call["function"]["arguments"])
            if wrong:
                return f"{name}: {wrong}"
        return None

    return check


class Mix:
    """Calls for a server serving `model` with contexts of `max_model_len` tokens, drawn with the
    caller's seeded `random.Random`. Prompts are slices of the demo checkpoint's held-out text;
    lengths assume up to one token per byte (the demo's byte-level tokenizer), so they fit any
    tokenizer."""

    def __init__(self, model: str, max_model_len: int):
        self.model, self.max_len = model, max_model_len
        self.text = HELDOUT.read_text(encoding="utf-8")
        heads = random.Random(0)
        self.heads = [self.slice(heads, max_model_len * 2 // 5) for _ in range(SHARED_HEADS)]

    def slice(self, rng: random.Random, chars: int) -> str:
        start = rng.randrange(len(self.text) - chars)
        return self.text[start : start + chars]

    def next(self, rng: random.Random, tag: str) -> Call:
        """One call of the mix; `tag`: unique to the call (it names its schema's properties)."""
        kind = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        return getattr(self, kind)(rng, tag)

    def _sampling(self, rng: random.Random) -> dict:
        if rng.random() < 0.4:
            return {"temperature": 0}
        return {"temperature": rng.choice((0.7, 1.0, 1.3)), "seed": rng.randrange(2**31)}

    def _messages(self, rng: random.Random) -> list[dict]:
        return [{"role": "user", "content": self.slice(rng, rng.randint(8, 120))}]

    def completion(self, rng, tag) -> Call:
        body = {
            "model": self.model,
            "prompt": self.slice(rng, rng.randint(4, 200)),
            "max_tokens": rng.randint(1, 48),
            **self._sampling(rng),
        }
        return Call("completion", "POST", "/v1/completions", body, check=check_choices(1, None))

    def chat_stream(self, rng, tag) -> Call:
        body = {
            "model": self.model,
            "messages": self._messages(rng),
            "max_tokens": rng.randint(1, 48),
            "stream": True,
            "stream_options": {"include_usage": rng.random() < 0.5},
            **self._sampling(rng),
        }
        return Call("chat_stream", "POST", "/v1/chat/completions", body, stream=True)

    def stream_cut(self, rng, tag) -> Call:
        chat = rng.random() < 0.5
        body = {
            "model": self.model,
            "max_tokens": rng.randint(100, 400),
            "ignore_eos": True,
            "stream": True,
            **self._sampling(rng),
            **(
                {"messages": self._messages(rng)}
                if chat
                else {"prompt": self.slice(rng, rng.randint(4, 200))}
            ),
        }
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cut = rng.randint(1, 8)
        return Call("stream_cut", "POST", path, body, True, cut_after=cut, allowed=(*ANSWER, "cut"))

    def slow_reader(self, rng, tag) -> Call:
        body = {
            "model": self.model,
            "prompt": self.slice(rng, rng.randint(4, 200)),
            "max_tokens": rng.randint(8, 40),
            "stream": True,
            **self._sampling(rng),
        }
        pause = rng.uniform(0.05, 0.25)
        lines = body["max_tokens"] + 2  # at most a token a line, the finish and [DONE]
        return Call(
            "slow_reader",
            "POST",
            "/v1/completions",
            body,
            True,
            pause_s=pause,
            pauses_s=pause * lines,
        )

    def n_logprobs(self, rng, tag) -> Call:
        n, stream = rng.randint(2, 4), rng.random() < 0.3
        sampling = {"temperature": 1.0, "seed": rng.randrange(2**31), "stream": stream}
        if rng.random() < 0.5:
            body = {
                "model": self.model,
                "prompt": self.slice(rng, rng.randint(4, 120)),
                "max_tokens": rng.randint(1, 24),
                "n": n,
                "logprobs": rng.randint(1, 5),
                "echo": rng.random() < 0.3,
                **sampling,
            }
            path, key = "/v1/completions", "tokens"
        else:
            body = {
                "model": self.model,
                "messages": self._messages(rng),
                "max_tokens": rng.randint(1, 24),
                "n": n,
                "logprobs": True,
                "top_logprobs": rng.randint(0, 5),
                **sampling,
            }
            path, key = "/v1/chat/completions", "content"
        check = None if stream else check_choices(n, key)
        return Call("n_logprobs", "POST", path, body, stream, choices=n, check=check)

    def json_schema(self, rng, tag) -> Call:
        schema = schema_for(rng, tag, 4)
        body = {
            "model": self.model,
            "messages": self._messages(rng),
            "max_tokens": rng.randint(40, 120),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"s{tag}", "schema": schema, "strict": rng.random() < 0.5},
            },
            **self._sampling(rng),
        }
        return Call(
            "json_schema", "POST", "/v1/chat/completions", body, check=check_content(schema)
        )

    def forced_tool(self, rng, tag) -> Call:
        tools = {
            f"{rng.choice(WORDS)}{tag}{i}": schema_for(rng, tag, 2)
            for i in range(rng.randint(1, 2))
        }
        named = rng.choice(sorted(tools)) if rng.random() < 0.5 else None
        choice = {"type": "function", "function": {"name": named}} if named else "required"
        body = {
            "model": self.model,
            "messages": self._messages(rng),
            "max_tokens": rng.randint(40, 120),
            "tools": [
                {"type": "function", "function": {"name": name, "parameters": params}}
                for name, params in tools.items()
            ],
            "tool_choice": choice,
            "parallel_tool_calls": rng.random() < 0.5,
            **self._sampling(rng),
        }
        return Call(
            "forced_tool", "POST", "/v1/chat/completions", body, check=check_calls(tools, named)
        )

    def responses(self, rng, tag) -> Call:
        body = {
            "model": self.model,
            "input": self.slice(rng, rng.randint(8, 120)),
            "max_output_tokens": rng.randint(2, 32),
            "store": rng.random() < 0.8,
            "stream": rng.random() < 0.3,
            **({"instructions": "Be brief."} if rng.random() < 0.3 else {}),
        }
        return Call("responses", "POST", "/v1/responses", body, body["stream"])

    def after_response(self, rng: random.Random, response_id: str) -> list[Call]:
        """Calls on a stored response: continue from it, read it back. Every front end of the
        server finds it (they share one store), whichever made it."""
        calls = []
        if rng.random() < 0.5:
            body = {
                "model": self.model,
                "input": self.slice(rng, rng.randint(8, 60)),
                "max_output_tokens": rng.randint(2, 16),
                "previous_response_id": response_id,
            }
            calls.append(
                Call(
                    "responses_continued",
                    "POST",
                    "/v1/responses",
                    body,
                )
            )
        if rng.random() < 0.3:
            path = f"/v1/responses/{response_id}"
            calls.append(Call("responses_get", "GET", path, allowed=("ok",)))
        return calls

    def long_prompt(self, rng, tag) -> Call:
        budget = self.max_len - 64 - 16  # room for the answer and the drafts
        body = {
            "model": self.model,
            "prompt": self.slice(rng, rng.randint(budget // 2, budget * 9 // 10)),
            "max_tokens": rng.randint(1, 32),
            **self._sampling(rng),
        }
        return Call("long_prompt", "POST", "/v1/completions", body, check=check_choices(1, None))

    def shared_prefix(self, rng, tag) -> Call:
        head, tail = rng.choice(self.heads), self.slice(rng, rng.randint(4, 200))
        if rng.random() < 0.5:
            body = {"model": self.model, "prompt": head + tail}
            path = "/v1/completions"
        else:
            messages = [{"role": "system", "content": head}, {"role": "user", "content": tail}]
            body = {"model": self.model, "messages": messages}
            path = "/v1/chat/completions"
        body.update(max_tokens=rng.randint(1, 32), **self._sampling(rng))
        return Call("shared_prefix", "POST", path, body, check=check_choices(1, None))

    def malformed(self, rng, tag) -> Call:
        method, path, body, status = rng.choice(self.bad_requests())
        return Call("malformed", method, path, body, allowed=(f"refused:{status}",))

    def bad_requests(self) -> list[tuple[str, str, dict | str | None, int]]:
        """(method, path, body, the status it must get)."""
        m, hi = self.model, [{"role": "user", "content": "hi"}]
        one_tool = [
            {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
        ]
        c, chat = "/v1/completions", "/v1/chat/completions"
        return [
            ("POST", c, "{oops", 400),
            ("POST", c, "", 400),
            ("POST", c, "[1, 2]", 400),
            ("POST", c, '{"model": "m", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", 400),
            ("POST", c, '{"model": "' + m + '", "prompt": "\\ud800"}', 400),
            ("POST", c, {"prompt": "hi"}, 400),
            ("POST", chat, {"model": m}, 400),
            ("POST", c, {"model": m + "-nope", "prompt": "hi"}, 404),
            ("POST", c, {"model": m, "prompt": "x" * (self.max_len + 8)}, 400),
            ("POST", c, {"model": m, "prompt": "hi", "max_tokens": 0}, 400),
            ("POST", c, {"model": m, "prompt": "hi", "max_tokens": "16"}, 400),
            ("POST", c, {"model": m, "prompt": "hi", "temperature": -1}, 400),
            ("POST", c, {"model": m, "prompt": "hi", "top_p": 1.01}, 400),
            ("POST", c, {"model": m, "prompt": "hi", "logprobs": 30}, 400),
            ("POST", c, {"model": m, "prompt": "hi", "logit_bias": {"999999999": 1}}, 400),
            ("POST", chat, {"model": m, "messages": hi, "n": 99}, 400),
            ("POST", chat, {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
            (
                "POST",
                chat,
                {
                    "model": m,
                    "messages": hi,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "objectz"}},
                    },
                },
                400,
            ),
            (
                "POST",
                chat,
                {
                    "model": m,
                    "messages": hi,
                    "tools": one_tool,
                    "tool_choice": {"type": "function", "function": {"name": "zz"}},
                },
                400,
            ),
            (
                "POST",
                "/v1/responses",
                {"model": m, "input": "hi", "previous_response_id": "resp_no"},
                400,
            ),
            ("GET", "/v1/responses/resp_no", None, 404),
            ("POST", "/v1/nothing", {}, 404),
            ("GET", c, None, 405),
        ]

    def burst(self, rng: random.Random) -> Call:
        body = {
            "model": self.model,
            "prompt": self.slice(rng, rng.randint(4, 60)),
            "max_tokens": rng.randint(2, 8),
        }
        return Call("burst", "POST", "/v1/completions", body, check=check_choices(1, None))


def error_body(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw)["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        return False


def whole(call: Call, status: int, raw: bytes) -> Seen:
    """A response read to its end -> what it is."""
    if status >= 400:
        if error_body(raw):
            return Seen("refused", status, json.loads(raw)["error"]["message"][:200])
        return Seen("broken", status, f"an error status without an error body: {raw[:200]!r}")
    try:
        answer = json.loads(raw)
    except ValueError:
        return Seen("broken", status, f"a {status} body that is not JSON: {raw[:200]!r}")
    if not isinstance(answer, dict) or answer.get("error"):
        return Seen("broken", status, f"a {status} body that is not an answer: {raw[:200]!r}")
    wrong = call.check(answer) if call.check is not None else None
    if wrong:
        return Seen("wrong", status, wrong, answer)
    return Seen("ok", status, "", answer)


async def read_stream(call: Call, response: httpx.Response) -> Seen:
    """A 200 stream's lines -> what it is: its end (every choice finished, then [DONE]; or a
    Responses stream's final event), an error event, a stream the client leaves (`cut_after`), or
    broken."""
    responses = call.path.startswith("/v1/responses")
    finished: set[int] = set()
    events, end, error, answer = 0, None, None, None
    async for line in response.aiter_lines():
        if not line or line.startswith("event: "):
            continue
        if not line.startswith("data: "):
            return Seen("broken", 200, f"a line that is not server-sent events: {line[:200]!r}")
        data = line.removeprefix("data: ")
        if end is not None:
            return Seen("broken", 200, f"data after the stream's end ({end}): {data[:200]!r}")
        events += 1
        if data == "[DONE]" and not responses:
            end = "[DONE]"
            continue
        try:
            event = json.loads(data)
        except ValueError:
            return Seen("broken", 200, f"an event that is not JSON: {data[:200]!r}")
        if responses:
            kind = event.get("type")
            if kind == "response.created":
                answer = event["response"]
            if kind in RESPONSE_END:
                end, answer = kind, event["response"]
            elif kind == "error":
                end, error = kind, event
        elif "error" in event:
            if error is not None:
                return Seen("broken", 200, "a second error event")
            error = event
        else:
            for choice in event.get("choices", []):
                if choice.get("finish_reason") is not None:
                    if choice["index"] in finished:
                        return Seen("broken", 200, f"choice {choice['index']} finished twice")
                    finished.add(choice["index"])
        if call.cut_after and events >= call.cut_after and end is None:
            return Seen("cut", 200, f"left after {events} events")
        if call.pause_s:
            await asyncio.sleep(call.pause_s)
    if end is None:
        return Seen("broken", 200, f"the stream ended after {events} events without its end")
    if error is not None:
        return Seen("stream_error", 200, json.dumps(error)[:200], answer)
    if not responses and len(finished) != call.choices:
        return Seen(
            "broken", 200, f"[DONE] after {len(finished)} of {call.choices} choices finished"
        )
    return Seen("ok", 200, "", answer)


async def send(client: httpx.AsyncClient, call: Call, request_id: str) -> Seen:
    """Make `call` (with `X-Request-Id: request_id`) -> what the client saw."""
    headers = {"X-Request-Id": request_id}
    content = call.body
    if call.body is not None:
        headers["Content-Type"] = "application/json"
        if not isinstance(call.body, str):
            content = json.dumps(call.body)
    status = None
    try:
        async with client.stream(
            call.method, call.path, content=content, headers=headers
        ) as response:
            status = response.status_code
            if status != 200 or not call.stream:
                seen = whole(call, status, await response.aread())
                if status == 503 and response.headers.get("Retry-After", "").isdigit():
                    seen.retry_after_s = float(response.headers["Retry-After"])
                return seen
            return await read_stream(call, response)
    except httpx.ConnectError as e:
        return Seen("unreachable", None, repr(e)[:200])
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        return Seen("closed", status, repr(e)[:200])
