"""`Sequence.commit` as a table, without a model: each row a sequence's part of a step and what the forward
drew for it -> what the sequence commits, its status, the stop token its output names, and where it goes
on; then a real engine's steps, counting the stop decision: exactly once per sequence that drew, per
step (forks and speculation included)."""

import pytest

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.request import Request, SamplingParams
from spmoe.engine.sequence import Part, PartResult, Role, Sequence, Status

EOS, STOP_ID = 50, 70


class StopsAt:
    """A grammar in `SequenceGrammar`'s interface (accept, finished) that is complete once it has taken
    `last`, and refuses `refused`."""

    def __init__(self, last: int, refused: int = -1):
        self.last, self.refused, self.taken = last, refused, []

    def accept(self, token: int) -> bool:
        if token == self.refused:
            return False
        self.taken.append(token)
        return True

    @property
    def finished(self) -> bool:
        return bool(self.taken) and self.taken[-1] == self.last


def running(output: list[int], max_new: int = 10, grammar=None, prompt_len: int = 4) -> Sequence:
    seq = Sequence(
        Request("r", list(range(1, prompt_len + 1)), max_new, eos_token_ids=(EOS, STOP_ID)),
        grammar=grammar,
    )
    seq.status, seq.output = Status.RUNNING, list(output)
    seq.scheduled_s = seq.added_s  # as the scheduler notes it when it runs
    seq.cached = prompt_len + len(output) - 1 if output else 0
    return seq


# (name, output so far, max_new, grammar, drafts fed, drawn, accepted, finite)
#   -> (committed, status, stop token, cached after (None: not checked), pending after)
CASES = [
    ("goes on", [5], 10, None, [], [6], 0, True, ([6], Status.RUNNING, None, 5, [6])),
    (
        "drafts kept",
        [5],
        10,
        None,
        [7, 8],
        [7, 8, 9],
        2,
        True,
        ([7, 8, 9], Status.RUNNING, None, 7, [9]),
    ),
    (
        "one draft kept",
        [5],
        10,
        None,
        [7, 8],
        [7, 3],
        1,
        True,
        ([7, 3], Status.RUNNING, None, 6, [3]),
    ),
    ("eos", [5], 10, None, [], [EOS], 0, True, ([EOS], Status.STOPPED, EOS, None, None)),
    (
        "eos among drafts",
        [5],
        10,
        None,
        [EOS, 8],
        [EOS, 8, 9],
        2,
        True,
        ([EOS], Status.STOPPED, EOS, None, None),
    ),
    (
        "stop id",
        [5],
        10,
        None,
        [7],
        [7, STOP_ID],
        1,
        True,
        ([7, STOP_ID], Status.STOPPED, STOP_ID, None, None),
    ),
    ("length", [5, 6], 3, None, [7, 8], [7, 8, 9], 2, True, ([7], Status.LENGTH, None, None, None)),
    (
        "length at eos: stop",
        [5, 6],
        3,
        None,
        [],
        [EOS],
        0,
        True,
        ([EOS], Status.STOPPED, EOS, None, None),
    ),
    (
        "grammar stop among drafts",
        [5],
        10,
        StopsAt(8),
        [7, 8],
        [7, 8, 9],
        2,
        True,
        ([7, 8], Status.STOPPED, None, None, None),
    ),
    (
        "grammar and length at once",
        [5, 6],
        4,
        StopsAt(8),
        [7, 8],
        [7, 8, 9],
        2,
        True,
        ([7, 8], Status.LENGTH, None, None, None),
    ),
    (
        "grammar refuses",
        [5],
        10,
        StopsAt(99, refused=8),
        [7, 8],
        [7, 8, 9],
        2,
        True,
        ([7, 8], Status.ERROR, None, None, None),
    ),
    ("non-finite row", [5], 10, None, [7], [7, 8], 1, False, ([], Status.ERROR, None, None, None)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_commit_table(case):
    _, output, max_new, grammar, drafts, drawn, accepted, finite, want = case
    committed, status, stop_token, cached, pending = want
    seq = running(output, max_new, grammar)
    start = seq.cached
    part = Part(seq=seq, role=Role.DECODE, tokens=[output[-1], *drafts], start=start, drafts=drafts)
    result = PartResult(part=part, tokens=drawn, accepted=accepted, finite=finite)
    seq.commit(result, step=3)
    out = result.output
    assert (out.new_token_ids, seq.status, out.stop_token) == (committed, status, stop_token)
    assert out.finish_reason == (None if status is Status.RUNNING else status.value)
    assert seq.output == output + committed
    if cached is not None:
        assert (seq.cached, seq.pending, seq.drafts) == (cached, pending, [])
    if grammar is not None and status is not Status.ERROR:
        assert grammar.taken == committed  # the grammar walked exactly the committed tokens
    if not finite:
        assert seq.error.startswith(
            "non-finite logits (NaN or inf) at step 3 (decode) for request 'r'"
        )
    if status is Status.ERROR and finite:
        assert seq.error == "request 'r': token 8 does not follow its grammar"


def test_commit_of_a_prompt_chunk_and_of_a_prompt_end():
    """A chunk advances the cached count and draws nothing; the prompt's end draws its first token."""
    seq = running([], prompt_len=6)
    seq.pending = list(seq.request.prompt)
    chunk = PartResult(part=Part(seq=seq, role=Role.PROMPT_CHUNK, tokens=[1, 2, 3, 4], start=0))
    seq.commit(chunk, step=1)
    assert chunk.output is None and (seq.cached, seq.pending, seq.output) == (4, [5, 6], [])
    end = PartResult(part=Part(seq=seq, role=Role.PROMPT_END, tokens=[5, 6], start=4), tokens=[9])
    seq.commit(end, step=2)
    assert end.output.new_token_ids == [9] and (seq.cached, seq.pending) == (6, [9])
    assert seq.status is Status.RUNNING and not seq.prefilling


def stop_decisions(folder: str) -> list:
    """A real engine's steps (TP 1; forks of one prompt, speculation off and on) with the stop decision
    counted. -> per step (request ids whose stop was decided, request ids with an output that has tokens)."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    decided, decide_stop = [], Sequence.decide_stop

    def counted(self, candidates):
        decided.append(self.request_id)
        return decide_stop(self, candidates)

    Sequence.decide_stop = counted
    steps = []
    try:
        for k in (0, 2):
            engine = Engine(
                model, PagedKVCache.for_model(model, 2**20), k, max_num_batched_tokens=24
            )
            prompts = [[3, 14, 15, 92, 65, 35, 89] * 3, [79, 32], [38], [79, 32]]
            for i, prompt in enumerate(prompts):
                sampling = SamplingParams(temperature=1.0, seed=i)
                engine.add_request(Request(f"k{k}-{i}", prompt, 6, sampling, (51, 74, 39)))
            while engine.has_unfinished():
                decided.clear()
                outputs = engine.step()
                steps.append((list(decided), [o.request_id for o in outputs if o.new_token_ids]))
    finally:
        Sequence.decide_stop = decide_stop
    return steps


def test_one_stop_decision_per_sequence_per_step(engine_checkpoint):
    steps = spawn(stop_decisions, 1, engine_checkpoint)[0]
    assert sum(len(ids) for _, ids in steps) > 20  # the engine ran and committed
    for decided, committed in steps:
        assert sorted(decided) == sorted(committed)  # each exactly once, none for a prompt chunk
        assert len(set(decided)) == len(decided)
