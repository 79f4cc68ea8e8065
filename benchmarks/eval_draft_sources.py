"""Draft sources compared without a GPU: mean tokens committed per target forward, target forwards per
request and MTP forwards per request (what the GPU time of drafting scales with), for MTP alone (k =
1..3), n-gram alone, suffix alone and the hybrid (MTP + n-gram, MTP + suffix), on three workloads built
from the trained demo checkpoint's held-out source (`spmoe/checkpoints/heldout_stdlib.txt`, byte
tokens):

- edit: rewrite a given Python function (a parameter renamed, a line added or a line removed); the
  answer is the edited function, so it copies most of its prompt;
- tools: multi-turn tool loops: read a file, two edit calls that quote its lines (JSON-escaped), a
  summary that quotes both edits again; every turn re-sends the conversation so far;
- plain: held-out text continued (512 bytes of prompt, the next 256 as the answer).

Each request is replayed against its reference answer: the target is taken to answer exactly it (a
greedy target whose answer is the reference), so a step verifies the drafts against the answer's next
tokens, commits the accepted ones and the target's token after them, and counts one target forward;
the prompt is one more forward (its prefill draws the first token). The figures therefore carry over to
any hardware, and to any model whose answers are these.

The drafts are the engine's own: the lookups (`runner/lookup.py`), the hybrid's choice and merge
(`runner/speculator.py`), and the checkpoint's MTP layer run on the checkpoint's target hidden states
over the answer so far (teacher forcing: the catch-up rows are the target's and MTP's over the committed
tokens, then the MTP chain fed each slot's draft, the lookup's where it leads). A step whose draft
the lookup fills alone runs no MTP forward, as in the engine (`Speculator.lookup_fills`); the rows it
owes the MTP layer cost one catch-up forward before MTP next drafts, or when the request ends (the
engine's bound on rows owed, a step's token budget, is never reached by one request here). The
demo checkpoint is
small (3 layers, 128 wide, byte tokens) and was never taught to copy: its MTP layer predicts the next
bytes of Python, not the answer's copied spans, so MTP alone here is weaker on copying than a large
model's MTP would be, and the hybrid's gain over it larger.

    python benchmarks/eval_draft_sources.py [--requests 6] [--budgets 3 8]
"""

import argparse
import re
import textwrap
import time
from dataclasses import dataclass

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.entrypoints.demo import CHECKPOINT, HELDOUT

NGRAM = dict(prompt_lookup_min=3, prompt_lookup_max=8)  # bytes: n-grams of 3 to 8 bytes


@dataclass
class Request:
    prompt: list[int]
    answer: list[int]


def encode(text: str) -> list[int]:
    return list(text.encode())


def functions(text: str, count: int) -> list[str]:
    """The first `count` functions (dedented) of 200 to 1200 bytes in `text`."""
    lines, found, i = text.split("\n"), [], 0
    while i < len(lines) and len(found) < count:
        if re.match(r"^( *)def \w+\(", lines[i]):
            indent = len(lines[i]) - len(lines[i].lstrip())
            j = i + 1
            while j < len(lines) and (
                not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
            ):
                j += 1
            body = textwrap.dedent("\n".join(lines[i:j]).rstrip())
            if 200 <= len(body) <= 1200:
                found.append(body)
            i = j
        else:
            i += 1
    return found


def edited(function: str, which: int) -> tuple[str, str]:
    """-> (the instruction, the function edited): a parameter renamed, a line added, or one removed."""
    name = re.match(r"def (\w+)\((.*?)[,)=:]", function, re.S)
    params = [p for p in re.findall(r"\w+", function[function.index("(") : function.index(")")])]
    params = [p for p in params if p not in ("self", "cls") and function.count(p) >= 2]
    lines = function.split("\n")
    if which % 3 == 0 and params:
        new = params[0] + "_value"
        return f"Rename the parameter `{params[0]}` to `{new}`.", re.sub(
            rf"\b{params[0]}\b", new, function
        )
    if which % 3 != 2 or len(lines) < 4:
        indent = re.match(r" *", lines[1]).group(0) or "    "
        added = f'{indent}log.debug("{name.group(1)} called")'
        return "Log a debug line when the function is called.", "\n".join(
            lines[:1] + [added] + lines[1:]
        )
    return "Remove the last line.", "\n".join(lines[:-1])


def edit_requests(text: str, count: int) -> list[Request]:
    out = []
    for i, function in enumerate(functions(text, count)):
        instruction, new = edited(function, i)
        prompt = (
            f"user: {instruction} Answer with the whole function.\n```python\n{function}\n```\n"
        )
        out.append(Request(encode(prompt + "assistant: "), encode(f"```python\n{new}\n```\n")))
    return out


