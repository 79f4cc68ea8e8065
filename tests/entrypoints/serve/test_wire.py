"""The wire between a front end and the engine, without ranks: the codec gives back the records it
was given; the front end's EngineClient, against an engine socket driven here, sends what arrives in
one turn of its event loop as one message, hands each output to its request, raises a refusal as
ValueError, ends every stream when the engine reports a failure, and counts a missing engine as
stalled."""

import asyncio
import os
import stat

import zmq
import zmq.asyncio

from spmoe.engine.request import EngineMetrics, GrammarSpec, Request, RequestOutput, SamplingParams
from spmoe.entrypoints.serve.frontend.engine_client import EngineClient, QueueFull, merged
from spmoe.entrypoints.serve.wire import Codec, EngineFacts, FromEngine, PrivateAddress, ToEngine

FACTS = EngineFacts(
    max_model_len=64, max_num_waiting=4, vocab_size=96, eos_token_ids=(5,), num_speculative_tokens=0
)


def test_the_codec_gives_back_what_it_was_given():
    codec = Codec()
    request = Request(
        "r-0",
        [1, 2, 3],
        8,
        SamplingParams(0.7, 0.9, 11, logit_bias=((4, -2.5),), logprobs=2),
        (5, 6),
        GrammarSpec("json_schema", '{"type": "object"}'),
        (7,),
    )
    sent = ToEngine(adds=[request, Request("r-1", [9], 1)], aborts=["x"])
    assert codec.to_engine.decode(codec.encode(sent)) == sent
    out = FromEngine(
        outputs=[
            RequestOutput("r-0", [3, 4], None, logprobs=[(-0.5, [(3, -0.5)]), (-1.0, [(4, -1.0)])]),
            RequestOutput("r-1", [], "error", error="boom", prompt_tokens=1),
            RequestOutput("r-3", [8], None, queue_s=0.25, prefill_s=0.125),
        ],
        metrics=EngineMetrics(running=1, accepted_per_position=[2, 1]),
        rejected=[("r-2", "bad")],
        exchange_s=0.5,
        idle_s=1.5,
    )
    assert codec.from_engine.decode(codec.encode(out)) == out


def test_the_socket_folder_is_private():
    address = PrivateAddress()
    try:
        assert stat.S_IMODE(os.stat(address.folder).st_mode) == 0o700
        assert address.url.startswith("ipc://" + address.folder)
    finally:
        address.remove()
    assert not os.path.exists(address.folder)


async def exchange() -> dict:
    """An engine socket here; a client connects, sends requests; the 'engine' answers one step."""
    address, codec, got = PrivateAddress(), Codec(), {}
    engine = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    engine.bind(address.url)
    client = EngineClient(address.url, FACTS, os.getppid())
    try:
        await client.start()
        peer, hello = await engine.recv_multipart()
        got["hello"] = codec.to_engine.decode(hello)

        async def read(request_id: str) -> list:
            seen = []
            try:
                async for out in client.generate(Request(request_id, [1, 2], 4)):
                    seen.append((out.new_token_ids, out.finish_reason))
            except ValueError as e:
                seen.append(f"ValueError: {e}")
            except RuntimeError as e:
                seen.append(f"RuntimeError: {e}")
            return seen

        tasks = {name: asyncio.ensure_future(read(name)) for name in ("a", "b", "bad", "c")}
        await asyncio.sleep(0.05)
        messages = []
        while await engine.poll(200):
            messages.append(codec.to_engine.decode((await engine.recv_multipart())[1]))
        got["first"] = messages
        try:
            await client.generate(Request("d", [1], 2)).__anext__()
        except QueueFull as e:  # a, b, c and bad have no output yet
            got["queue_full"] = str(e)
        step = FromEngine(
            outputs=[
                RequestOutput("a", [7], None),
                RequestOutput("b", [8, 9], "length"),
                RequestOutput("gone", [1], None),
            ],
            metrics=EngineMetrics(running=2, generated_tokens=3),
            rejected=[("bad", "request 'bad': the prompt is too long")],
            exchange_s=0.25,
        )
        await engine.send_multipart((peer, codec.encode(step)))
        await asyncio.sleep(0.1)
        got["metrics"], got["exchange_s"] = client.metrics(), client.exchange_s
        failed = FromEngine(
            outputs=[RequestOutput("a", [], "error", error="RuntimeError: x")],
            metrics=EngineMetrics(),
            error="RuntimeError: x",
        )
        await engine.send_multipart((peer, codec.encode(failed)))
        got["streams"] = {name: await task for name, task in tasks.items()}
        got["tables_after"] = client.metrics().request_tables
        got["error"] = client.error
        got["stalled"] = client.stalled_for()
    finally:
        await client.close()
        engine.close()
        address.remove()
    return got


def test_the_client_over_the_wire():
    got = asyncio.run(exchange())
    assert got["hello"] == ToEngine()
    assert [[r.request_id for r in m.adds] for m in got["first"]] == [["a", "b", "bad", "c"]]
    assert got["queue_full"].startswith("4 requests wait to start")
    # the front end's open requests beside the engine's tables: a and c
    assert got["metrics"] == EngineMetrics(
        running=2, generated_tokens=3, request_tables={"front_end_streams": 2}
    )
    assert got["tables_after"] == {"front_end_streams": 0}
    assert got["exchange_s"] == 0.25
    assert got["streams"] == {
        "a": [([7], None), ([], "error")],
        "b": [([8, 9], "length")],
        "bad": ["ValueError: request 'bad': the prompt is too long"],
        "c": ["RuntimeError: the engine has stopped: RuntimeError: x"],
    }
    assert got["error"] == "RuntimeError: x"
    assert got["stalled"] < 5


