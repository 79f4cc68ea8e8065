"""`serve_rank` on 2 gloo ranks, TP 2 and DP 2 x TP 1, driven by a front end written here that uses the
EngineClient from asyncio: concurrent requests get the tokens `generate` gives; one consumer that stops
iterating and one task that is cancelled free their cache for the waiting requests; a bad request and a full
queue are errors at once; an idle spell longer than the process group's timeout passes (the heartbeat); the
shutdown returns every rank. A failing engine loop ends its requests with an error and stops every rank. And,
without ranks: a step's outputs reach the event loop in one call.

One spawned group per layout runs every case; the comparisons happen here.
"""

import asyncio
import contextlib
import time
from functools import partial
from pathlib import Path

import pytest

from spmoe.config import ParallelConfig
from spmoe.distributed import RankFailed, spawn
from spmoe.engine.args import EngineArgs
from spmoe.engine.request import Request
from spmoe.engine.sampling.sampler import SamplingParams
from spmoe.entrypoints.serve.client import HEARTBEAT_S, serve_rank

from .test_generate import EOS, MAX_NEW, PROMPTS

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
OPTIONS = dict(max_num_seqs=2, max_model_len=32)
MAX_NUM_WAITING = 5
TIMEOUT_S = 6  # the process groups' timeout in these runs; the idle spell lasts longer
IDLE_S = TIMEOUT_S + 2 * HEARTBEAT_S


async def collect(
    client, request, stats: dict, started: asyncio.Event | None = None
) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for out in client.generate(request):
        tokens += out.new_token_ids
        reason = out.finish_reason
        stats["max_running"] = max(stats["max_running"], client.metrics().running)
        if started is not None:
            started.set()
    return tokens, reason


async def first_outputs(client, request, count: int) -> list[int]:
    """Read `count` outputs, then stop iterating (the generator is closed: a client that went away)."""
    tokens = []
    async with contextlib.aclosing(client.generate(request)) as stream:
        async for out in stream:
            tokens += out.new_token_ids
            if len(tokens) >= count:
                break
    return tokens


async def scenario(client) -> dict:
    stats, got = {"max_running": 0}, {}
    greedy = [Request(f"g{i}", p, MAX_NEW, eos_token_ids=EOS) for i, p in enumerate(PROMPTS)]
    # 2 slots per DP group: the two dropped requests come first and must free their slots for the others
    dropped = asyncio.ensure_future(
        first_outputs(client, Request("closed", PROMPTS[0], MAX_NEW), 2)
    )
    started = asyncio.Event()
    cancelled = asyncio.ensure_future(
        collect(client, Request("cancelled", PROMPTS[1], 20), stats, started)
    )
    sampled = asyncio.ensure_future(
        collect(client, Request("s", PROMPTS[2], MAX_NEW, SAMPLED), stats)
    )
    await started.wait()
    cancelled.cancel()  # after its first token, long before its 20th
    tasks = [asyncio.ensure_future(collect(client, r, stats)) for r in greedy]
    results = await asyncio.wait_for(asyncio.gather(*tasks, sampled, dropped), timeout=120)
    got["greedy"], got["sampled"], got["closed"] = results[:4], results[4], results[5]
    got["cancelled"] = cancelled.cancelled()
    got["max_running"] = stats["max_running"]
    await asyncio.sleep(0.2)  # the aborts reach the engine loop
    got["after"] = client.metrics()

    # Errors at once: a bad request, a duplicate id, a full queue (5 wait; the next 2 are refused).
    errors = {}
    for name, request in [("bad", Request("b", [1, 96], 4)), ("long", Request("l", [1] * 30, 4))]:
        try:
            await client.generate(request).__anext__()
        except ValueError as e:
            errors[name] = str(e)
    burst = [
        asyncio.ensure_future(collect(client, Request(f"q{i}", PROMPTS[3], 2), stats))
        for i in range(7)
    ]
    outcomes = await asyncio.gather(*burst, return_exceptions=True)
    errors["queue_full"] = [
        type(o).__name__ if isinstance(o, Exception) else "ok" for o in outcomes
    ]
    got["burst"] = [o for o in outcomes if not isinstance(o, Exception)]
    got["errors"] = errors

    # Idle longer than the process group timeout, then serve again.
    await asyncio.sleep(IDLE_S)
    got["after_idle"] = await collect(client, greedy[1], stats)
    got["final"] = client.metrics()
    return got


def front_end(client) -> dict:
    """What `spmoe serve` does with uvicorn, in a few lines: run the scenario on an event loop, in the main
    thread of rank 0, and return."""
    info = {
        "vocab_size": client.vocab_size,
        "max_model_len": client.max_model_len,
        "num_speculative_tokens": client.num_speculative_tokens,
    }
    return {**asyncio.run(scenario(client)), "info": info}


