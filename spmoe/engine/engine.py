"""The engine: requests in, tokens out, one step at a time (`add_request`, `step`, `abort`), with
speculation optional (the MTP layer, a lookup in the context, or both: `runner/speculator.py`). A
step reads schedule -> forward -> choose -> commit -> draft -> update (docs/architecture.md).

Every rank of a TP group runs the same steps on the same requests: the logits are identical on every
rank (the LM head gathers them), and each request draws from its own seeded noise, so every rank
picks the same tokens without exchanging them. Which waiting requests join a step is decided by the
group's leader: an engine is built with its channel to the other ranks (`RankChannel`, made by
`ranks.channel()`), and `ranks.py` drives the engines of several ranks.

The KV cache is either the paged cache (`PagedKVCache`: blocks handed out as sequences grow, the
sparse DSA path) or the slot cache (`KVCache`: the dense reference).
"""

from collections.abc import Callable
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass

from msgspec.structs import replace

from spmoe.distributed import get_parallel_state
from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.request import EngineMetrics, Request, RequestOutput, SamplingParams
from spmoe.engine.rooms import BlockRoom, SlotRoom
from spmoe.engine.runner.drafter import MtpDrafter
from spmoe.engine.runner.graphs import StepNeeds
from spmoe.engine.runner.model_runner import ModelRunner
from spmoe.engine.runner.speculator import Speculator
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.engine.sampling.sampler import Sampler
from spmoe.engine.scheduler import Scheduler
from spmoe.engine.sequence import Batch, Sequence
from spmoe.engine.speculation import Speculation
from spmoe.engine.stats import KernelCompiles, StepStats
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


def check_capacity(label: str, length: int, max_new_tokens: int, drafts: int, max_len: int) -> None:
    """Raise a one-line ValueError naming `label` unless `length` prompt tokens fit a KV cache of
    `max_len` positions a sequence, with their new tokens and drafts."""
    if length + max_new_tokens + drafts > max_len:
        raise ValueError(
            f"{label} has {length} tokens; with max_new_tokens={max_new_tokens} and {drafts} "
            f"speculative tokens it needs {length + max_new_tokens + drafts} KV cache positions, "
            f"the cache holds {max_len} per sequence"
        )


def check_positions(longest: int, max_position_embeddings: int | None, what: str) -> None:
    """Raise if `longest` positions exceed the model's `max_position_embeddings` (when the config
    states it)."""
    if max_position_embeddings is not None and longest > max_position_embeddings:
        raise ValueError(
            f"{what}: {longest} positions, more than the model's max_position_embeddings = "
            f"{max_position_embeddings}"
        )


def per_prompt(sampling: SamplingParams, count: int) -> list[SamplingParams]:
    """`sampling` for `count` prompts, prompt i seeded with `sampling.seed + i`."""
    return [replace(sampling, seed=sampling.seed + i) for i in range(count)]


def scheduled_alone(scheduler: Scheduler) -> Batch | None:
    """A step's batch on a lone TP rank: its scheduler decides the admissions."""
    return scheduler.schedule()


def agreed_alone(needs: StepNeeds) -> StepNeeds:
    """A step's graph needs as one rank alone agrees on them: its own."""
    return needs


