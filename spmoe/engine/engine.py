"""The engine: requests in, tokens out, one step at a time, with MTP speculation optional.

Every rank of the TP group runs the same steps on the same requests. The logits are identical on every rank
(the LM head gathers them), and each request samples from its own seeded generator, so every rank picks the
same tokens and the ranks stay in step without exchanging them. Under DP each DP group has its own engine and
requests; every DP rank steps together (the MoE dispatch spans all of them), with an empty batch if need be.

The KV cache is either the paged cache (`PagedKVCache`: blocks handed out as sequences grow, the sparse DSA
path; the default of `spmoe generate` and `spmoe serve`) or the slot cache (`KVCache`: the dense reference).

One step:
1. Schedule (`scheduler.py`): decode tokens first, then prompt chunks under the token budget; admit waiting
   requests while the cache has room; grow every running sequence's room, preempting when it runs out.
2. One target forward over every scheduled sequence's tokens, laid end to end (`model_runner.py`): a chunk
   of a prompt, else its last token followed by its drafts when speculating. A plain decode step therefore
   has N = the number of running sequences: N = 1, 2 or 3 on 2 to 4 ranks is the everyday case. With
   `cuda_graphs`, plain decode steps replay a captured graph; prefill stays eager.
3. Commit: a sequence that fed its last pending token samples from its last row with its own sampler, or
   accepts drafts greedily (`speculative.py`); a prompt chunk only advances the cached count.
4. Finish sequences at an eos id or `max_new_tokens`; free their cache room. A sequence whose logits hold a
   NaN or an infinity has no next token: it finishes with finish_reason "error" and an error naming the step,
   and the others carry on (the server keeps serving); `generate` raises that error instead.
5. When speculating, the drafter catches up on the fed positions and proposes the next drafts.

`generate` is the batch job (spmoe generate, the demo) on top of `add_request` / `step`.
"""

import time
from dataclasses import dataclass, field, replace

import torch

from spmoe.distributed import CommStats, count_collectives, get_parallel_state
from spmoe.distributed.comm import all_reduce
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.model_runner import ModelRunner
from spmoe.engine.paged_cache import PagedKVCache
from spmoe.engine.request import EngineMetrics, Request, RequestOutput
from spmoe.engine.sampling import Sampler, SamplingParams, greedy
from spmoe.engine.scheduler import BlockRoom, Scheduler, Sequence, SlotRoom
from spmoe.engine.speculative import MtpDrafter, accept_greedy
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

PHASES = ("prefill", "decode", "draft")


@dataclass
class Phase:
    forwards: int = 0
    tokens_fed: int = 0
    tokens_committed: int = 0
    seconds: float = 0.0
    collectives: CommStats = field(default_factory=CommStats)

    def as_dict(self) -> dict:
        return {
            "forwards": self.forwards,
            "tokens_fed": self.tokens_fed,
            "tokens_committed": self.tokens_committed,
            "seconds": self.seconds,
            "collectives": self.collectives.as_dict(),
        }


@dataclass
class Generation:
    outputs: list[list[int]]
    stats: dict
    logits: list[torch.Tensor] | None  # per sequence `[len(output), V]` float32, when recorded


def check_prompt(label: str, prompt, vocab_size: int, max_new_tokens: int, drafts: int, max_len: int) -> None:
    """Raise a one-line ValueError naming `label` unless the prompt is valid and fits the KV cache with its new
    tokens and drafts."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if (
        not isinstance(prompt, list)
        or not prompt
        or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in prompt)
    ):
        raise ValueError(f"{label} must be a non-empty list of token ids in [0, {vocab_size}), got {str(prompt)[:60]}")
    if len(prompt) + max_new_tokens + drafts > max_len:
        raise ValueError(
            f"{label} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} and {drafts} "
            f"speculative tokens it needs {len(prompt) + max_new_tokens + drafts} KV cache positions, "
            f"the cache holds {max_len} per sequence"
        )


def check_positions(longest: int, max_position_embeddings: int | None, what: str) -> None:
    """Raise if `longest` positions exceed the model's `max_position_embeddings` (when the config states it)."""
    if max_position_embeddings is not None and longest > max_position_embeddings:
        raise ValueError(
            f"{what}: {longest} positions, more than the model's max_position_embeddings = {max_position_embeddings}"
        )