@pytest.fixture(scope="module")
def reference(engine_checkpoint):
    from spmoe.entrypoints.generate import GenerateOptions, run_generate

    greedy = run_generate(
        engine_checkpoint, PROMPTS, GenerateOptions(MAX_NEW, eos_token_ids=EOS, progress=False)
    )
    sampled = run_generate(
        engine_checkpoint,
        [PROMPTS[2]],
        GenerateOptions(MAX_NEW, SAMPLED, eos_token_ids=(), progress=False),
    )
    full = run_generate(
        engine_checkpoint, PROMPTS[:1], GenerateOptions(MAX_NEW, eos_token_ids=(), progress=False)
    )
    return greedy.outputs, sampled.outputs[0], full.outputs[0]


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_serve_on_two_ranks(tp, dp, engine_checkpoint, reference):
    greedy, sampled, full = reference
    parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp)
    began = time.monotonic()
    args = EngineArgs(tp=tp, dp=dp, **OPTIONS)
    results = spawn(
        serve_rank,
        2,
        engine_checkpoint,
        args,
        MAX_NUM_WAITING,
        front_end,
        config=parallel,
        timeout_s=TIMEOUT_S,
    )
    assert results[1] is None  # the worker left its loop at the shutdown
    got = results[0]
    print(f"tp{tp} x dp{dp}: {time.monotonic() - began:.1f} s, {got['final']}")
    assert [tokens for tokens, _ in got["greedy"]] == greedy
    assert [reason for _, reason in got["greedy"]] == [
        "stop" if out[-1] in EOS else "length" for out in greedy
    ]
    assert got["sampled"] == (sampled, "length")
    assert got["closed"] == full[:2]
    assert got["cancelled"]
    assert (got["after"].running, got["after"].waiting, got["after"].kv_cache_usage) == (0, 0, 0.0)
    assert got["max_running"] == 2 * dp  # two slots per DP group, all in use at once
    assert got["errors"] == {
        "bad": "request 'b': the prompt must be a non-empty list of token ids in [0, 96), got [1, 96]",
        "long": "request 'l': the prompt has 30 tokens; with max_new_tokens=4 and 0 speculative tokens it needs "
        "34 KV cache positions, the cache holds 32 per sequence",
        "queue_full": ["ok"] * 5 + ["QueueFull"] * 2,
    }
    assert got["burst"] == [(greedy[3][:2], "stop" if greedy[3][1] in EOS else "length")] * 5
    assert got["after_idle"] == got["greedy"][1]
    assert got["final"].generated_tokens >= sum(map(len, greedy)) + len(sampled) + 2 + 10
    assert got["info"] == {"vocab_size": 96, "max_model_len": 32, "num_speculative_tokens": 0}


def failing_front_end(report: str, client) -> None:
    """Breaks rank 0's engine at its third step, then waits on a request as a server would; writes the
    error output it got to the file `report`."""
    steps, step = [0], client.engine.step

    def broken_step():
        steps[0] += 1
        if steps[0] == 3:
            raise RuntimeError("injected failure")
        return step()

    client.engine.step = broken_step

    async def wait() -> None:
        async for out in client.generate(Request("r", PROMPTS[0], MAX_NEW)):
            if out.finish_reason == "error":
                Path(report).write_text(out.error)
                await asyncio.sleep(60)  # the engine loop's failure must stop the front end

    asyncio.run(wait())


def test_engine_failure_stops_every_rank(engine_checkpoint, tmp_path):
    """A failing engine loop ends its requests with an error, stops the front end and every rank."""
    began, report = time.monotonic(), tmp_path / "error.txt"
    with pytest.raises(
        RankFailed,
        match="rank 0 of 2 failed: RuntimeError: the engine loop failed: RuntimeError: injected failure",
    ):
        spawn(
            serve_rank,
            2,
            engine_checkpoint,
            EngineArgs(tp=2, **OPTIONS),
            MAX_NUM_WAITING,
            partial(failing_front_end, str(report)),
            config=ParallelConfig(tensor_parallel_size=2),
        )
    assert report.read_text() == "RuntimeError: injected failure"
    assert time.monotonic() - began < 40  # not the front end's 60 s wait


def test_a_steps_outputs_reach_the_event_loop_in_one_call():
    """The engine loop hands a step's outputs over in one `call_soon_threadsafe` per event loop, each output
    to its request's queue in order; a finished request's stream is forgotten, an unknown one's output dropped."""
    from spmoe.engine.request import RequestOutput
    from spmoe.entrypoints.serve.client import EngineClient

    class Loop:  # records what would run on the event loop
        def __init__(self):
            self.calls = []

        def call_soon_threadsafe(self, fn, *args):
            self.calls.append((fn, args))

    loop, other = Loop(), Loop()
    queues = {name: asyncio.Queue() for name in ("a", "b", "c")}
    streams = {"a": (loop, queues["a"]), "b": (loop, queues["b"]), "c": (other, queues["c"])}
    outputs = [
        RequestOutput("a", [1], None),
        RequestOutput("b", [2], "length"),
        RequestOutput("gone", [3], None),
        RequestOutput("c", [4], None),
    ]
    EngineClient._hand_out(streams, outputs)
    assert len(loop.calls) == 1 and len(other.calls) == 1
    for fn, args in loop.calls + other.calls:
        fn(*args)
    got = {
        name: [q.get_nowait().new_token_ids for _ in range(q.qsize())] for name, q in queues.items()
    }
    assert got == {"a": [[1]], "b": [[2]], "c": [[4]]}
    assert set(streams) == {"a", "c"}  # b finished
