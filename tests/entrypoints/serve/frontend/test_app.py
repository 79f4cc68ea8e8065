"""The HTTP front end in one process: the incremental detokenizer, stop strings, and the app's
routes driven by the real `openai` client against a scripted stand-in for the engine client (the
real engine behind the real server is tested in test_serve.py): every request field reaches the
engine request as it should, batches of prompts and n give their choices, logprobs come out in the
completions and chat shapes (whole and streamed), echo, the vLLM routes and headers, unknown fields
logged once, the metrics' vLLM names; the limits on what a client sends, the API key, and how
serving ends (a drain, a stalled engine) through `supervise`."""

import asyncio
import json
import logging
import signal
import threading

import openai
import pytest
from fastapi.testclient import TestClient

from spmoe.engine.request import DraftCounts, EngineMetrics, RequestOutput
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.frontend.app import ApiSettings, build_app
from spmoe.entrypoints.serve.frontend.chat import ChatOptions
from spmoe.entrypoints.serve.frontend.engine_client import QueueFull
from spmoe.entrypoints.serve.frontend.middleware import FrontEndLimits
from spmoe.entrypoints.serve.frontend.streaming import StopStrings
from spmoe.entrypoints.serve.frontend.supervisor import StopPolicy, supervise
from spmoe.entrypoints.serve.frontend.tokenizer import (
    IncrementalDetokenizer,
    TokenTexts,
    read_chat_template,
)
from spmoe.entrypoints.tokenizer import load_tokenizer

REPLY = "Grüße, wörld € 🙂 and more"  # 2-, 3- and 4-byte characters: split over byte tokens


def test_detokenizer_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(REPLY)
    assert len(ids) == len(REPLY.encode())  # one token per byte
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == REPLY
    assert all("\ufffd" not in p for p in pieces)
    first_multibyte = REPLY.encode().index("ü".encode())
    assert pieces[first_multibyte] == "" and pieces[first_multibyte + 1] == "ü"
    emoji = REPLY.encode().index("🙂".encode())
    assert pieces[emoji : emoji + 4] == ["", "", "", "🙂"]


def test_detokenizer_lets_an_unfinished_character_out_at_the_end(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer.encode("ab") + list("€".encode())[:2]) == ""
    assert detok.flush() == "ab\ufffd"


def test_token_texts_decode_each_id_once_as_decode_does(tokenizer):
    """Every id's text as `decode([id])` gives it (a lone byte of a longer character is U+FFFD, a
    special token its name), the ids not seen before decoded in one batched call, each id at most
    once."""
    calls = []

    class Counting:
        def batch_decode(self, sequences):
            calls.append(sequences)
            return tokenizer.batch_decode(sequences)

    texts = TokenTexts(Counting())
    every = list(range(len(tokenizer)))
    assert texts([65, 195, 65, tokenizer.eos_token_id]) == ["A", "\ufffd", "A", "<|end|>"]
    assert calls == [[[65], [195], [tokenizer.eos_token_id]]]
    assert texts(every[::-1]) == [tokenizer.decode([t]) for t in every[::-1]]
    assert len(calls) == 2 and sorted(t for (t,) in calls[1]) == sorted(
        set(every) - {65, 195, tokenizer.eos_token_id}
    )
    assert texts([7, 65]) == [tokenizer.decode([7]), "A"] and len(calls) == 2


def test_stop_strings_hold_back_a_possible_start():
    stops = StopStrings(["STOP", "xyz"])
    assert stops.feed("hello S") == ("hello ", False)
    assert stops.feed("T") == ("", False)
    assert stops.feed("ART x") == ("START ", False)
    assert stops.feed("yz tail") == ("", True)
    other = StopStrings(["STOP"])
    assert other.feed("abST") == ("ab", False)
    assert other.flush() == "ST"


def test_the_earliest_stop_string_wins():
    """Several stop strings in the text: it ends before the one that comes first in the text,
    whichever comes first in the list, within one piece and across pieces."""
    assert StopStrings(["xyz", "STOP", "b"]).feed("a STOP b xyz") == ("a ", True)
    assert StopStrings(["b", "STOP"]).feed("a STOP b") == ("a ", True)
    split = StopStrings(["late", "ST"])
    assert split.feed("one S") == ("one ", False)
    assert split.feed("T late") == ("", True)


