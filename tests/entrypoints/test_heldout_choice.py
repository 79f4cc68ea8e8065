"""A loglikelihood multiple-choice task built from held-out text (which of four 32-byte continuations of a
128-byte snippet is the real one), scored as lm-eval's `local-completions` model scores one: a completion
request with the context and a continuation as the prompt, `echo`, `max_tokens` 0 and `logprobs`, the
continuation's summed token logprobs. `spmoe serve` (TP 2) on the trained demo checkpoint picks what
transformers picks on every item, so its accuracy is transformers'."""

import pytest
import torch

from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.entrypoints.heldout import heldout_sequences

from .test_serve import openai_client, start_server

CONTEXT, CONTINUATION, CHOICES, ITEMS = 128, 32, 4, 12


def items() -> list[tuple[list[int], list[list[int]], int]]:
    """-> (context, the choices, the real one's index) per item: the distractors are the continuations of
    other items, the real one at a rotating index."""
    snippets = heldout_sequences(ITEMS, CONTEXT + CONTINUATION, offset=16384)
    out = []
    for i, snippet in enumerate(snippets):
        others = [snippets[(i + j) % ITEMS][CONTEXT:] for j in range(1, CHOICES)]
        gold = i % CHOICES
        out.append((snippet[:CONTEXT], others[:gold] + [snippet[CONTEXT:]] + others[gold:], gold))
    return out


def transformers_scores(tasks) -> list[list[float]]:
    import transformers

    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)
    scores = []
    with torch.no_grad():
        for context, choices, _ in tasks:
            row = []
            for choice in choices:
                ids = torch.tensor([context + choice])
                logp = torch.log_softmax(model.eval()(ids).logits[0, :-1].double(), -1)
                targets = ids[0, len(context) :]
                row.append(logp[len(context) - 1 :].gather(1, targets[:, None]).sum().item())
            scores.append(row)
    return scores


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, base = start_server(CHECKPOINT, tmp_path_factory.mktemp("log") / "stderr.txt")
    yield base
    proc.kill()
    proc.wait()


def test_served_choices_equal_transformers(served):
    client, tasks = openai_client(served), items()
    served_scores = []
    for context, choices, _ in tasks:
        row = []
        for choice in choices:
            lp = (
                client.completions.create(
                    model="tiny",
                    prompt=context + choice,
                    max_tokens=0,
                    echo=True,
                    logprobs=0,
                    temperature=0,
                )
                .choices[0]
                .logprobs
            )
            row.append(sum(lp.token_logprobs[len(context) :]))
        served_scores.append(row)
    want = transformers_scores(tasks)
    picks = [max(range(CHOICES), key=row.__getitem__) for row in served_scores]
    hf_picks = [max(range(CHOICES), key=row.__getitem__) for row in want]
    gold = [g for _, _, g in tasks]
    accuracy = sum(p == g for p, g in zip(picks, gold)) / ITEMS
    print(
        f"multiple choice, {ITEMS} items of {CHOICES}: spmoe serve {accuracy:.3f}, transformers "
        f"{sum(p == g for p, g in zip(hf_picks, gold)) / ITEMS:.3f}"
    )
    assert picks == hf_picks
    assert accuracy > 0.5  # chance is 0.25
    for got, ref in zip(served_scores, want):
        assert got == pytest.approx(ref, rel=1e-3)  # summed float32 token logprobs