def tool_requests(text: str, count: int) -> list[Request]:
    """`count` requests: loops of 4 turns over held-out files (each turn's prompt holds the turns
    before it, their answers included)."""
    import json

    out, offset = [], 0
    while len(out) < count:
        chunk = text[offset : offset + 1200]
        chunk = chunk[: chunk.rindex("\n") + 1]
        offset += 1200
        lines = [line for line in chunk.split("\n") if len(line.strip()) > 8]
        if len(lines) < 8:
            continue
        path = f"lib/module_{offset}.py"

        def call(name: str, **args) -> str:
            return f"<tool_call>{name}\n{json.dumps(args)}</tool_call>\n"

        first, second = lines[1:4], lines[5:8]
        edits = [
            (old, [line.replace("'", '"').rstrip() + "  # tidy" for line in old])
            for old in (first, second)
        ]
        after = chunk
        for old, new in edits:
            after = after.replace("\n".join(old), "\n".join(new))
        answers = [
            call("read_file", path=path),
            call("edit_file", path=path, old="\n".join(edits[0][0]), new="\n".join(edits[0][1])),
            call("edit_file", path=path, old="\n".join(edits[1][0]), new="\n".join(edits[1][1])),
            "Done. I changed\n"
            + "".join(
                f"```\n{chr(10).join(old)}\n```\nto\n```\n{chr(10).join(new)}\n```\n"
                for old, new in edits
            ),
        ]
        results = [f"tool: {chunk}\n", "tool: ok\n", f"tool: ok\ntool: {after}\n"]
        conversation = f"system: you edit files with tools.\nuser: tidy the quotes in {path}\n"
        for turn, answer in enumerate(answers):
            prompt = conversation + "assistant: "
            out.append(Request(encode(prompt), encode(answer)))
            conversation = prompt + answer + (results[turn] if turn < len(results) else "")
    return out[:count]


def plain_requests(text: str, count: int) -> list[Request]:
    data = text.encode()
    return [
        Request(list(data[o : o + 512]), list(data[o + 512 : o + 768]))
        for o in range(8192, 8192 + count * 1024, 1024)
    ]


class TeacherMtp:
    """The checkpoint's MTP drafts along one token sequence, as the engine's drafter would make them
    after each verification: the target and MTP catch-up rows over the committed tokens are those of
    one forward over the whole sequence (teacher forcing); the chain's one-token steps write their rows
    past the committed ones, which are then written back."""

    def __init__(self, model, tokens: list[int], most: int):
        from spmoe.engine.cache.slots import KVCache

        self.model, self.tokens = model, tokens
        self.cache = KVCache.for_model(model, 1, len(tokens) + most + 1)
        self.slot = self.cache.allocate()
        n = len(tokens)
        view = self.cache.view([self.slot], [0], [n])
        ids = torch.tensor(tokens)
        self.hidden = model.forward_hidden(ids, view.positions, [n], view)  # [n, H]
        self.mtp = self._catch_up(0, n - 1)  # [n - 1, H]: row p fed (x[p + 1], hidden[p])
        self.memo: dict = {}

    def _catch_up(self, start: int, end: int) -> torch.Tensor:
        """MTP rows start .. end - 1, teacher-forced -> their post-norm hidden."""
        view = self.cache.view([self.slot], [start], [end - start])
        ids = torch.tensor(self.tokens[start + 1 : end + 1])
        return self.model.forward_draft_hidden(
            ids, view.positions, self.hidden[start:end], [end - start], view
        )

    def own(self, n: int, forced: tuple[int, ...], k: int) -> list[int]:
        """MTP's own choice at each of k slots after the first n tokens are committed, the chain fed
        the `forced` drafts of its first slots (kept for the other configurations)."""
        key = (n, forced)
        if len(self.memo.get(key, ())) >= k:
            return self.memo[key][:k]
        model, h = self.model, self.mtp[n - 2 : n - 1]
        own = [model.compute_draft_logits(h).argmax(-1)]
        for slot in range(k - 1):
            token = forced[slot] if slot < len(forced) else own[-1].item()
            view = self.cache.view([self.slot], [n - 1 + slot], [1])
            h = model.forward_draft_hidden(torch.tensor([token]), view.positions, h, [1], view)
            own.append(model.compute_draft_logits(h).argmax(-1))
        last = min(n - 1 + k - 1, len(self.tokens) - 1)
        if last > n - 1:  # the chain's rows back to the committed sequence's
            self._catch_up(n - 1, last)
        self.memo[key] = [t.item() for t in own]
        return self.memo[key]