class ScriptedEngineClient:
    """Stands in for EngineClient: every request gets the tokens of `script` (then `length` at
    max_new_tokens, or `stop` after an eos id), `per_step` at a time; it records the requests it got
    and those whose output iterator was closed before the end (the real client aborts those)."""

    max_model_len, vocab_size, num_speculative_tokens, error = 66, 264, 2, None
    exchange_s, idle_s = 0.125, 2.5  # the engine process's seconds on the exchange, idle

    def __init__(self, script: list[int], eos_token_ids=(), per_step=1):
        self.script, self.eos_token_ids, self.per_step = script, eos_token_ids, per_step
        self.requests, self.closed_early, self.queue_full = [], [], False
        self.step_s = 0.0  # how long each step takes
        self.stalled_s = 0.0  # what `stalled_for` says
        self.failure: Exception | None = None  # raised by `generate` if set
        # the output after the first ends the request with this error
        self.ends_with_error: str | None = None
        self.preemptions = 0

    def stalled_for(self) -> float:
        return self.stalled_s

    def fail(self, reason: str) -> None:
        self.error = reason

    async def generate(self, request):
        if self.queue_full:
            raise QueueFull("8 requests are waiting (--max-num-waiting 8)")
        if self.failure is not None:
            raise self.failure
        if not request.prompt:
            raise ValueError("the prompt is empty")
        self.requests.append(request)
        made, finished = [], False
        try:
            while not finished:
                await asyncio.sleep(self.step_s)
                if self.ends_with_error is not None and made:
                    finished = True
                    yield RequestOutput(request.request_id, [], "error", error=self.ends_with_error)
                    break
                new = self.script[len(made) : len(made) + self.per_step][
                    : request.max_new_tokens - len(made)
                ]
                made += new
                reason = None
                if any(t in request.eos_token_ids for t in new):
                    new = new[
                        : next(i for i, t in enumerate(new) if t in request.eos_token_ids) + 1
                    ]
                    reason = "stop"
                elif len(made) == request.max_new_tokens:
                    reason = "length"
                finished = reason is not None
                out = RequestOutput(
                    request.request_id,
                    new,
                    reason,
                    prompt_tokens=len(request.prompt),
                    stop_token=new[-1] if reason == "stop" else None,  # as the engine names it
                )
                if request.sampling.logprobs is not None:  # made-up values the tests can recognise
                    out.logprobs = [
                        (-t / 100, [(t, -t / 100), (7, -7.0)][: request.sampling.logprobs])
                        for t in new
                    ]
                if request.sampling.prompt_logprobs is not None and len(made) == len(new):
                    out.prompt_logprobs = [None] + [(-0.5, [(t, -0.5)]) for t in request.prompt[1:]]
                yield out
        finally:
            if not finished:
                self.closed_early.append(request.request_id)

    def metrics(self):
        return EngineMetrics(
            running=1,
            waiting=2,
            kv_cache_usage=0.25,
            generated_tokens=7,
            draft_proposed=4,
            draft_accepted=3,
            prefix_cache_queries=40,
            prefix_cache_hits=30,
            preemptions=self.preemptions,
            drafts=2,
            accepted_per_position=[2, 1],
            by_source={
                "mtp": DraftCounts(
                    drafts=1, proposed=3, accepted=1, accepted_per_position=[1, 0], chosen=1
                ),
                "ngram": DraftCounts(
                    drafts=1, proposed=1, accepted=2, accepted_per_position=[1, 1], chosen=1
                ),
                "none": DraftCounts(accepted_per_position=[0, 0], chosen=4),
            },
            request_tables={"scheduler_requests": 3, "block_tables": 1},
        )


@pytest.fixture
def served(tokenizer):
    """-> (engine stand-in, openai client, raw HTTP client) for a server named 'tiny' that replies
    REPLY."""
    engine = ScriptedEngineClient(tokenizer.encode(REPLY) + [tokenizer.eos_token_id])
    http = TestClient(
        build_app(engine, tokenizer, ApiSettings(["tiny"])), raise_server_exceptions=False
    )
    return (
        engine,
        openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        ),
        http,
    )


def test_completion_and_chat_whole_and_streamed(served, tokenizer):
    engine, client, _ = served
    whole = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=60, temperature=0, seed=3
    )
    assert whole.choices[0].text == REPLY and whole.choices[0].finish_reason == "stop"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        2,
        len(REPLY.encode()) + 1,
    )
    request = engine.requests[-1]
    assert request.prompt == tokenizer.encode("Hi") and request.max_new_tokens == 60
    assert (request.sampling.temperature, request.sampling.seed) == (0, 3)
    assert request.eos_token_ids == (tokenizer.eos_token_id,)

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hi",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY.encode()[:5].decode(
        errors="replace"
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}]
    )
    assert chat.choices[0].message.content == REPLY and chat.choices[0].message.role == "assistant"
    assert engine.requests[-1].prompt == tokenizer.encode(
        "<|user|>Hello<|end|><|assistant|><think>"
    )
    assert (
        engine.requests[-1].max_new_tokens == 66 - 2 - chat.usage.prompt_tokens
    )  # default: the room left
    assert (
        engine.requests[-1].sampling.temperature == 1.0
    )  # OpenAI's default, on a speculating server too
    stream = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(deltas) == REPLY and all("\ufffd" not in d for d in deltas)
    assert stream[-1].choices[0].finish_reason == "stop" and engine.closed_early == []


def test_several_tokens_per_step(tokenizer):
    engine = ScriptedEngineClient(tokenizer.encode(REPLY), per_step=3)  # accepted MTP drafts
    client = openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        max_retries=0,
        http_client=TestClient(build_app(engine, tokenizer, ApiSettings(["tiny"]))),
    )
    chunks = list(
        client.completions.create(model="tiny", prompt=[5, 6], max_tokens=20, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == REPLY.encode()[:20].decode(
        errors="replace"
    )
    engine.num_speculative_tokens = 0
    client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2)
    assert engine.requests[-1].sampling.temperature == 1  # OpenAI's default


def streamed_with(tokenizer, per_step: int) -> dict:
    """Streamed completions and chat (logprobs, usage) of REPLY with `per_step` tokens an output: what
    the engine client gives a stream that fell behind (steps merged) or one that speculates."""
    engine = ScriptedEngineClient(tokenizer.encode(REPLY) + [tokenizer.eos_token_id], (), per_step)
    client = openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        max_retries=0,
        http_client=TestClient(build_app(engine, tokenizer, ApiSettings(["tiny"]))),
    )
    usage = {"include_usage": True, "continuous_usage_stats": True}
    completion = list(
        client.completions.create(
            model="tiny", prompt="Hi", max_tokens=20, logprobs=1, stream=True, stream_options=usage
        )
    )
    chat = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    got = {
        "chunks": (len(completion), len(chat)),
        "text": "".join(c.choices[0].text for c in completion if c.choices),
        "logprobs": [
            (t, lp, off)
            for c in completion
            if c.choices
            for t, lp, off in zip(
                c.choices[0].logprobs.tokens,
                c.choices[0].logprobs.token_logprobs,
                c.choices[0].logprobs.text_offset,
            )
        ],
        # the finish_reasons given, and whether the last chunk with a choice gave the last
        "finishes": [c.choices[0].finish_reason for c in completion if c.choices],
        "usage": [c.usage.completion_tokens for c in completion][-1],
        "chat": "".join(c.choices[0].delta.content or "" for c in chat if c.choices),
        "chat_logprobs": [
            (e.token, e.logprob)
            for c in chat
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ],
        "chat_finishes": [c.choices[0].finish_reason for c in chat if c.choices],
        "chat_usage": chat[-1].usage.completion_tokens,
    }
    for key in ("finishes", "chat_finishes"):  # None but in the last chunk with a choice
        assert all(f is None for f in got[key][:-1]), got[key]
        got[key] = got[key][-1]
    return got