async def early_request() -> list:
    """A request made before the client has said hello (its front end not listening yet) waits for
    it."""
    address, codec = PrivateAddress(), Codec()
    engine = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    engine.bind(address.url)
    client = EngineClient(address.url, FACTS, os.getppid())
    try:
        stream = client.generate(Request("early", [1], 2))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        await client.start()
        got = []
        while await engine.poll(200):
            got.append(codec.to_engine.decode((await engine.recv_multipart())[1]))
        first.cancel()
        return got
    finally:
        await client.close()
        engine.close()
        address.remove()


def test_a_request_before_the_hello_follows_it():
    hello, *rest = asyncio.run(early_request())
    assert hello == ToEngine()
    assert [[r.request_id for r in m.adds] for m in rest] == [["early"]]


def test_the_metrics_of_dp_groups_as_one():
    """Two DP groups' engines as /metrics shows them: counts and table entries add up, the cache's
    usage is their mean."""
    parts = [
        EngineMetrics(running=2, kv_cache_usage=0.5, request_tables={"block_tables": 2}),
        EngineMetrics(
            running=1,
            kv_cache_usage=0.25,
            request_tables={"block_tables": 1, "scheduler_requests": 3},
        ),
    ]
    one = EngineMetrics.combine(parts)
    assert one.running == 3 and one.kv_cache_usage == 0.375
    assert one.request_tables == {"block_tables": 3, "scheduler_requests": 3}


def test_merged_joins_a_requests_outputs_in_order():
    lp = [(-0.25, [(7, -0.25)]), (-0.5, [(8, -0.5)]), (-0.75, [(9, -0.75)])]
    outputs = [
        RequestOutput("r", [7], None, prompt_tokens=3, logprobs=lp[:1], queue_s=0.5, prefill_s=1.0),
        RequestOutput("r", [8], None, prompt_tokens=3, logprobs=lp[1:2]),
        RequestOutput("r", [9], "stop", prompt_tokens=3, logprobs=lp[2:], stop_token=9),
    ]
    outputs[0].prompt_logprobs = [None, (-1.0, [(2, -1.0)])]
    assert merged(outputs) == [
        RequestOutput(
            "r",
            [7, 8, 9],
            "stop",
            prompt_tokens=3,
            logprobs=lp,
            prompt_logprobs=[None, (-1.0, [(2, -1.0)])],
            stop_token=9,
            queue_s=0.5,
            prefill_s=1.0,
        )
    ]
    failure = RuntimeError("the engine has stopped")
    got = merged([RequestOutput("r", [1], None), RequestOutput("r", [2], None), failure])
    assert got == [RequestOutput("r", [1, 2], None), failure]
    # an error ends the request after the text before it; nothing joins a finished output
    error = RequestOutput("r", [], "error", error="boom")
    assert merged([RequestOutput("r", [1], None), error]) == [RequestOutput("r", [1], None), error]
    done = RequestOutput("r", [1], "length")
    assert merged([done, RequestOutput("r", [2], None)]) == [done, RequestOutput("r", [2], None)]


async def slow_reader() -> dict:
    """A stream that is not read while three steps come: it gets them as one output, then a failure
    that came after its last tokens."""
    address, codec = PrivateAddress(), Codec()
    engine = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    engine.bind(address.url)
    client = EngineClient(address.url, FACTS, os.getppid())

    async def step(*outputs, error=None):
        message = FromEngine(outputs=list(outputs), metrics=EngineMetrics(), error=error)
        await engine.send_multipart((peer, codec.encode(message)))

    got = {}
    try:
        await client.start()
        peer, _ = await engine.recv_multipart()
        for name in ("slow", "failed"):
            stream = client.generate(Request(name, [1, 2], 8))
            first = asyncio.ensure_future(anext(stream))
            await engine.recv_multipart()
            await step(RequestOutput(name, [3], None, prompt_tokens=2))
            got[name] = [await first]
            await step(RequestOutput(name, [4], None, logprobs=[(-1.0, [])]))
            await step(RequestOutput(name, [5], None, logprobs=[(-2.0, [])]))
            await step(RequestOutput(name, [6], "length" if name == "slow" else None))
            if name == "failed":
                await step(error="RuntimeError: x")
            await asyncio.sleep(0.2)  # the steps arrive while nobody reads this stream
            try:
                async for out in stream:
                    got[name].append(out)
            except RuntimeError as e:
                got[name].append(str(e))
    finally:
        await client.close()
        engine.close()
        address.remove()
    return got


def test_a_stream_that_falls_behind_gets_its_steps_as_one_output():
    got = asyncio.run(slow_reader())
    tokens = RequestOutput("slow", [4, 5, 6], "length", logprobs=[(-1.0, []), (-2.0, [])])
    assert got["slow"] == [RequestOutput("slow", [3], None, prompt_tokens=2), tokens]
    assert got["failed"][1] == RequestOutput(
        "failed", [4, 5, 6], None, logprobs=[(-1.0, []), (-2.0, [])]
    )
    assert got["failed"][2] == "the engine has stopped: RuntimeError: x"
