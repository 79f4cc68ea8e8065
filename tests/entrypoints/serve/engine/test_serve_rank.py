"""`serve_rank` on 2 gloo ranks, TP 2 and DP 2 x TP 1, serving a front end process
(`front_ends_for_tests.py`) that uses the EngineClient over the wire from asyncio: concurrent
requests get the tokens `generate` gives; one consumer that stops iterating and one task that is
cancelled free their cache for the waiting requests; a grammar that does not compile, a request that
can never fit and a full queue are errors at once; an idle spell longer than the process group's
timeout passes (the heartbeat); the front end's exit shuts every rank down. The front end process
imports nothing of the engine or the model, and is not rank 0's process. A failing engine loop ends
its requests with an error and stops every rank.

One spawned group per layout runs every case; the front end writes what it saw, the comparisons
happen here.
"""

import pickle
import time

import pytest

from spmoe.config import ParallelConfig
from spmoe.distributed import RankFailed, spawn
from spmoe.engine.args import EngineArgs
from spmoe.engine.request import SamplingParams
from spmoe.entrypoints.serve.engine.front_ends import FrontEndCommand
from spmoe.entrypoints.serve.engine.loop import HEARTBEAT_S
from spmoe.entrypoints.serve.engine.rank import serve_rank
from tests.engine.test_generate import EOS, MAX_NEW, PROMPTS

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
OPTIONS = dict(max_num_seqs=2, max_model_len=32)
MAX_NUM_WAITING = 5
TIMEOUT_S = 6  # the process groups' timeout in these runs; the idle spell lasts longer
IDLE_S = TIMEOUT_S + 2 * HEARTBEAT_S


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


FRONT_ENDS = "tests.entrypoints.serve.engine.front_ends_for_tests"
CASES = dict(PROMPTS=PROMPTS, EOS=EOS, MAX_NEW=MAX_NEW, SAMPLED=SAMPLED, IDLE_S=IDLE_S)


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_serve_on_two_ranks(tp, dp, engine_checkpoint, reference, tmp_path):
    greedy, sampled, full = reference
    parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp)
    began, report = time.monotonic(), tmp_path / "front_end.pickle"
    args = EngineArgs(tp=tp, dp=dp, **OPTIONS)
    results = spawn(
        serve_rank,
        2,
        engine_checkpoint,
        args,
        MAX_NUM_WAITING,
        FrontEndCommand.with_args(f"{FRONT_ENDS}:front_end", str(report), CASES),
        config=parallel,
        timeout_s=TIMEOUT_S,
    )
    assert results == [None, None]  # the front end exited 0; every rank left its loop
    got = pickle.loads(report.read_bytes())
    print(f"tp{tp} x dp{dp}: {time.monotonic() - began:.1f} s, {got['final']}")
    assert got["engine_modules"] == []
    pids = got["pids"]
    assert pids["front_end"] != pids["engine"] and pids["parent"] == pids["engine"], pids
    assert [tokens for tokens, _ in got["greedy"]] == greedy
    assert [reason for _, reason in got["greedy"]] == [
        "stop" if out[-1] in EOS else "length" for out in greedy
    ]
    assert got["sampled"] == (sampled, "length")
    assert got["closed"] == full[:2]
    assert got["cancelled"]
    assert (got["after"].running, got["after"].waiting, got["after"].kv_cache_usage) == (0, 0, 0.0)
    assert got["max_running"] == 2 * dp  # two slots per DP group, all in use at once
    assert got["errors"].pop("grammar").startswith("the regex grammar does not compile: ")
    assert got["errors"] == {
        "long": "request 'l': the prompt has 30 tokens; with max_new_tokens=4 and 0 speculative tokens it needs "
        "34 KV cache positions, the cache holds 32 per sequence",
        "queue_full": ["ok"] * 5 + ["QueueFull"] * 2,
    }
    assert got["burst"] == [(greedy[3][:2], "stop" if greedy[3][1] in EOS else "length")] * 5
    assert got["after_idle"] == got["greedy"][1]
    assert got["final"].generated_tokens >= sum(map(len, greedy)) + len(sampled) + 2 + 10
    assert got["info"] == {"vocab_size": 96, "max_model_len": 32, "num_speculative_tokens": 0}


def serve_rank_failing(*args):
    """`serve_rank` with rank 0's engine broken at its third step."""
    from spmoe.distributed import get_parallel_state
    from spmoe.engine.engine import Engine

    if get_parallel_state().rank == 0:
        steps, step = [0], Engine.step

        def broken_step(self):
            steps[0] += 1
            if steps[0] == 3:
                raise RuntimeError("injected failure")
            return step(self)

        Engine.step = broken_step
    return serve_rank(*args)


def test_engine_failure_stops_every_rank(engine_checkpoint, tmp_path):
    """A failing engine loop ends its requests with an error, stops the front end and every rank."""
    report = tmp_path / "error.txt"
    with pytest.raises(
        RankFailed,
        match="rank 0 of 2 failed: RuntimeError: the engine loop failed: RuntimeError: injected failure",
    ):
        spawn(
            serve_rank_failing,
            2,
            engine_checkpoint,
            EngineArgs(tp=2, **OPTIONS),
            MAX_NUM_WAITING,
            FrontEndCommand.with_args(
                f"{FRONT_ENDS}:wait_for_error", str(report), PROMPTS[0], MAX_NEW
            ),
            config=ParallelConfig(tensor_parallel_size=2),
        )
    assert report.read_text() == "RuntimeError: injected failure"
    # from the front end's report of the error to every rank's end: not the front end's 60 s wait
    assert time.time() - report.stat().st_mtime < 30