def test_several_tokens_an_output_stream_as_one_token_an_output_does(tokenizer):
    """Text, logprobs (token by token, with their offsets), usage and the one finish_reason of a
    stream are the same whether each output carries one token or four."""
    one, four = streamed_with(tokenizer, 1), streamed_with(tokenizer, 4)
    assert four["chunks"][0] < one["chunks"][0] and four["chunks"][1] < one["chunks"][1]
    assert one["text"] == REPLY.encode()[:20].decode(errors="replace")
    assert one["chat"] == REPLY
    ids = tokenizer.encode(REPLY)
    assert [lp for _, lp, _ in one["logprobs"]] == [-t / 100 for t in ids[:20]]
    assert (one["finishes"], one["chat_finishes"]) == ("length", "stop")
    assert (one["usage"], one["chat_usage"]) == (20, len(ids) + 1)
    assert {k: v for k, v in four.items() if k != "chunks"} == {
        k: v for k, v in one.items() if k != "chunks"
    }


def test_ignore_eos_generates_max_tokens(served, tokenizer):
    engine, client, _ = served
    engine.script = [tokenizer.eos_token_id] * 3 + tokenizer.encode("abc")
    whole = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert engine.requests[-1].eos_token_ids == ()
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("ab", "length")


def test_stop_string_truncates_and_aborts(served):
    engine, client, _ = served
    whole = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=60, stop=["wörld", "nothing"]
    )
    assert whole.choices[0].text == "Grüße, " and whole.choices[0].finish_reason == "stop"
    assert engine.closed_early == [engine.requests[-1].request_id]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], stop="€", stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Grüße, wörld "
    assert chunks[-1].choices[0].finish_reason == "stop" and len(engine.closed_early) == 2


def test_models_health_metrics(served):
    engine, client, http = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert http.get("/health").status_code == 200
    client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
    engine.preemptions = 5
    text = http.get("/metrics").text
    for line in (
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 5.0',
        'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25',
        'vllm:generation_tokens_total{engine="0",model_name="tiny"} 7.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 40.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 30.0',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 2.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 1.0',
        'spmoe:spec_decode_num_drafts_total{draft_source="ngram",engine="0",model_name="tiny"} 1.0',
        'spmoe:spec_decode_num_draft_tokens_total{draft_source="mtp",engine="0",model_name="tiny"} 3.0',
        'spmoe:spec_decode_num_accepted_tokens_total{draft_source="ngram",engine="0",model_name="tiny"} 2.0',
        'spmoe:spec_decode_num_led_total{draft_source="none",engine="0",model_name="tiny"} 4.0',
        "spmoe:spec_decode_num_accepted_tokens_per_pos_total"
        '{draft_source="ngram",engine="0",model_name="tiny",position="1"} 1.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 1.0',
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"} 3.0',
        'vllm:request_time_per_output_token_seconds_count{engine="0",model_name="tiny"} 1.0',
        'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 1.0',
        'vllm:request_prompt_tokens_sum{engine="0",model_name="tiny"} 2.0',
        'vllm:request_generation_tokens_sum{engine="0",model_name="tiny"} 4.0',
        'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 2.0',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0',
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0',
        'vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} 1.0',
        'vllm:request_params_n_sum{engine="0",model_name="tiny"} 1.0',
        'vllm:request_params_max_tokens_sum{engine="0",model_name="tiny"} 4.0',
        'vllm:request_max_num_generation_tokens_sum{engine="0",model_name="tiny"} 4.0',
        'spmoe:engine_steps_total{engine="0",model_name="tiny"} 0.0',
        'spmoe:engine_exchange_seconds_total{engine="0",model_name="tiny"} 0.125',
        'spmoe:engine_idle_seconds_total{engine="0",model_name="tiny"} 2.5',
        'spmoe:request_table_entries{engine="0",model_name="tiny",table="scheduler_requests"} 3.0',
        'spmoe:request_table_entries{engine="0",model_name="tiny",table="block_tables"} 1.0',
    ):
        assert line in text, line
    assert "spmoe:num_requests" not in text and "vllm:engine_steps" not in text  # each in its place


def test_histograms_have_vllms_buckets(served):
    """vLLM 0.34's default buckets (vllm/v1/metrics/buckets.py), for a max_model_len of 66."""
    _, _, http = served
    text = http.get("/metrics").text

    def bounds(name: str) -> list[str]:
        prefix = f'vllm:{name}_bucket{{engine="0",le="'
        return [
            line[len(prefix) :].split('"')[0]
            for line in text.splitlines()
            if line.startswith(prefix)
        ]

    latency = "0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 40.0 50.0 60.0 120.0 240.0"
    latency += " 480.0 960.0 1920.0 7680.0"
    assert bounds("e2e_request_latency_seconds") == [*latency.split(), "+Inf"]
    assert bounds("request_decode_time_seconds") == [*latency.split(), "+Inf"]
    ttft = "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0"
    ttft += " 80.0 160.0 640.0 2560.0"
    assert bounds("time_to_first_token_seconds") == [*ttft.split(), "+Inf"]
    itl = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0"
    assert bounds("inter_token_latency_seconds") == [*itl.split(), "+Inf"]
    assert bounds("request_time_per_output_token_seconds") == [*itl.split(), "+Inf"]
    tokens = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]  # 1-2-5 up to max_model_len 66
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert bounds(name) == tokens, name
    assert bounds("request_params_n") == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]


