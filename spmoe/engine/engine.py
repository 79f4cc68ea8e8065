"""The engine: requests in, tokens out, one step at a time, with MTP speculation optional.

Every rank of the TP group runs the same steps on the same requests. The logits are identical on every rank
(the LM head gathers them), and each request samples from its own seeded generator, so every rank picks the
same tokens and the ranks stay in step without exchanging them. Under DP each DP group has its own engine and
requests; every DP rank steps together (the MoE dispatch spans all of them), with an empty batch if need be.

The KV cache is either the paged cache (`PagedKVCache`: blocks handed out as sequences grow, the sparse DSA
path; the default of `spmoe generate` and `spmoe serve`) or the slot cache (`KVCache`: the dense reference).

One step is three calls on named records (`sequence.py`):
1. `Scheduler.schedule() -> ScheduledBatch` (`scheduler.py`): decode tokens first, then prompt chunks under the
   token budget; admit waiting requests while the cache has room (decided on the DP group's TP rank 0, with
   what each reuses from the prefix cache, and followed by the other ranks: `serving_loop.py`); grow every
   running sequence's room, preempting when it runs out.
2. `ModelRunner.run(batch) -> StepResult` (`model_runner.py`): one target forward over every scheduled
   sequence's tokens, laid end to end (a chunk of a prompt, else its last token followed by its drafts when
   speculating; with `cuda_graphs`, decode steps replay a captured graph), the choice of each sampling
   sequence's tokens (every row of the step through the batched `Sampler`, `sampling.py`, then the lossless
   acceptance of drafts, `rejection.py`, for greedy and sampled requests alike), the prompt logprobs asked
   for, and the MTP drafter's next drafts.
3. `Scheduler.update(batch, result) -> list[RequestOutput]`: commit the tokens, finish sequences at an eos id
   or `max_new_tokens` and free their room. A sequence whose logits hold a NaN or an infinity has no next
   token: it finishes with finish_reason "error" and an error naming the step, and the others carry on (the
   server keeps serving); `generate` raises that error instead.
`stats.py` counts the forwards, tokens, seconds and collectives of each phase, and the MTP acceptance.

`generate` is the batch job (spmoe generate, the demo) on top of `add_request` / `step`, driven on every rank by
`serving_loop.run_to_completion`; `spmoe serve` drives engines through `serving_loop.ServingLoop`.
"""

import time
from dataclasses import dataclass, replace

import torch

from spmoe.distributed import get_parallel_state
from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.ranks import run_to_completion, schedule_in_group
from spmoe.engine.request import EngineMetrics, Request, RequestOutput
from spmoe.engine.runner.model_runner import ModelRunner
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.engine.sampling.sampler import Sampler, SamplingParams
from spmoe.engine.scheduler import BlockRoom, Scheduler, SlotRoom
from spmoe.engine.sequence import ScheduledBatch, Sequence
from spmoe.engine.stats import KernelCompiles, StepStats
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


@dataclass
class Generation:
    outputs: list[list[int]]
    stats: dict
    logits: list[torch.Tensor] | None  # per sequence `[len(output), V]` float32, when recorded


