"""Front ends for the serving tests' engine processes: run in a process of their own
(`spmoe.entrypoints.serve.frontend.process`, started by rank 0), so this module imports nothing of
the engine or the model. Each writes what it saw to a file (pickle) for the test to compare.
"""

import asyncio
import contextlib
import os
import pickle
import sys
from pathlib import Path

from spmoe.engine.request import GrammarSpec, Request

# what a front end process must never import: the engine, its runner, cache and ranks, the model
ENGINE_MODULES = (
    "spmoe.engine.engine",
    "spmoe.engine.scheduler",
    "spmoe.engine.runner",
    "spmoe.engine.cache",
    "spmoe.engine.ranks",
    "spmoe.models",
    "spmoe.layers.attention",
    "spmoe.distributed",
)


def engine_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith(ENGINE_MODULES))


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
    """Read `count` outputs, then stop iterating (the generator is closed: a client that went
    away)."""
    tokens = []
    async with contextlib.aclosing(client.generate(request)) as stream:
        async for out in stream:
            tokens += out.new_token_ids
            if len(tokens) >= count:
                break
    return tokens


async def scenario(client, PROMPTS, EOS, MAX_NEW, SAMPLED, IDLE_S) -> dict:
    stats, got = {"max_running": 0}, {}
    greedy = [Request(f"g{i}", p, MAX_NEW, eos_token_ids=EOS) for i, p in enumerate(PROMPTS)]
    # 2 slots per DP group: the two dropped requests come first and must free their slots for the
    # others
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
    await asyncio.sleep(0.5)  # the aborts reach the engine loop, and its counters come back
    got["after"] = client.metrics()

    # Refusals at once: a grammar that does not compile (the checkpoint has no tokenizer), a request
    # that can never fit the KV cache, a full queue (5 wait; the next 2 are refused).
    errors = {}
    unreadable = Request("b", [1, 2], 4, grammar=GrammarSpec("regex", "a+"))
    for name, request in [("grammar", unreadable), ("long", Request("l", [1] * 30, 4))]:
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


def front_end(client, launch, report: str, cases: dict) -> int:
    """The scenario on this process's event loop; its results, the front end's imports and pids to
    `report`."""

    async def run() -> dict:
        await client.start()
        try:
            return await scenario(client, **cases)
        finally:
            await client.close()

    got = run_and_describe(run, client, launch)
    Path(report).write_bytes(pickle.dumps(got))
    return 0


def run_and_describe(run, client, launch) -> dict:
    got = asyncio.run(run())
    got["info"] = {
        "vocab_size": client.vocab_size,
        "max_model_len": client.max_model_len,
        "num_speculative_tokens": client.num_speculative_tokens,
    }
    got["engine_modules"] = engine_modules()
    got["pids"] = {"front_end": os.getpid(), "parent": os.getppid(), "engine": launch.engine_pid}
    return got


def wait_for_error(client, launch, report: str, prompt: list[int], max_new: int) -> int:
    """Wait on a request as a server would; write the error output it got to `report`, then wait:
    the engine process must stop this one."""

    async def wait() -> None:
        await client.start()
        async for out in client.generate(Request("r", prompt, max_new)):
            if out.finish_reason == "error":
                Path(report).write_text(out.error)
                await asyncio.sleep(60)

    asyncio.run(wait())
    return 0