def test_several_names_and_the_models_generation_defaults(tokenizer):
    engine = ScriptedEngineClient(tokenizer.encode(REPLY))
    engine.num_speculative_tokens = 0
    defaults = GenerationDefaults(
        {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7, "top_k": 5}, "test"
    )
    http = TestClient(
        build_app(engine, tokenizer, ApiSettings(["glm-5.2", "glm"], defaults, seed=11)),
        raise_server_exceptions=False,
    )
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("glm-5.2", 66), ("glm", 66)]
    left_out = client.completions.create(model="glm", prompt="Hi")
    assert (
        left_out.model == "glm-5.2" and left_out.usage.completion_tokens == 7
    )  # the first name is reported
    assert (engine.requests[-1].sampling.temperature, engine.requests[-1].sampling.top_p) == (
        0.6,
        0.9,
    )
    seeds = [engine.requests[-1].sampling.seed]
    client.completions.create(model="glm", prompt="Hi")
    seeds.append(engine.requests[-1].sampling.seed)
    again = TestClient(build_app(engine, tokenizer, ApiSettings(["glm"], seed=11)))
    for _ in seeds:
        again.post("/v1/completions", json={"model": "glm", "prompt": "Hi", "max_tokens": 1})
    assert [r.sampling.seed for r in engine.requests[-2:]] == seeds and seeds[0] != seeds[
        1
    ]  # --seed: reproducible
    chat = [{"role": "user", "content": "Hello"}]
    own = client.chat.completions.create(
        model="glm-5.2", messages=chat, temperature=0, top_p=1.0, max_tokens=3
    )
    assert own.usage.completion_tokens == 3
    assert (engine.requests[-1].sampling.temperature, engine.requests[-1].sampling.top_p) == (
        0.0,
        1.0,
    )
    client.chat.completions.create(model="glm-5.2", messages=chat)
    assert engine.requests[-1].max_new_tokens == 7
    # a speculating server samples with the model's defaults, as without drafts
    engine.num_speculative_tokens = 2
    client.completions.create(model="glm", prompt="Hi")
    assert (engine.requests[-1].sampling.temperature, engine.requests[-1].sampling.top_p) == (
        0.6,
        0.9,
    )
    with pytest.raises(openai.NotFoundError, match="this server serves 'glm-5.2', 'glm'"):
        client.completions.create(model="glm-5", prompt="Hi")