def check_prompt(
    label: str, prompt, vocab_size: int, max_new_tokens: int, drafts: int, max_len: int
) -> None:
    """Raise a one-line ValueError naming `label` unless the prompt is valid and fits the KV cache with its new
    tokens and drafts."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if (
        not isinstance(prompt, list)
        or not prompt
        or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in prompt
        )
    ):
        raise ValueError(
            f"{label} must be a non-empty list of token ids in [0, {vocab_size}), got {str(prompt)[:60]}"
        )
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


def check_prompts(
    prompts: list[list[int]], vocab_size: int, max_new_tokens: int, drafts: int, max_len: int
) -> None:
    """Raise unless every prompt is valid and fits the KV cache with its new tokens and drafts."""
    for i, prompt in enumerate(prompts):
        check_prompt(f"prompt {i}", prompt, vocab_size, max_new_tokens, drafts, max_len)


def check_sampling(
    label: str, sampling: SamplingParams, max_new_tokens: int, vocab_size: int
) -> None:
    """Raise a one-line ValueError unless the sampling settings fit the model and the request."""
    bad = [token for token, _ in sampling.logit_bias if token >= vocab_size]
    if bad:
        raise ValueError(
            f"{label}: logit_bias token ids must be in [0, {vocab_size}), got {bad[0]}"
        )
    if sampling.min_tokens > max_new_tokens:
        raise ValueError(
            f"{label}: min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({max_new_tokens})"
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
        enable_prefix_caching: bool = True,
        grammars: GrammarCompiler | None = None,
        log=None,
    ):
        """`max_num_seqs`: sequences running at once on a paged cache (the slot cache: its slot count);
        `max_num_batched_tokens`: the tokens one step feeds, prompts being chunked to fit; `max_model_len`: the
        most positions a sequence of a paged cache may take (None: the whole cache; the slot cache: a slot);
        `enable_prefix_caching`: a paged cache keeps full blocks for later requests with the same prefix;
        `grammars`: compiles the grammars of structured-output requests (None: such requests are refused). With
        `cuda_graphs` every graph (decode steps, prompt chunks) is captured here (`log(line)`: a progress line
        for each; once the engine is ready, a line for each kernel variant a step compiled)."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if num_speculative_tokens and not model.num_draft_layers:
            raise ValueError(
                "speculative decoding needs the MTP layer: load the model with with_mtp=True"
            )
        self.model, self.cache, self.k, self.grammars, self.log = (
            model,
            cache,
            num_speculative_tokens,
            grammars,
            log,
        )
        if isinstance(cache, PagedKVCache):
            # the MTP layer's row at a position embeds the next token: a block depends on one token past it
            lookahead = 1 if num_speculative_tokens else 0
            room = BlockRoom(
                cache, max_num_seqs or 256, max_model_len, enable_prefix_caching, lookahead
            )
        else:
            room = SlotRoom(cache)
        keep_in_step = (
            get_parallel_state().dp_size > 1
        )  # every DP rank runs every step, empty or not
        self.stats = StepStats(num_speculative_tokens)
        self.sampler = Sampler(room.max_num_seqs, model.cfg.vocab_size, cache.device)
        self.scheduler = Scheduler(
            room, self.sampler, num_speculative_tokens, max_num_batched_tokens, keep_in_step
        )
        KernelCompiles.install()
        self.runner = ModelRunner(
            model,
            cache,
            room.max_num_seqs,
            self.stats,
            self.sampler,
            num_speculative_tokens,
            cuda_graphs,
            keep_in_step,
            room.max_tokens_per_sequence,
            max_num_batched_tokens,
            log,
        )
        self._ready_count: int | None = None  # compiles + captures when the engine was marked warm

    def graph_captures(self) -> int:
        """CUDA graphs this engine has captured."""
        return self.runner.graphs.captures if self.runner.graphs is not None else 0

    def _compiles(self) -> int:
        return len(KernelCompiles.names) + self.graph_captures()

    def mark_ready(self) -> None:
        """The engine is warm (`warmup.warm_up`): its step statistics and counters (`metrics()`: steps, tokens)
        start afresh, and from here it counts the compiles and captures that warming up did not foresee
        (`metrics().compiles_after_ready`)."""
        self.reset_stats()
        self.stats.reset_totals()
        self._ready_count = self._compiles()

    def reset_stats(self) -> None:
        """Start the per-phase timings, collective counts, acceptance statistics and step numbers afresh."""
        self.stats.reset()
        self.scheduler.steps = 0

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
        check_sampling(
            label.removesuffix(": the prompt"),
            request.sampling,
            request.max_new_tokens,
            cfg.vocab_size,
        )
        if request.grammar is not None:
            if self.grammars is None:
                raise ValueError(
                    f"request {request.request_id!r} has a grammar, but this engine has no compiler"
                )

    def add_request(self, request: Request, record_logits: bool = False) -> Sequence:
        """Queue a request; it joins the running batch when the cache has room. `record_logits` keeps the
        logits row behind every token it generates (`Sequence.logits`). -> its sequence."""
        self.validate(request)
        if self.scheduler.holds(request.request_id):
            raise ValueError(
                f"request id {request.request_id!r} is already in the engine; expected a new id"
            )
        grammar = None
        if request.grammar is not None:
            grammar = self.grammars.matcher(request.grammar, request.grammar_start_after)
        seq = Sequence(request, record_logits, grammar)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop the request and free its cache; an unknown or finished id is ignored."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def metrics(self) -> EngineMetrics:
        totals = self.stats.totals
        return EngineMetrics(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.scheduler.room.usage(),
            totals.generated_tokens,
            totals.draft_proposed,
            totals.draft_accepted,
            *self.scheduler.room.prefix_cache_counts(),
            self.scheduler.preemptions,
            totals.steps,
            totals.steps_compiling,
            len(KernelCompiles.names),
            self.graph_captures(),
            0 if self._ready_count is None else self._compiles() - self._ready_count,
            totals.drafts,
            list(totals.accepted_per_position),
        )

    def step(self) -> list[RequestOutput]:
        """Schedule (the DP group's TP rank 0 decides what joins, the other TP ranks follow:
        `serving_loop.schedule_in_group`), run the batch, commit. -> one output per request that committed tokens
        this step (a prompt chunk before the last commits none). With nothing to run it returns at once, except
        under DP, where every rank must run every step."""
        return self.run(schedule_in_group(self))

    def schedule(self, admissions: list[tuple[str, int]] | None = None) -> ScheduledBatch | None:
        """The step's batch (`Scheduler.schedule`): `admissions` None: this rank decides which waiting requests
        join and what they reuse from the prefix cache (the batch's `admissions`); else it follows the deciding
        rank's."""
        return self.scheduler.schedule(admissions)

    def has_waiting(self) -> bool:
        """Whether a request waits to join the running batch."""
        return bool(self.scheduler.waiting)

    def run(self, batch: ScheduledBatch | None) -> list[RequestOutput]:
        """Run a scheduled batch and commit it. -> one output per request that committed tokens (none for
        None: nothing to run)."""
        if batch is None:
            return []
        before, kernels_before = self._compiles(), len(KernelCompiles.names)
        result = self.runner.run(batch)
        self.stats.record(batch, result)
        self.stats.totals.steps += 1
        self.stats.totals.steps_compiling += self._compiles() > before
        if (
            self._ready_count is not None and self.log is not None
        ):  # what warming up did not foresee, named
            for name in KernelCompiles.names[kernels_before:]:
                self.log(
                    f"compiled after ready, in a step of {sum(batch.num_tokens)} tokens: {name}"
                )
        return self.scheduler.update(batch, result)

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
                Request(f"generate-{i}", list(p), max_new_tokens, params, tuple(eos_token_ids)),
                record_logits,
            )
            for i, (p, params) in enumerate(zip(prompts, samplings))
        ]
        start = time.perf_counter()

        def progress() -> None:
            on_step(
                sum(len(s.output) for s in seqs),
                len(self.scheduler.running),
                sum(min(s.cached, len(s.request.prompt)) for s in seqs),
            )

        run_to_completion(self, progress if on_step is not None else None)
        return Generation(
            [s.output for s in seqs],
            self._stats(seqs, time.perf_counter() - start),
            [torch.stack(s.logits) for s in seqs] if record_logits else None,
        )

    def _stats(self, seqs: list[Sequence], seconds: float) -> dict:
        generated = sum(len(s.output) for s in seqs)
        graphs = self.runner.graphs
        return {
            "sequences": len(seqs),
            "prompt_tokens": sum(len(s.request.prompt) for s in seqs),
            "generated_tokens": generated,
            "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds else 0.0,
            **self.stats.as_dict(),
            "kv_cache": self.scheduler.room.stats(),
            "preemptions": self.scheduler.preemptions,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "cuda_graph_batch_sizes": graphs.batch_sizes() if graphs else [],
        }
