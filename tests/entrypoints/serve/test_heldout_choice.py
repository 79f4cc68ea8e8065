"""A loglikelihood multiple-choice task built from held-out text (which of four 32-byte
continuations of a 128-byte snippet is the real one), scored as lm-eval's `local-completions` model
scores one: a completion request with the context and a continuation as the prompt, `echo`,
`max_tokens` 0 and `logprobs`, the continuation's summed token logprobs. `spmoe serve` (TP 2) on the
trained demo checkpoint picks what transformers picks on every item, so its accuracy is
transformers'. lm-eval itself (`lm_eval.simple_evaluate`, model `local-completions`) scores the same
items, written as a custom task (YAML + JSONL), against the same server, and reports transformers'
accuracy; lm-eval scores a context's trailing whitespace as part of each continuation, so for it the
items are written, and scored by transformers, split that way."""

import json

import pytest
import torch

from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.testing.heldout import heldout_sequences

from .test_serve import openai_client, start_server

CONTEXT, CONTINUATION, CHOICES, ITEMS = 128, 32, 4, 12
TASK = "spmoe_heldout_choice"


def items() -> list[tuple[list[int], list[list[int]], int]]:
    """-> (context, the choices, the real one's index) per item: the distractors are the
    continuations of other items, the real one at a rotating index."""
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


def split_as_lm_eval(tasks) -> list[tuple[list[int], list[list[int]], int]]:
    """The items with each context's trailing whitespace moved to the front of every choice."""
    out = []
    for context, choices, gold in tasks:
        kept = len(bytes(context).decode().rstrip().encode())  # as lm-eval strips: str.rstrip
        out.append((context[:kept], [context[kept:] + c for c in choices], gold))
    return out


def write_task(folder, tasks) -> None:
    """The items as text (the tokenizer: byte b is token b) in `items.jsonl`, and a task YAML that
    makes each choice the bare continuation of its context."""
    with open(folder / "items.jsonl", "w") as f:
        for context, choices, gold in tasks:
            text = {
                "context": bytes(context).decode(),
                "choices": [bytes(c).decode() for c in choices],
            }
            f.write(json.dumps({**text, "gold": gold}) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'items.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: gold\n"
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )


def test_lm_eval_accuracy_equals_transformers(served, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = split_as_lm_eval(items())
    write_task(tmp_path, tasks)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "tiny",
            "base_url": served + "/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(CHECKPOINT),
            "max_retries": 1,
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    got = [[resp[0][0] for resp in s["resps"]] for s in samples]
    want = transformers_scores(tasks)
    hf_accuracy = sum(
        max(range(CHOICES), key=row.__getitem__) == gold for row, (_, _, gold) in zip(want, tasks)
    ) / len(tasks)
    accuracy = out["results"][TASK]["acc,none"]
    print(
        f"lm-eval local-completions on spmoe serve: acc {accuracy:.3f}, transformers {hf_accuracy:.3f}"
    )
    assert len(got) == len(tasks)
    for row, ref in zip(got, want):
        assert row == pytest.approx(ref, rel=1e-3)  # summed float32 token logprobs
    assert accuracy == hf_accuracy
    assert accuracy > 0.5  # chance is 0.25