def test_chat_template_and_content_format(tmp_path, tokenizer):
    parts = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    (tmp_path / "parts.jinja").write_text(parts)
    assert read_chat_template(str(tmp_path / "parts.jinja")) == parts
    assert read_chat_template("{{ messages[0]['content'] }}!") == "{{ messages[0]['content'] }}!"
    with pytest.raises(
        ValueError, match="--chat-template nope.jinja: expected a Jinja template file or a template"
    ):
        read_chat_template("nope.jinja")
    folder = tmp_path / "tok"
    write_demo_tokenizer(folder)
    engine = ScriptedEngineClient(tokenizer.encode("ok"))
    for content_format, template, prompt in (
        ("openai", read_chat_template(str(tmp_path / "parts.jinja")), "[Hel][lo]"),
        ("string", "{% for m in messages %}<{{ m['content'] }}>{% endfor %}", "<Hello>"),
    ):
        settings = ApiSettings(["tiny"], chat_template_content_format=content_format)
        app = build_app(engine, load_tokenizer(folder, template), settings)
        chat = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
            }
        ]
        TestClient(app).post(
            "/v1/chat/completions", json={"model": "tiny", "messages": chat, "max_tokens": 1}
        )
        assert tokenizer.decode(engine.requests[-1].prompt) == prompt


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ("{not json", 400, "not valid JSON"),
        ("[1, 2]", 400, "must be a JSON object, got list"),
        ({"prompt": "Hi"}, 400, "missing required parameter 'model'"),
        ({"model": "tiny"}, 400, "missing required parameter 'prompt'"),
        ({"model": "other", "prompt": "Hi"}, 404, "the model 'other' does not exist"),
        (
            {"model": "tiny", "prompt": "x" * 64},
            400,
            "the prompt has 64 tokens; the server's --max-model-len is 66, "
            "which leaves no room for an output token with 2 speculative",
        ),
        (
            {"model": "tiny", "prompt": "x" * 60, "max_tokens": 5},
            400,
            "is 5 with 2 speculative tokens: 67 > --max-model-len 66",
        ),
        (
            {"model": "tiny", "prompt": [1, 999]},
            400,
            "prompt token ids must be in [0, 264), got 999",
        ),
        ({"model": "tiny", "prompt": ""}, 400, "the prompt must not be empty"),
        (
            {"model": "tiny", "prompt": ["a", 1]},
            400,
            "prompt: expected a string, a list of strings, a list of token ids or a list of such lists, got ['a', 1]",
        ),
        ({"model": "tiny", "prompt": [[1], []]}, 400, "the prompt must not be empty"),
        (
            {"model": "tiny", "prompt": "Hi", "max_tokens": 0},
            400,
            "max_tokens: 0 is allowed only with echo, got 0",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "max_tokens": -1},
            400,
            "max_tokens: Input should be greater than",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "temperature": -0.5},
            400,
            "temperature: Input should be greater than",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "top_p": 0},
            400,
            "top_p: Input should be greater than 0",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "top_p": 1.5},
            400,
            "top_p: Input should be less than or equal to 1",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "n": 0},
            400,
            "n: Input should be greater than or equal to 1",
        ),
        ({"model": "tiny", "prompt": "Hi", "n": 2, "best_of": 3}, 400, "best_of must equal n (2)"),
        ({"model": "tiny", "prompt": "Hi", "stop": [""]}, 400, "stop strings must not be empty"),
        (
            {"model": "tiny", "prompt": "Hi", "logprobs": 21},
            400,
            "logprobs: Input should be less than or equal to 20",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "logit_bias": {"5": 101}},
            400,
            "biases in [-100, 100], got 5: 101",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "logit_bias": {"999": 1}},
            400,
            "logit_bias token ids must be in [0, 264)",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "min_tokens": 3},
            400,
            "min_tokens (3) must not exceed",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "presence_penalty": 3},
            400,
            "presence_penalty: Input should be less",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "repetition_penalty": 0},
            400,
            "repetition_penalty: Input should be greater",
        ),
        # malformed input: every kind is a 400 that says what is wrong
        (
            '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
            400,
            "more than 64 deep",
        ),
        (
            '{"model": "tiny", "prompt": "Hi", "stop": ' + "[" * 70 + "]" * 70 + "}",
            400,
            "more than 64 deep",
        ),
        (
            '{"model": "tiny", "prompt": "a\\ud800b"}',
            400,
            "not Unicode text: lone surrogate \\ud800",
        ),
        ('{"model": "tiny", "prompt": "Hi", "stop": ["\\udfff"]}', 400, "lone surrogate \\udfff"),
        ('{"model": "tiny", "prompt": "Hi", "temperature": NaN}', 400, "NaN is not a JSON number"),
        (
            '{"model": "tiny", "prompt": "Hi", "top_p": Infinity}',
            400,
            "Infinity is not a JSON number",
        ),
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "not valid JSON"),
        (
            {"model": "tiny", "prompt": "Hi", "max_tokens": "16"},
            400,
            "max_tokens: Input should be a valid integer",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "max_tokens": 16.0},
            400,
            "max_tokens: Input should be a valid integer",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "seed": True},
            400,
            "seed: Input should be a valid integer",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "temperature": "0.5"},
            400,
            "temperature: Input should be a valid number",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "top_p": False},
            400,
            "top_p: Input should be a valid number",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "stream": "yes"},
            400,
            "stream: Input should be a valid boolean",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "stop": [1]},
            400,
            "stop[0]: Input should be a valid string",
        ),
        ({"model": 7, "prompt": "Hi"}, 400, "model: Input should be a valid string"),
        (
            {"model": "tiny", "prompt": [True, 1]},
            400,
            "prompt: expected a string, a list of strings, a list of token ids",
        ),
        # the demo tokenizer's longest token, <|observation|>, has 15 bytes: 66 x 15 bytes is the
        # most that can fit
        (
            {"model": "tiny", "prompt": "x" * (66 * 15 + 1)},
            400,
            "prompt text has 991 bytes; --max-model-len 66",
        ),
        (
            {"model": "tiny", "prompt": "é" * 496},
            400,
            "prompt text has 992 bytes; --max-model-len 66",
        ),
        (
            {"model": "tiny", "prompt": "é" * 991},
            400,
            "prompt text has more than 991 bytes; --max-model-len 66",
        ),
        (
            {"model": "tiny", "prompt": [1] * 100_000},
            400,
            "the prompt has 100000 tokens; the server's --max-model",
        ),
    ],
)
def test_bad_completion_requests(served, body, status, fragment):
    engine, _, http = served
    response = http.post(
        "/v1/completions",
        content=body if isinstance(body, (str, bytes)) else json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == status and error["type"]
    assert "Traceback" not in response.text and len(error["message"]) < 400
    assert engine.requests == []
    assert http.get("/health").status_code == 200


def test_bad_chat_requests_and_a_full_queue(served):
    engine, client, http = served
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages: List should have at least 1 item"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )
    engine.queue_full = True
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError, match="the server is busy") as e:
            client.completions.create(model="tiny", prompt="Hi", stream=stream)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert http.get("/v1/nothing").json()["error"]["code"] == 404
    engine.error = "RuntimeError: a rank died"
    assert http.get("/health").status_code == 503


def test_sampling_fields_reach_the_engine_request(served, tokenizer):
    engine, client, _ = served
    client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"65": 10, "66": -100},
        seed=11,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 3,
            "stop_token_ids": [70, 71],
        },
    )
    request = engine.requests[-1]
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 5, 0.1, 11)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (s.logit_bias, s.min_tokens, s.logprobs, s.prompt_logprobs) == (
        ((65, 10.0), (66, -100.0)),
        3,
        None,
        None,
    )
    assert request.eos_token_ids == (tokenizer.eos_token_id, 70, 71)  # eos, then the stop ids
    client.completions.create(
        model="tiny", prompt="Hi", max_tokens=2, extra_body={"top_k": -1, "ignore_eos": True}
    )
    assert engine.requests[-1].sampling.top_k == 0 and engine.requests[-1].eos_token_ids == ()


def test_stop_token_ids_and_include_stop_str_in_output(served, tokenizer):
    engine, client, _ = served
    stop_id = tokenizer.encode(",")[0]  # REPLY = "Grüße, wörld ..."
    got = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=60, extra_body={"stop_token_ids": [stop_id]}
    )
    assert (got.choices[0].text, got.choices[0].finish_reason) == ("Grüße", "stop")
    got = client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=60,
        extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True},
    )
    assert got.choices[0].text == "Grüße,"
    got = client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=60,
        stop=["wö"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert got.choices[0].text == "Grüße, wö"


def test_batched_prompts_and_n_give_their_choices(served, tokenizer):
    engine, client, _ = served
    got = client.completions.create(model="tiny", prompt=["Hi", "Yo!"], max_tokens=3, n=2, seed=40)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [
        REPLY.encode()[:3].decode(errors="replace")
    ] * 4  # 3 byte tokens: the ü is cut
    requests = engine.requests[-4:]
    assert [r.prompt for r in requests] == [tokenizer.encode("Hi")] * 2 + [
        tokenizer.encode("Yo!")
    ] * 2
    assert [r.sampling.seed for r in requests] == [40, 41, 42, 43]
    assert len({r.request_id for r in requests}) == 4
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        5,
        12,
    )  # each prompt counted once
    got = client.completions.create(model="tiny", prompt=[[5, 6], [7]], max_tokens=2)
    assert [r.prompt for r in engine.requests[-2:]] == [[5, 6], [7]] and len(got.choices) == 2
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], n=3, stream=True
        )
    )
    by_choice = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        for i in range(3)
    }
    assert by_choice == {0: REPLY, 1: REPLY, 2: REPLY}
    assert (
        sorted(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)
        == ["stop"] * 3
    )


