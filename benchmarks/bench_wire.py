"""The front end <-> engine wire's codec: one step's messages at `--streams` streams, encoded and
decoded with msgspec (what `spmoe.entrypoints.serve.wire` uses: the records as they are, typed
decoding) against msgpack (each record turned into a tuple by hand and back), in microseconds per
message (median of `--reps`), and the bytes; then what a request's grammar costs the engine (its
spec's bytes on the wire, the engine's compile from the spec, a cache hit).

    pip install msgpack  # for the comparison only; spmoe itself uses msgspec
    python benchmarks/bench_wire.py --streams 256

The messages: the engine's step output (one token per stream, and with logprobs top-5 on every
stream, and the engine's counters), and a front end's message with 16 new 1024-token requests.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import msgpack
import msgspec
import zmq

from spmoe.engine.request import EngineMetrics, GrammarSpec, Request, RequestOutput, SamplingParams
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.entrypoints.serve.wire import Codec, FromEngine, PrivateAddress, ToEngine
from spmoe.entrypoints.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
}


def median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def step_output(streams: int, logprobs: bool) -> FromEngine:
    top = [(i, -1.5 - i) for i in range(5)]
    outputs = [
        RequestOutput(
            request_id=f"cmpl-{i:032x}-0",
            new_token_ids=[1000 + i],
            finish_reason=None,
            prompt_tokens=128,
            logprobs=[(-0.25, top)] if logprobs else None,
        )
        for i in range(streams)
    ]
    metrics = EngineMetrics(running=streams, generated_tokens=10**6, steps=10**4)
    return FromEngine(outputs=outputs, metrics=metrics, exchange_s=1.0, idle_s=2.0)


def new_requests(count: int, prompt_len: int) -> ToEngine:
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7, logprobs=5)
    adds = [
        Request(f"cmpl-{i:032x}-0", list(range(prompt_len)), 256, sampling, (2,))
        for i in range(count)
    ]
    return ToEngine(adds=adds, aborts=[])


# msgpack: the same records as nested tuples, built and read by hand


def astuple(record) -> tuple:
    """A record's fields in order, one level deep."""
    return msgspec.structs.astuple(record)


def logprobs_of(rows):
    return None if rows is None else [(lp, [tuple(t) for t in top]) for lp, top in rows]


def outputs_to_msgpack(message: FromEngine) -> bytes:
    return msgpack.packb(
        (
            [astuple(out) for out in message.outputs],
            astuple(message.metrics),
            message.rejected,
            message.error,
            message.exchange_s,
            message.idle_s,
        )
    )


def outputs_from_msgpack(data: bytes) -> FromEngine:
    outputs, metrics, rejected, error, exchange_s, idle_s = msgpack.unpackb(data)
    return FromEngine(
        [
            RequestOutput(rid, ids, finish, error, prompt, logprobs_of(lps), prompt_lps)
            for rid, ids, finish, error, prompt, lps, prompt_lps in outputs
        ],
        EngineMetrics(*metrics),
        [tuple(r) for r in rejected],
        error,
        exchange_s,
        idle_s,
    )


def requests_to_msgpack(message: ToEngine) -> bytes:
    adds = [
        (
            r.request_id,
            r.prompt,
            r.max_new_tokens,
            astuple(r.sampling),
            r.eos_token_ids,
            None if r.grammar is None else astuple(r.grammar),
            r.grammar_start_after,
        )
        for r in message.adds
    ]
    return msgpack.packb((adds, message.aborts))


def requests_from_msgpack(data: bytes) -> ToEngine:
    adds, aborts = msgpack.unpackb(data)
    requests = []
    for rid, prompt, max_new, sampling, eos, grammar, start_after in adds:
        sampling[8] = tuple(map(tuple, sampling[8]))  # logit_bias pairs
        spec = GrammarSpec(*grammar) if grammar is not None else None
        params = SamplingParams(*sampling)
        requests.append(Request(rid, prompt, max_new, params, tuple(eos), spec, tuple(start_after)))
    return ToEngine(requests, aborts)