def check_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: int, drafts: int, max_len: int) -> None:
    """Raise unless every prompt is valid and fits the KV cache with its new tokens and drafts."""
    for i, prompt in enumerate(prompts):
        check_prompt(f"prompt {i}", prompt, vocab_size, max_new_tokens, drafts, max_len)


def check_speculation(sampling: SamplingParams, num_speculative_tokens: int) -> None:
    if num_speculative_tokens and not sampling.greedy:
        raise ValueError(
            f"speculative decoding accepts drafts greedily; expected temperature 0, got {sampling.temperature}"
        )


def per_prompt(sampling: SamplingParams, count: int) -> list[SamplingParams]:
    """`sampling` for `count` prompts, prompt i seeded with `sampling.seed + i`."""
    return [replace(sampling, seed=sampling.seed + i) for i in range(count)]


class Engine:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        num_speculative_tokens: int = 0,
        cuda_graphs: bool = False,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
    ):
        """`max_num_seqs`: sequences running at once on a paged cache (the slot cache: its slot count);
        `max_num_batched_tokens`: the tokens one step feeds, prompts being chunked to fit; `max_model_len`: the
        most positions a sequence of a paged cache may take (None: the whole cache; the slot cache: a slot)."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if num_speculative_tokens and not model.num_draft_layers:
            raise ValueError("speculative decoding needs the MTP layer: load the model with with_mtp=True")
        if num_speculative_tokens and cuda_graphs:
            raise ValueError(
                "CUDA graphs capture the plain decode step only; speculative decoding runs eagerly, "
                "so pass one or the other"
            )
        self.model, self.cache, self.k = model, cache, num_speculative_tokens
        room = (
            BlockRoom(cache, max_num_seqs or 256, max_model_len) if isinstance(cache, PagedKVCache) else SlotRoom(cache)
        )
        self.scheduler = Scheduler(room, num_speculative_tokens, max_num_batched_tokens)
        self.runner = ModelRunner(model, cache, room.max_num_seqs, cuda_graphs)
        self.drafter = MtpDrafter(model, cache, num_speculative_tokens) if num_speculative_tokens else None
        self.counters = EngineMetrics()  # the counters since start; running / waiting / usage filled on demand
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start the per-phase timings, collective counts and acceptance statistics that `stats` reports."""
        self.phases = {name: Phase() for name in PHASES}
        self.verify_steps = 0  # sequences whose drafts a target forward verified, summed over steps
        self.accepted_at = [0] * self.k  # verifications that accepted more than j drafts, per j

    # The request API.

    def validate(self, request: Request) -> None:
        """Raise a one-line ValueError unless the request is well formed and can ever fit the cache."""
        label = f"request {request.request_id!r}: the prompt"
        cfg = self.model.cfg
        check_prompt(
            label,
            request.prompt,
            cfg.vocab_size,
            request.max_new_tokens,
            self.k,
            self.scheduler.room.max_tokens_per_sequence,
        )
        check_positions(
            len(request.prompt) + request.max_new_tokens + self.k,
            cfg.max_position_embeddings,
            f"{label} with its new and speculative tokens",
        )
        check_speculation(request.sampling, self.k)

    def add_request(self, request: Request, record_logits: bool = False) -> Sequence:
        """Queue a request; it joins the running batch when the cache has room. `record_logits` keeps the
        logits row behind every token it generates (`Sequence.logits`). -> its sequence."""
        self.validate(request)
        if self.scheduler.holds(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in the engine; expected a new id")
        seq = Sequence(request, Sampler(request.sampling), record_logits)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop the request and free its cache; an unknown or finished id is ignored."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.scheduler.room.usage(),
            self.counters.generated_tokens,
            self.counters.draft_proposed,
            self.counters.draft_accepted,
            self.scheduler.preemptions,
        )

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Schedule, run the batch, commit. -> one output per request that committed tokens this step (a
        prompt chunk before the last commits none). With nothing to run it returns at once, except under DP,
        where every rank must run every step."""
        work = self.scheduler.schedule()
        if not work and get_parallel_state().dp_size == 1:
            return []
        room = self.scheduler.room
        decode = all(not s.prefilling for s, _ in work)
        phase = self.phases["decode" if decode else "prefill"]
        began = time.perf_counter()
        samples = [n == len(s.pending) for s, n in work]  # fed all it had: it samples
        with count_collectives(phase.collectives):
            logits, hidden = self.runner.run(
                [s.pending[:n] for s, n in work],
                [room.location(s) for s, _ in work],
                [s.cached for s, _ in work],
                [1 + len(s.drafts) if last else 0 for (s, _), last in zip(work, samples)],
                decode,
                phase.collectives,
            )
        outputs, to_draft, row, fed = [], [], 0, 0
        # every greedy choice of the step (and whether its row is finite) in one host transfer
        committing = [s for (s, _), last in zip(work, samples) if last]
        greedy_rows = greedy(logits) if any(s.drafts or s.sampler.params.greedy for s in committing) else None
        for (seq, n), last in zip(work, samples):
            if not last:  # a prompt chunk: the MTP layer catches up on it with the next prompt tokens
                if self.drafter is not None:
                    to_draft.append((seq, seq.cached, seq.pending[1 : n + 1], hidden[fed : fed + n], False))
                seq.cached += n
                seq.pending = seq.pending[n:]
                fed += n
                continue
            rows = slice(row, row + 1 + len(seq.drafts))
            row += 1 + len(seq.drafts)
            seq.prefilling = False
            new, verified = self._commit(seq, logits[rows], greedy_rows and tuple(g[rows] for g in greedy_rows))
            phase.tokens_committed += len(new)
            outputs.append(
                RequestOutput(seq.request_id, new, seq.finish_reason, seq.error, prompt_tokens=len(seq.request.prompt))
            )
            if not new:  # its logits were not finite: it left the batch with an error
                fed += n
                continue
            if self.drafter is not None and seq.finish_reason is None:
                next_ids = seq.pending[1:verified] + [new[-1]]
                to_draft.append((seq, seq.cached, next_ids, hidden[fed : fed + verified], True))
            fed += n
            seq.cached += verified
            seq.pending, seq.drafts = [new[-1]], []
        phase.forwards += 1
        phase.tokens_fed += fed
        phase.seconds += time.perf_counter() - began
        if self.drafter is not None and (to_draft or get_parallel_state().dp_size > 1):
            self._draft(to_draft)  # under DP even an empty draft step runs, to keep the ranks in step
        return outputs

    def _commit(
        self, seq: Sequence, logits: torch.Tensor, greedy_rows: tuple[list[int], list[bool]] | None
    ) -> tuple[list[int], int]:
        """logits `[1 + drafts, V]` of one sequence, and their greedy choices and finite flags (`greedy`, read
        for the whole step at once; None when no sequence of the step is greedy) -> (the tokens it commits, its
        fed tokens whose cache rows stay valid). Finishes the sequence at an eos id or its token limit, or, with
        no token at all, when a row it would commit from is not finite (finish_reason "error", `seq.error`
        naming the step)."""
        if seq.drafts:
            choices, finite = greedy_rows
            accepted, candidates = accept_greedy(seq.drafts, choices)
            self.verify_steps += 1
            for j in range(accepted):
                self.accepted_at[j] += 1
            self.counters.draft_proposed += len(seq.drafts)
            self.counters.draft_accepted += accepted
        elif seq.sampler.params.greedy:
            accepted, (candidates, finite) = 0, greedy_rows
        else:
            accepted, (candidates, finite) = 0, seq.sampler(logits)
        if not all(finite[: len(candidates)]):
            step = self.phases["prefill"].forwards + self.phases["decode"].forwards + 1
            seq.error = (
                f"non-finite logits (NaN or inf) at step {step} ({'decode' if seq.cached else 'prefill'}) "
                f"for request {seq.request_id!r} after {len(seq.output)} generated tokens: no token can be "
                f"chosen (check the checkpoint for NaN / inf weights)"
            )
            self.scheduler.finish(seq, "error")
            return [], 0
        verified = len(seq.pending) - (len(seq.drafts) - accepted)
        request, new = seq.request, []
        for j, token in enumerate(candidates):
            new.append(token)
            seq.output.append(token)
            if seq.record_logits:
                seq.logits.append(logits[j].cpu())
            if token in request.eos_token_ids or len(seq.output) == request.max_new_tokens:
                self.scheduler.finish(seq, "stop" if token in request.eos_token_ids else "length")
                break
        self.counters.generated_tokens += len(new)
        return new, verified

    def _draft(self, to_draft: list) -> None:
        """to_draft: (sequence, first fed position, the token after each fed position, the target's hidden
        `[n, H]` there, whether it keeps the drafts); a prompt chunk before the last only fills the MTP
        layer's cache rows."""
        phase, began = self.phases["draft"], time.perf_counter()
        room = self.scheduler.room
        with count_collectives(phase.collectives):
            hidden = [h for *_, h, _ in to_draft] or [
                torch.zeros(0, self.model.cfg.hidden_size, dtype=self.cache.dtype, device=self.cache.device)
            ]
            drafts = self.drafter.propose(
                [room.location(s) for s, *_ in to_draft],
                [start for _, start, *_ in to_draft],
                [ids for _, _, ids, *_ in to_draft],
                torch.cat(hidden),
            )
        for (seq, *_, keep), proposed in zip(to_draft, drafts):
            if keep:
                seq.drafts = proposed
                seq.pending = seq.pending + proposed
        phase.forwards += self.k
        phase.tokens_fed += sum(len(ids) for _, _, ids, *_ in to_draft) + (self.k - 1) * len(to_draft)
        phase.seconds += time.perf_counter() - began

    # The batch job.

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        eos_token_ids: tuple[int, ...] = (),
        record_logits: bool = False,
        on_step=None,
    ) -> Generation:
        """Generate up to `max_new_tokens` after each prompt, stopping at any of `eos_token_ids`. `sampling`:
        one per prompt, or one for all, prompt i then sampling from seed `sampling.seed + i`.
        `on_step(done_tokens, live_sequences, prompt_tokens_cached)` is called after every step (for progress
        output; the last counts the prompt tokens prefilled so far). A request that ends with an error
        (non-finite logits) stops the job: FloatingPointError with its message."""
        samplings = sampling if isinstance(sampling, list) else per_prompt(sampling, len(prompts))
        self.reset_stats()
        seqs = [
            self.add_request(
                Request(f"generate-{i}", list(p), max_new_tokens, params, tuple(eos_token_ids)), record_logits
            )
            for i, (p, params) in enumerate(zip(prompts, samplings))
        ]
        start = time.perf_counter()
        while self._any_rank_busy(self.has_unfinished()):
            failed = [out.error for out in self.step() if out.finish_reason == "error"]
            if failed:
                raise FloatingPointError(failed[0])
            if on_step is not None:
                on_step(
                    sum(len(s.output) for s in seqs),
                    len(self.scheduler.running),
                    sum(min(s.cached, len(s.request.prompt)) for s in seqs),
                )
        return Generation(
            [s.output for s in seqs],
            self._stats(seqs, time.perf_counter() - start),
            [torch.stack(s.logits) for s in seqs] if record_logits else None,
        )

    def _any_rank_busy(self, busy: bool) -> bool:
        """With DP > 1 every rank runs every step (the MoE dispatch spans all of them), so a DP rank that is
        done keeps stepping with an empty batch until every rank is done: one tiny all-reduce per step."""
        state = get_parallel_state()
        if state.dp_size == 1:
            return busy
        flag = torch.tensor([int(busy)], device=state.device)
        return bool(all_reduce(flag, state.ep_group, op="max").item())

    def _stats(self, seqs: list[Sequence], seconds: float) -> dict:
        generated = sum(len(s.output) for s in seqs)
        decode = self.phases["decode"]
        decode_s = decode.seconds + self.phases["draft"].seconds
        graphs = self.runner.graphs
        stats = {
            "sequences": len(seqs),
            "prompt_tokens": sum(len(s.request.prompt) for s in seqs),
            "generated_tokens": generated,
            "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds else 0.0,
            "prefill_s": self.phases["prefill"].seconds,
            "decode_s": decode_s,
            "decode_tokens_per_s": decode.tokens_committed / decode_s if decode_s else 0.0,
            "phases": {name: phase.as_dict() for name, phase in self.phases.items()},
            "kv_cache": self.scheduler.room.stats(),
            "preemptions": self.scheduler.preemptions,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "cuda_graph_batch_sizes": graphs.batch_sizes() if graphs else [],
        }
        if self.k:
            steps, accepted = self.verify_steps, sum(self.accepted_at)
            stats["speculative"] = {
                "num_speculative_tokens": self.k,
                "verify_steps": steps,
                "proposed": steps * self.k,
                "accepted": accepted,
                "acceptance_rate": accepted / (steps * self.k) if steps else 0.0,
                "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
                "per_position": [count / steps if steps else 0.0 for count in self.accepted_at],
            }
        return stats