def test_logprobs_in_the_completions_and_chat_shapes(served, tokenizer):
    engine, client, _ = served
    ids = tokenizer.encode(REPLY)
    got = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logprobs=2)
    assert engine.requests[-1].sampling.logprobs == 2
    lp = got.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids[:3]] == ["G", "r", "\ufffd"]
    assert lp.token_logprobs == [-t / 100 for t in ids[:3]]
    assert lp.top_logprobs[0] == {"G": -ids[0] / 100, tokenizer.decode([7]): -7.0}
    assert lp.text_offset == [0, 1, 2]
    chunks = list(
        client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logprobs=0, stream=True)
    )
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == [-t / 100 for t in ids[:3]]  # every token once, whatever the text split

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
    )
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        ("G", -ids[0] / 100, [71]),
        ("r", -ids[1] / 100, [114]),
    ]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("G", -ids[0] / 100)]
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None and engine.requests[-1].sampling.logprobs is None
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            logprobs=True,
            stream=True,
        )
    )
    streamed = [
        c.logprob
        for chunk in chunks
        if chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert streamed == [-t / 100 for t in ids[:4]]


def test_echo_with_prompt_logprobs_and_max_tokens_zero(served, tokenizer):
    engine, client, _ = served
    prompt = tokenizer.encode("Hey")
    got = client.completions.create(model="tiny", prompt="Hey", max_tokens=0, echo=True, logprobs=1)
    request = engine.requests[-1]
    assert (request.max_new_tokens, request.sampling.prompt_logprobs) == (
        1,
        1,
    )  # one token generated, dropped
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason, got.usage.completion_tokens) == ("Hey", "length", 0)
    assert choice.logprobs.tokens == ["H", "e", "y"]
    assert (
        choice.logprobs.token_logprobs == [None, -0.5, -0.5]
        and choice.logprobs.top_logprobs[0] is None
    )
    assert choice.logprobs.top_logprobs[1] == {"e": -0.5}
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True)
    assert got.choices[0].text == "HeyGr" and got.choices[0].logprobs is None
    assert engine.requests[-1].sampling.prompt_logprobs is None
    chunks = list(
        client.completions.create(
            model="tiny", prompt="Hey", max_tokens=2, echo=True, logprobs=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "HeyGr"
    assert chunks[0].choices[0].logprobs.token_logprobs[:3] == [None, -0.5, -0.5]


def test_chat_roles_template_kwargs_and_continuous_usage(served, tokenizer):
    engine, client, _ = served
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "x"}],
    )
    as_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "x"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert engine.requests[-1].prompt == tokenizer.encode(as_system, add_special_tokens=False)
    original = tokenizer.chat_template
    tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"chat_template_kwargs": {"greeting": "Ahoy "}},
        )
    finally:
        tokenizer.chat_template = original
    assert engine.requests[-1].prompt == tokenizer.encode("Ahoy x", add_special_tokens=False)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hi",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    completion = [c.usage.completion_tokens for c in chunks if c.choices]
    assert (
        completion == sorted(completion)
        and completion[-1] == 4
        and chunks[-1].usage.completion_tokens == 4
    )
    for include_usage in (False, True):  # chat: every chunk, the role's first one included
        options = {"include_usage": include_usage, "continuous_usage_stats": True}
        request = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        chunks = list(
            client.chat.completions.create(**request, stream=True, stream_options=options)
        )
        completion = [c.usage.completion_tokens for c in chunks]
        assert len(chunks) >= 3 + include_usage and completion == sorted(completion)
        assert completion[-1] == 4
        assert {c.usage.prompt_tokens for c in chunks} == {len(engine.requests[-1].prompt)}


def test_routes_headers_and_unknown_fields(served, tokenizer, caplog):
    engine, client, http = served
    assert http.get("/version").json()["version"]
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/v1/models/other").status_code == 404
    assert client.models.retrieve("tiny").id == "tiny"
    head = http.head("/health")
    assert head.status_code == 200 and head.content == b""
    made = http.get("/health").headers["x-request-id"]
    assert len(made) == 32 and made != http.get("/health").headers["x-request-id"]
    assert (
        http.get("/v1/models", headers={"X-Request-Id": "mine-1"}).headers["x-request-id"]
        == "mine-1"
    )
    tokens = http.post("/tokenize", json={"model": "tiny", "prompt": "Hey"}).json()
    assert (
        tokens["tokens"] == tokenizer.encode("Hey")
        and tokens["count"] == 3
        and tokens["max_model_len"] == 66
    )
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=1
    )
    assert (
        chat["tokens"] == engine.requests[-1].prompt
    )  # what a chat request with these messages is prompted
    assert http.post("/detokenize", json={"tokens": tokenizer.encode("Grüße")}).json() == {
        "prompt": "Grüße"
    }
    assert http.post("/detokenize", json={"tokens": [999]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "a", "messages": []}).status_code == 400
    with caplog.at_level(logging.WARNING, logger="spmoe.serve"):
        for _ in range(2):
            response = http.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": "Hi",
                    "max_tokens": 1,
                    "frobnicate": 1,
                    "suffix": None,
                },
                headers={"X-Request-Id": "req-77"},
            )
            assert response.status_code == 200 and response.headers["x-request-id"] == "req-77"
    warnings = [
        r.getMessage() for r in caplog.records if "not supported and ignored" in r.getMessage()
    ]
    assert warnings == [
        "[req-77] request fields not supported and ignored (each name logged once): 'frobnicate', 'suffix'"
    ]
    # a client sending new names without end: one line a request, and none past the first 256 names
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmoe.serve"):
        for names in ([f"flood{i}" for i in range(300)], ["one-more"]):
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, **dict.fromkeys(names, 0)}
            assert http.post("/v1/completions", json=body).status_code == 200
    warnings = [
        r.getMessage() for r in caplog.records if "not supported and ignored" in r.getMessage()
    ]
    assert len(warnings) == 1 and "no more after 256 names" in warnings[0], warnings
    assert "'flood7' and " in warnings[0] and "'flood8'" not in warnings[0]