def codec_rows(streams: int, reps: int) -> None:
    codec = Codec()
    cases = [
        (f"step output, {streams} streams", step_output(streams, False), "from"),
        (f"step output + logprobs top-5, {streams} streams", step_output(streams, True), "from"),
        ("16 new requests of 1024 tokens", new_requests(16, 1024), "to"),
    ]
    print(f"{'message':48} {'lib':8} {'bytes':>8} {'encode us':>10} {'decode us':>10}")
    for name, message, direction in cases:
        decode = codec.from_engine.decode if direction == "from" else codec.to_engine.decode
        to_msgpack, from_msgpack = (
            (outputs_to_msgpack, outputs_from_msgpack)
            if direction == "from"
            else (requests_to_msgpack, requests_from_msgpack)
        )
        data = codec.encode(message)
        assert decode(data) == message
        packed = to_msgpack(message)
        assert from_msgpack(packed) == message
        for lib, encode_fn, decode_fn, blob in (
            ("msgspec", lambda: codec.encode(message), lambda: decode(data), data),
            ("msgpack", lambda: to_msgpack(message), lambda: from_msgpack(packed), packed),
        ):
            enc, dec = median_us(encode_fn, reps), median_us(decode_fn, reps)
            print(f"{name:48} {lib:8} {len(blob):8d} {enc:10.1f} {dec:10.1f}")


def exchange_row(streams: int, reps: int) -> None:
    """The engine's side of one decode step's exchange over the real socket: look for messages (none
    waiting, the usual case), encode the step's output and send it to a front end."""
    address, codec = PrivateAddress(), Codec()
    context = zmq.Context.instance()
    engine, front = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    try:
        engine.bind(address.url)
        front.connect(address.url)
        front.send(codec.encode(ToEngine()))
        peer, _ = engine.recv_multipart()
        message = step_output(streams, False)

        def step() -> None:
            try:
                engine.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            engine.send_multipart((peer, codec.encode(message)), zmq.NOBLOCK)
            front.recv()  # the front end's side, outside the engine's time but in the loop's

        def front_only() -> None:
            engine.send_multipart((peer, b""), zmq.NOBLOCK)
            front.recv()

        total, rest = median_us(step, reps), median_us(front_only, reps)
    finally:
        front.close()
        engine.close()
        address.remove()
    print(
        f"engine side of a step's exchange at {streams} streams (look, encode, send): "
        f"{total - rest:.1f} us (median {total:.1f} us with the front end's receive, less an empty "
        f"message's round {rest:.1f} us)"
    )


def grammar_rows() -> None:
    """The engine compiles a request's grammar from its spec (JSON schema text), once per spec."""
    with tempfile.TemporaryDirectory() as folder:
        write_demo_tokenizer(Path(folder))
        tokenizer = load_tokenizer(folder)
        compiler = GrammarCompiler.from_tokenizer(tokenizer, len(tokenizer))
        compiler.compile(GrammarSpec("json_object"))  # the tokenizer's info, read once per process
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        request = Request("r", [1, 2, 3], 16, grammar=spec)
        codec = Codec()
        size = len(codec.encode(ToEngine(adds=[request]))) - len(
            codec.encode(ToEngine(adds=[Request("r", [1, 2, 3], 16)]))
        )
        began = time.perf_counter()
        compiler.compile(spec)
        cold = (time.perf_counter() - began) * 1e3
        hit = median_us(lambda: compiler.compile(spec), 1000)
    print(
        f"grammar (demo tokenizer, a 3-field JSON schema): spec on the wire {size} bytes; the engine's "
        f"compile from the spec {cold:.2f} ms, a cache hit {hit:.1f} us"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    codec_rows(args.streams, args.reps)
    exchange_row(args.streams, args.reps)
    grammar_rows()


if __name__ == "__main__":
    main()