def replay(teachers: list[TeacherMtp], requests: list[Request], speculation) -> dict:
    """Every request replayed in turn through one speculator (`teachers`: each request's MTP drafts)
    -> tokens committed per decode forward, target and MTP forwards per request, the drafts by
    source."""
    from spmoe.engine.request import Request as EngineRequest
    from spmoe.engine.runner.speculator import Speculator
    from spmoe.engine.sequence import Draft, Part, PartResult, Role, Sequence
    from spmoe.engine.stats import StepStats

    k = speculation.num_speculative_tokens
    stats = StepStats(k, speculation.lookup_name)
    speculator = Speculator(speculation, None, stats)
    forwards = decode_forwards = committed = mtp_forwards = 0
    for i, request in enumerate(requests):
        tokens = request.prompt + request.answer
        teacher = teachers[i] if speculation.mtp and k else None
        seq = Sequence(EngineRequest(str(i), request.prompt, len(request.answer)))
        seq.output, forwards = request.answer[:1], forwards + 1  # the prefill draws the first
        owed = False  # whether MTP rows are owed (steps the lookup drafted alone)
        while len(seq.output) < len(request.answer):
            n = len(request.prompt) + len(seq.output)
            proposals = {}
            if speculator.lookup is not None:
                proposals = {seq: speculator.lookup.propose(seq, k)}
            if teacher is None:
                drafts = proposals.get(seq, [])
                lookup_drafts = len(drafts)
            else:
                leads = speculator.leads(proposals)
                own = []
                if speculator.lookup_fills([seq], leads):
                    owed = True
                else:
                    own = teacher.own(n, tuple(leads.get(seq, [])), k)
                    mtp_forwards, owed = mtp_forwards + k + owed, False
                draft = speculator.merged(seq, leads, proposals, own)
                drafts, lookup_drafts = draft.tokens, draft.from_lookup
            stats.count_choices([Draft(tokens=drafts, from_lookup=lookup_drafts)])
            truth = tokens[n : n + len(drafts) + 1]
            accepted = 0
            while accepted < len(drafts) and accepted + 1 < len(truth):
                if drafts[accepted] != truth[accepted]:
                    break
                accepted += 1
            part = Part(seq=seq, role=Role.DECODE, drafts=drafts, lookup_drafts=lookup_drafts)
            result = PartResult(part=part, tokens=truth[: accepted + 1], accepted=accepted)
            stats.record_drafts([result])
            speculator.choice.observe(result)
            seq.output = seq.output + result.tokens
            forwards, decode_forwards = forwards + 1, decode_forwards + 1
            committed += len(result.tokens)
        mtp_forwards += owed
        if speculator.lookup is not None:
            speculator.lookup.finished(seq)
    return {
        "tokens_per_forward": committed / decode_forwards,
        "forwards_per_request": forwards / len(requests),
        "mtp_forwards_per_request": mtp_forwards / len(requests),
        "by_source": {
            name: (c.chosen, c.proposed, c.accepted) for name, c in stats.by_source.items()
        },
    }


def configs(budgets: list[int]) -> list[tuple[str, object]]:
    from spmoe.engine.speculation import NgramConfig, Speculation, SuffixConfig

    out = [(f"mtp k={k}", Speculation(num_speculative_tokens=k)) for k in (1, 2, 3)]
    for k in budgets:
        out += [
            (f"mtp k={k}", Speculation(num_speculative_tokens=k)) if k > 3 else None,
            (
                f"ngram k={k}",
                Speculation(num_speculative_tokens=k, mtp=False, lookup=NgramConfig(**NGRAM)),
            ),
            (
                f"suffix k={k}",
                Speculation(num_speculative_tokens=k, mtp=False, lookup=SuffixConfig()),
            ),
            (
                f"mtp+ngram k={k}",
                Speculation(num_speculative_tokens=k, lookup=NgramConfig(**NGRAM)),
            ),
            (f"mtp+suffix k={k}", Speculation(num_speculative_tokens=k, lookup=SuffixConfig())),
        ]
    return [c for c in out if c is not None]


def run(args) -> None:
    from spmoe.models.deepseek_v32.weights import load_model

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # a small model's ops: threads cost more than they give
    model = load_model(str(CHECKPOINT), ParallelConfig(), with_mtp=True)
    text = HELDOUT.read_text()
    workloads = {
        "edit": edit_requests(text, args.requests),
        "tools": tool_requests(text, args.requests),
        "plain": plain_requests(text, args.requests),
    }
    for name, requests in workloads.items():
        answer = sum(len(r.answer) for r in requests) / len(requests)
        prompt = sum(len(r.prompt) for r in requests) / len(requests)
        print(
            f"{name}: {len(requests)} requests, prompts {prompt:.0f} and answers {answer:.0f} "
            "tokens on average",
            flush=True,
        )
        most = max(args.budgets + [3])
        teachers = [TeacherMtp(model, r.prompt + r.answer, most) for r in requests]
        for label, speculation in configs(args.budgets):
            began = time.perf_counter()
            got = replay(teachers, requests, speculation)
            print(
                f"  {label:<16} tokens/forward {got['tokens_per_forward']:.3f}  forwards/request "
                f"{got['forwards_per_request']:.1f}  MTP forwards/request "
                f"{got['mtp_forwards_per_request']:.1f}  by source (led, proposed, accepted) "
                f"{got['by_source']}  [{time.perf_counter() - began:.0f} s]",
                flush=True,
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6, help="requests per workload")
    parser.add_argument("--budgets", type=int, nargs="+", default=[3, 8], help="draft slots k")
    args = parser.parse_args()
    spawn(run, 1, args)


if __name__ == "__main__":
    main()