def test_bad_chat_inputs_are_400(served):
    _, _, http = served
    too_long = [
        {"role": "user", "content": "x" * 500},
        {"role": "user", "content": [{"type": "text", "text": "y" * 500}]},
    ]
    for body, fragment in (
        ({"model": "tiny", "messages": [{"role": "user", "content": "\ud83d"}]}, "lone surrogate"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
            "messages[0].content: expected a string or a list of text parts, got 5",
        ),
        ({"model": "tiny", "messages": "hi"}, "messages: Input should be a valid list"),
        (
            {"model": "tiny", "messages": too_long},
            "messages text has 1000 bytes; --max-model-len 66",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": "3",
            },
            "integer",
        ),
    ):
        response = http.post(
            "/v1/chat/completions",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], (
            response.text
        )


def test_ping_answers_as_vllms_does(served):
    """vLLM's /ping (SageMaker's health check) is /health under another name, GET and POST, with no
    key needed; 503 once the engine has stopped."""
    engine, _, http = served
    for response in (http.get("/ping"), http.post("/ping")):
        assert (response.status_code, response.content) == (200, b"")
    engine.error = "the engine stopped"
    assert http.get("/ping").status_code == http.post("/ping").status_code == 503


@pytest.mark.parametrize(
    "message, param, fragment",
    [
        (
            {"role": "tool", "content": "21"},
            "messages[1]",
            "messages[1]: a 'tool' message needs 'tool_call_id': the id of the call it answers",
        ),
        *(
            (
                {"role": "user", "content": [{"type": "text", "text": "see"}, part]},
                "messages[1].content",
                f"messages[1].content: this model takes text only, and the content has a "
                f"{part['type']!r} part",
            )
            for part in (
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-1"}},
            )
        ),
        (
            {"role": "user", "content": [{"type": "txt", "text": "see"}]},
            "messages[1].content[0].type",
            "messages[1].content[0].type: Input should be 'text', got 'txt'",
        ),
    ],
)
def test_bad_messages_are_400_in_the_clients_names(served, message, param, fragment):
    """OpenAI requires a tool message's tool_call_id; an image, audio or file part is refused as
    what it is; the error and its param name the field as the client wrote it, no validation
    internals."""
    engine, client, _ = served
    messages = [{"role": "user", "content": "Hi"}, message]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=messages)
    body = error.value.body
    assert body["param"] == param and body["message"].startswith(fragment), body
    assert ".str" not in body["message"] and "literal[" not in body["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    "tool_choice, param, fragment",
    [
        ("any", "tool_choice", 'tool_choice: expected "none", "auto", "required" or {"type":'),
        ({"type": "function"}, "tool_choice.function", "missing required parameter"),
        ({"type": "function", "function": {}}, "tool_choice.function.name", "missing required"),
    ],
)
def test_a_bad_tool_choice_names_tool_choice(served, tool_choice, param, fragment):
    _, _, http = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    response = http.post("/v1/chat/completions", json={**body, "tool_choice": tool_choice})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, error
    assert fragment in error["message"] and "literal[" not in error["message"], error


def test_default_chat_template_kwargs_under_the_requests(tokenizer):
    """--default-chat-template-kwargs: the template gets them for every request; a request's own
    chat_template_kwargs win key by key (as vLLM merges them); /tokenize prompts the same."""
    engine = ScriptedEngineClient(tokenizer.encode("ok"))
    chat = ChatOptions(default_template_kwargs={"greeting": "Ahoy ", "mark": "!"})
    http = TestClient(build_app(engine, tokenizer, ApiSettings(["tiny"], chat=chat)))
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )
    original = tokenizer.chat_template
    tokenizer.chat_template = (
        "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ mark }}"
    )
    messages = [{"role": "user", "content": "x"}]
    try:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert engine.requests[-1].prompt == tokenizer.encode("Ahoy x!", add_special_tokens=False)
        kwargs = {"chat_template_kwargs": {"greeting": "Hi "}}
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body=kwargs
        )
        assert engine.requests[-1].prompt == tokenizer.encode("Hi x!", add_special_tokens=False)
        tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert tokens == tokenizer.encode("Ahoy x!", add_special_tokens=False)
    finally:
        tokenizer.chat_template = original
    with pytest.raises(ValueError, match="--default-chat-template-kwargs must not set tools"):
        ChatOptions(default_template_kwargs={"tools": []})