@dataclass(frozen=True)
class RankChannel:
    """How an engine keeps in step with the other ranks, given to it when it is built: `schedule`
    makes a step's batch with its admissions (a lone TP rank decides them; on several, the group's
    leader decides and sends them, and the others follow), `agree` turns this rank's CUDA graph
    needs into every DP rank's (`ranks.channel()` builds this rank's)."""

    schedule: Callable[[Scheduler], Batch | None] = scheduled_alone
    agree: Callable[[StepNeeds], StepNeeds] = agreed_alone


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
        ranks: RankChannel | None = None,
        speculation: Speculation | None = None,
    ):
        """`max_num_seqs`: sequences running at once on a paged cache (the slot cache: its slot
        count); `max_num_batched_tokens`: the tokens one step feeds, prompts being chunked to fit;
        `max_model_len`: the most positions a sequence of a paged cache may take (None: the whole
        cache; the slot cache: a slot); `enable_prefix_caching`: a paged cache keeps full blocks for
        later requests with the same prefix; `grammars`: compiles the grammars of structured-output
        requests (None: such requests are refused). With `cuda_graphs` every graph (decode steps,
        prompt chunks) is captured here (`log(line)`: a progress line for each; once the engine is
        ready, a line for each kernel variant a step compiled). `ranks`: its channel to the other
        ranks (`ranks.channel()`); None on one rank alone (ValueError on several TP ranks, or under
        DP with CUDA graphs: those must keep in step). `speculation`: what drafts (`Speculation`);
        `num_speculative_tokens` alone is short for MTP with that many drafts."""
        state = get_parallel_state()
        if ranks is None and (state.tp_size > 1 or (state.dp_size > 1 and cuda_graphs)):
            raise ValueError(
                f"an engine on {state.tp_size} TP x {state.dp_size} DP ranks keeps in step with "
                "them: expected its channel, ranks=spmoe.engine.ranks.channel() (build_engine "
                "gives it one)"
            )
        self.ranks = ranks or RankChannel()
        if speculation is None:
            speculation = Speculation(num_speculative_tokens=num_speculative_tokens)
        elif num_speculative_tokens:
            raise ValueError(
                "pass num_speculative_tokens (MTP drafts) or speculation, not both; got "
                f"{num_speculative_tokens} and {speculation}"
            )
        num_speculative_tokens, mtp_drafts = (
            speculation.num_speculative_tokens,
            speculation.mtp_drafts,
        )
        if mtp_drafts and not model.num_draft_layers:
            raise ValueError(
                "speculative decoding with MTP needs the MTP layer: load the model "
                "with with_mtp=True"
            )
        self.model, self.cache, self.k, self.grammars, self.log = (
            model,
            cache,
            num_speculative_tokens,
            grammars,
            log,
        )
        self.speculation = speculation
        if isinstance(cache, PagedKVCache):
            # the MTP layer's row at a position embeds the next token: a block depends on one token
            # past it
            lookahead = 1 if mtp_drafts else 0
            room = BlockRoom(
                cache, max_num_seqs or 256, max_model_len, enable_prefix_caching, lookahead
            )
        else:
            room = SlotRoom(cache)
        # every DP rank runs every step, empty or not
        keep_in_step = state.dp_size > 1
        self.stats = StepStats(num_speculative_tokens, speculation.lookup_name)
        self.sampler = Sampler(room.max_num_seqs, model.cfg.vocab_size, cache.device)
        self.scheduler = Scheduler(
            room, self.sampler, num_speculative_tokens, max_num_batched_tokens, keep_in_step
        )
        KernelCompiles.install()
        self.runner = ModelRunner(
            model,
            cache,
            max_num_seqs=room.max_num_seqs,
            stats=self.stats,
            sampler=self.sampler,
            num_speculative_tokens=mtp_drafts,
            cuda_graphs=cuda_graphs,
            max_model_len=room.max_tokens_per_sequence,
            max_num_batched_tokens=max_num_batched_tokens,
            agree=self.ranks.agree,
            log=log,
        )
        mtp = None
        if mtp_drafts:
            mtp = MtpDrafter(
                model,
                cache,
                mtp_drafts,
                stats=self.stats,
                graphs=self.runner.graphs,
                keep_in_step=keep_in_step,
                # its catch-up of owed rows is no larger than a step's tokens (none under DP)
                max_owed=0 if keep_in_step else max_num_batched_tokens,
            )
        self.drafter = Speculator(speculation, mtp, self.stats)
        self._ready_count: int | None = None  # compiles + captures when the engine was marked warm

    def graph_captures(self) -> int:
        """CUDA graphs this engine has captured."""
        return self.runner.graphs.captures if self.runner.graphs is not None else 0

    def _compiles(self) -> int:
        return len(KernelCompiles.names) + self.graph_captures()

    def mark_ready(self) -> None:
        """The engine is warm (`warmup.warm_up`): its step statistics and counters (`metrics()`:
        steps, tokens) start afresh, and from here it counts the compiles and captures that warming
        up did not foresee (`metrics().compiles_after_ready`)."""
        self.reset_stats()
        self.stats.reset_totals()
        self._ready_count = self._compiles()

    def reset_stats(self) -> None:
        """Start the per-phase timings, collective counts, acceptance statistics and step numbers
        afresh."""
        self.stats.reset()
        self.scheduler.steps = 0

    # The request API.

    def validate(self, request: Request) -> None:
        """Raise a one-line ValueError unless the request can ever run here: what only the engine
        knows (its KV cache's room for a sequence, the model's positions, whether it compiles
        grammars). The rest of a request is checked where it is read: the server's front end, the
        batch job's input."""
        label = f"request {request.request_id!r}: the prompt"
        room = self.scheduler.room.max_tokens_per_sequence
        check_capacity(label, len(request.prompt), request.max_new_tokens, self.k, room)
        check_positions(
            len(request.prompt) + request.max_new_tokens + self.k,
            self.model.cfg.max_position_embeddings,
            f"{label} with its new and speculative tokens",
        )
        if request.grammar is not None and self.grammars is None:
            raise ValueError(
                f"request {request.request_id!r} has a grammar, but this engine has no compiler"
            )

    def add_request(self, request: Request, record_logits: bool = False) -> Sequence:
        """Queue a request; it joins the running batch when the cache has room. `record_logits`
        keeps the logits row behind every token it generates (`Sequence.logits`). -> its sequence.
        ValueError (nothing queued) if it cannot run here (`validate`) or its id is in the engine
        already."""
        self.validate(request)
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
        queries, hits = self.scheduler.room.prefix_cache_counts()
        return EngineMetrics(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.scheduler.room.usage(),
            generated_tokens=totals.generated_tokens,
            draft_proposed=totals.draft_proposed,
            draft_accepted=totals.draft_accepted,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            preemptions=self.scheduler.preemptions,
            steps=totals.steps,
            steps_compiling=totals.steps_compiling,
            kernel_compiles=len(KernelCompiles.names),
            graph_captures=self.graph_captures(),
            compiles_after_ready=0
            if self._ready_count is None
            else self._compiles() - self._ready_count,
            drafts=totals.drafts,
            accepted_per_position=list(totals.accepted_per_position),
            by_source={name: deepcopy(counts) for name, counts in totals.by_source.items()},
            request_tables={
                "scheduler_requests": len(self.scheduler.requests),
                **self.scheduler.room.request_tables(),
            },
        )

    def step(self) -> list[RequestOutput]:
        """One step: schedule -> forward -> choose -> commit -> draft -> update. -> one output per
        sequence that drew this step. With nothing to run it returns at once, except under DP, where
        every rank runs every step."""
        batch = self.ranks.schedule(self.scheduler)
        if batch is None:
            return []
        with self._counted(batch):
            forward = self.runner.forward(batch)
            results = self.runner.choose(batch, forward)
            for result in results:
                result.part.seq.commit(result, batch.step)
            drafts = self.drafter.draft(batch, forward, results)
        self.stats.record(batch, results)
        return self.scheduler.update(results, drafts)

    @contextmanager
    def _counted(self, batch: Batch):
        """Count the step, and whether a kernel compiled or a graph was captured in it (once the
        engine is ready, each such kernel is named in the log)."""
        before, kernels_before = self._compiles(), len(KernelCompiles.names)
        yield
        self.stats.totals.steps += 1
        self.stats.totals.steps_compiling += self._compiles() > before
        if self._ready_count is not None and self.log is not None:
            tokens = sum(len(part.tokens) for part in batch.parts)
            for name in KernelCompiles.names[kernels_before:]:
                self.log(f"compiled after ready, in a step of {tokens} tokens: {name}")

    def report(self, seqs: list[Sequence], seconds: float) -> dict:
        """The statistics of a batch job over `seqs` that took `seconds`."""
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