def test_a_body_over_the_limit_is_413_before_it_is_read(tokenizer):
    engine = ScriptedEngineClient(tokenizer.encode("ok"))
    http = TestClient(
        build_app(engine, tokenizer, ApiSettings(["tiny"]), FrontEndLimits(max_request_bytes=1000))
    )
    small = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2, "user": "u" * 900})
    assert len(small) <= 1000 and http.post("/v1/completions", content=small).status_code == 200
    big = json.dumps({"model": "tiny", "prompt": "Hi", "user": "u" * 1000})
    for content in (
        big,
        iter([big[:600].encode(), big[600:].encode()]),
    ):  # with Content-Length, and chunked
        response = http.post("/v1/completions", content=content)
        assert response.status_code == 413, response.text
        assert (
            "longer than the server's --max-request-bytes 1000"
            in response.json()["error"]["message"]
        )
    assert len(engine.requests) == 1


def test_an_unexpected_error_is_a_generic_500_with_an_id(served, caplog):
    engine, _, http = served
    engine.failure = KeyError("/home/someone/secret/engine.py")
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert message.startswith("internal server error (id ") and "secret" not in response.text
    error_id = message.split("(id ")[1].split(")")[0]
    assert any(
        error_id in r.getMessage() for r in caplog.records
    )  # the details are in the log, under the id
    engine.failure = None
    engine.ends_with_error = (
        "RuntimeError: [/home/someone/secret/gloo.cpp:84] Connection closed by peer"
    )
    stream = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "stream": True})
    assert stream.text.endswith("data: [DONE]\n\n") and "secret" not in stream.text
    assert "the engine ended this request (error)" in stream.text
    whole = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
    assert whole.status_code == 500 and "secret" not in whole.text
    engine.error = engine.ends_with_error
    health = http.get("/health")
    assert health.status_code == 503 and "secret" not in health.text


def test_tokenizing_runs_off_the_event_loop(tokenizer, served):
    engine, client, http = served
    threads = []
    encode = tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    tokenizer.encode = recording_encode
    try:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    finally:
        del tokenizer.encode
    assert len(threads) == 2 and all(name.startswith("spmoe-tokenize") for name in threads), threads


def test_api_key(tokenizer):
    engine = ScriptedEngineClient(tokenizer.encode("ok"))
    http = TestClient(
        build_app(engine, tokenizer, ApiSettings(["tiny"]), FrontEndLimits(api_key="s3cret"))
    )
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("GET", "/v1/nothing"),
        ):
            response = http.request(
                method, path, headers=headers, json={"model": "tiny", "prompt": "Hi"}
            )
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["type"] == "authentication_error"
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    assert http.get("/ping").status_code == 200
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="s3cret", http_client=http, max_retries=0
    )
    assert (
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text == "ok"
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url="http://testserver/v1", api_key="nope", http_client=http, max_retries=0
        ).models.list()


def run_requests_then(app, bodies: list[dict], then):
    """On one event loop: send `bodies` to /v1/completions at once, await `then()` once every
    request has reached the engine, then -> (each response, what `then` returned, /health's status
    afterwards)."""
    import httpx

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://testserver", timeout=60
        ) as http:
            sent = [asyncio.create_task(http.post("/v1/completions", json=body)) for body in bodies]
            while app.state.api.open_requests < len(bodies):
                await asyncio.sleep(0.01)
            result = await then()
            responses = await asyncio.gather(*sent)
            late = await http.post("/v1/completions", json=bodies[0])
            return responses, result, late, (await http.get("/health")).status_code

    return asyncio.run(main())


def test_sigterm_drains_then_ends_open_streams_with_done(tokenizer):
    """A drain: a short request finishes within the grace time, the long ones (a stream, a whole
    one) are then ended (error chunk + [DONE]; 503) and aborted; new requests and /health get
    503."""
    engine = ScriptedEngineClient(tokenizer.encode("x" * 60))
    engine.step_s = 0.05
    app = build_app(engine, tokenizer, ApiSettings(["tiny"]))
    signals: asyncio.Queue = asyncio.Queue()
    bodies = [
        {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True},
        {"model": "tiny", "prompt": "Hi", "max_tokens": 60, "stream": True},
        {"model": "tiny", "prompt": "Hi", "max_tokens": 60},
    ]

    async def sigterm():
        signals.put_nowait(signal.SIGTERM)
        return await supervise(app.state.api, engine, StopPolicy(shutdown_timeout_s=0.5), signals)

    (short, streamed, whole), ending, late, health = run_requests_then(app, bodies, sigterm)
    assert ending == signal.SIGTERM
    assert (
        short.status_code == 200
        and short.text.endswith("data: [DONE]\n\n")
        and '"finish_reason": "length"' in short.text
    )
    events = streamed.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and "the server is shutting down" in events[-3], (
        events[-3:]
    )
    assert '"finish_reason": "length"' not in streamed.text
    assert (
        whole.status_code == 503
        and "the server is shutting down" in whole.json()["error"]["message"]
    )
    assert late.status_code == 503 and health == 503
    assert len(engine.closed_early) == 2 and app.state.api.open_requests == 0


def test_a_stalled_engine_fails_every_request(tokenizer):
    """The watchdog: an engine iteration longer than --engine-timeout marks the client failed, ends
    the open requests at once (error chunk + [DONE]) and returns, so that the server stops."""
    engine = ScriptedEngineClient(tokenizer.encode("x" * 60))
    engine.step_s = 0.05
    app = build_app(engine, tokenizer, ApiSettings(["tiny"]))
    bodies = [{"model": "tiny", "prompt": "Hi", "max_tokens": 60, "stream": True}] * 2

    async def stall():
        engine.stalled_s = 3.5
        return await supervise(
            app.state.api, engine, StopPolicy(engine_timeout_s=3), asyncio.Queue()
        )

    responses, ending, late, health = run_requests_then(app, bodies, stall)
    assert ending is None and "no engine step finished in 4 s (--engine-timeout 3)" in engine.error
    for response in responses:
        assert (
            response.text.endswith("data: [DONE]\n\n") and "the engine has stopped" in response.text
        )
        assert '"finish_reason": "length"' not in response.text
    assert late.status_code == 503 and health == 503
